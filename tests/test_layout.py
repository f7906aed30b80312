"""The daemon's package layout is its architecture: these rules say who may import what.

- Only ``engine/`` and ``worker/`` import vllm (anything else would pay for vLLM at import, or run
  vLLM code outside the one place that owns the engine).
- ``api/`` (the doors: gRPC, HTTP, audit) reaches the daemon only through ``core`` and the plain
  data it answers with (``views``, ``events``): a door holds no state and bypasses no owner.
- ``worker/`` runs inside vLLM's processes and imports nothing of the daemon's serving state.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PKG = Path(__file__).resolve().parent.parent / "daemon" / "loractld"


def _modules():
    for path in sorted(PKG.rglob("*.py")):
        yield path.relative_to(PKG), ast.parse(path.read_text(), str(path))


def _imports(tree: ast.AST) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found


MODULES = list(_modules())


def test_the_layout_has_its_subpackages():
    assert {p.parts[0] for p, _ in MODULES if len(p.parts) > 1} >= {"api", "engine", "worker", "store", "serving",
                                                                      "models"}
    # The daemon package's own top level stays small: the core and its process-wide pieces.
    assert len([p for p, _ in MODULES if len(p.parts) == 1]) <= 15


@pytest.mark.parametrize("path,tree", MODULES, ids=[str(p) for p, _ in MODULES])
def test_only_engine_and_worker_import_vllm(path, tree):
    if path.parts[0] in ("engine", "worker"):
        return
    bad = sorted(m for m in _imports(tree) if m == "vllm" or m.startswith("vllm."))
    assert not bad, f"{path} imports {bad}: only loractld/engine and loractld/worker may import vllm"


API_MAY_IMPORT = ("loractld.api", "loractld.core", "loractld.views", "loractld.events", "loractld.trust")


@pytest.mark.parametrize("path,tree", [(p, t) for p, t in MODULES if p.parts[0] == "api"],
                         ids=[str(p) for p, _ in MODULES if p.parts[0] == "api"])
def test_api_reaches_the_daemon_only_through_the_core(path, tree):
    bad = sorted(m for m in _imports(tree) if m.startswith("loractld.") and not m.startswith(API_MAY_IMPORT)
                 and m.rpartition(".")[0] not in API_MAY_IMPORT)
    assert not bad, f"{path} imports {bad}; a door goes through loractld.core"


@pytest.mark.parametrize("path,tree", [(p, t) for p, t in MODULES if p.parts[0] == "worker"],
                         ids=[str(p) for p, _ in MODULES if p.parts[0] == "worker"])
def test_worker_code_imports_nothing_of_the_daemons_state(path, tree):
    bad = sorted(m for m in _imports(tree) if m.startswith("loractld.")
                 and not m.startswith("loractld.worker"))
    assert not bad, f"{path} runs inside vLLM's worker and imports {bad}"


def test_the_rules_would_catch_a_breach():
    """The checks read real import statements: a planted vllm import in api/ is seen."""
    tree = ast.parse("from vllm.lora.request import LoRARequest\nfrom loractld.store.disk import Store\n")
    assert "vllm.lora.request" in _imports(tree)
    assert "loractld.store.disk" in _imports(tree)
