"""The daemon's package layout is its architecture: these rules say who may import what.

- Only ``engine/`` and ``worker/`` import vllm (anything else would pay for vLLM at import, or run
  vLLM code outside the one place that owns the engine).
- ``api/`` (the doors: gRPC, HTTP, audit) reaches the daemon only through ``core`` and the plain
  data it answers with (``views``, ``events``): a door holds no state and bypasses no owner.
- ``worker/`` runs inside vLLM's processes and imports nothing of the daemon's serving state.
- Arrows point down: every daemon module sits on a floor (``FLOORS``) and imports only from its
  own floor or lower ones; and no daemon modules import each other in a cycle. Both read every
  import: at module level, inside functions, under ``if TYPE_CHECKING:``, relative or absolute,
  ``import x`` and ``from x import y``, and ``importlib.import_module("loractld...")``. An import
  kept inside a function, or typed only, is still an arrow: it says what the module knows.
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


def _context_vars(tree: ast.AST) -> list[int]:
    """Lines that make or import a ``contextvars.ContextVar``."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and node.attr == "ContextVar":
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "contextvars":
            lines.append(node.lineno)
    return lines


@pytest.mark.parametrize("path,tree", MODULES, ids=[str(p) for p, _ in MODULES])
def test_no_context_variable_carries_request_state(path, tree):
    """A request's scope (its adapter, profile template, first token) is an object passed down
    (``engine.openai_serving``: a handler copy bound to it), never task-local state that a
    callee reads back and that outlives the request in the task that set it."""
    assert not _context_vars(tree), f"{path}:{_context_vars(tree)} uses a ContextVar; pass the state down"


def test_the_context_variable_rule_would_catch_one():
    assert _context_vars(ast.parse("import contextvars\nX = contextvars.ContextVar('x')\n")) == [2]
    assert _context_vars(ast.parse("from contextvars import ContextVar\n")) == [1]


# Calls run on the caller's own behalf, not kept by a callee below: not a way up.
_RUNNERS = {"to_thread", "create_task", "ensure_future", "run_in_executor", "gather", "wait_for", "shield",
            "add_done_callback", "wait", "partial"}
# Core methods still handed below, with why they are not on a request's path.
_KNOWN_WAYS_UP = {
    ("core/disk_ops.py", "pull", "lambda over core"): "a pull's install announced by the core (no request waits on it)",
}


def _handed_down(path: str, tree: ast.AST, core_methods: set[str]) -> list[tuple[str, str, str, int]]:
    """Calls in ``tree`` that hand a callee a method of the core (``core.X``/``self.X``) or a
    lambda over it: a way for code below to call back up."""
    found = []
    for call in ast.walk(tree):
        if not isinstance(call, ast.Call):
            continue
        name = call.func.attr if isinstance(call.func, ast.Attribute) else getattr(call.func, "id", "")
        if name in _RUNNERS:
            continue
        for arg in [*call.args, *(k.value for k in call.keywords)]:
            if (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name)
                    and arg.value.id in ("core", "self") and arg.attr in core_methods):
                found.append((path, name, f"{arg.value.id}.{arg.attr}", arg.lineno))
            elif isinstance(arg, ast.Lambda) and any(isinstance(n, ast.Name) and n.id in ("core", "self")
                                                     for n in ast.walk(arg)):
                found.append((path, name, "lambda over core", arg.lineno))
    return found


def _core_methods() -> set[str]:
    from loractld.core import Core

    return {n for n in dir(Core) if callable(getattr(Core, n, None)) and not isinstance(getattr(Core, n), property)}


def test_no_core_method_is_handed_below_the_core():
    """A request's calls flow down: the core hands its parts objects that own their state (the
    admission: ``serving.admitted``), never its own methods as callbacks (the gate's ``on_admit``
    was ``core.admitted``, the surface's ``admit`` was ``Core.engine_request``). Read in the
    process floor and the core, where the parts are built and wired."""
    methods = _core_methods()
    found = [w for path, tree in MODULES if path.parts[0] == "core" or str(path) == "lifecycle.py"
             for w in _handed_down(str(path), tree, methods)]
    unknown = [w for w in found if w[:3] not in _KNOWN_WAYS_UP]
    assert not unknown, f"core methods handed below the core (a call back up): {unknown}"
    assert {w[:3] for w in found} == set(_KNOWN_WAYS_UP), "a known way up is gone: drop it from the list"


def test_the_way_up_rule_would_catch_a_callback():
    tree = ast.parse("gate = Gate(2, policy, on_admit=core.admitted)\nsurface = S(engine, self.engine_request)\n"
                     "x = asyncio.to_thread(self.close_matches, 'a')\nt = T(busy=lambda: core.ready)\n")
    assert [w[1:3] for w in _handed_down("x.py", tree, {"admitted", "engine_request", "close_matches"})] == [
        ("Gate", "core.admitted"), ("S", "self.engine_request"), ("T", "lambda over core")]


def test_the_rules_would_catch_a_breach():
    """The checks read real import statements: a planted vllm import in api/ is seen."""
    tree = ast.parse("from vllm.lora.request import LoRARequest\nfrom loractld.store.disk import Store\n")
    assert "vllm.lora.request" in _imports(tree)
    assert "loractld.store.disk" in _imports(tree)


# -- floors ---------------------------------------------------------------------------------
# Lowest first. A module is on the floor of the longest prefix that names it; it may import its
# own floor and those below (``loractl``, the client package, is beneath them all). Process-level
# modules (the command line, start and shutdown, systemd, the self-check, the registry entry)
# sit above the doors, which sit above the core.
FLOORS = (
    ("base", ("loractld", "loractld.events", "loractld.views", "loractld.trust")),
    ("worker", ("loractld.worker",)),
    ("models", ("loractld.models",)),
    ("engine", ("loractld.engine",)),
    ("store", ("loractld.store",)),
    ("serving", ("loractld.serving",)),
    ("core", ("loractld.core", "loractld.generation", "loractld.startup")),
    ("api", ("loractld.api",)),
    ("process", ("loractld.__main__", "loractld.main", "loractld.lifecycle", "loractld.config", "loractld.systemd",
                 "loractld.selfcheck", "loractld.publisher", "loractld.home_claim")),
)


def _module_name(path: Path) -> str:
    parts = ("loractld", *path.with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


DAEMON = {_module_name(p): (p, t) for p, t in MODULES}


def floor_of(module: str) -> int | None:
    best, floor = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, floor = len(prefix), i
    return floor


def arrows(module: str, tree: ast.AST, is_package: bool, known=DAEMON) -> list[tuple[int, str]]:
    """Every daemon module ``module`` imports, with the line: anywhere in the file, resolved
    to the module itself (``from pkg import sub`` is ``pkg.sub`` when that is a module)."""
    package = module if is_package else module.rpartition(".")[0]
    found = []

    def add(line: int, target: str) -> None:
        while target not in known and "." in target:
            target = target.rpartition(".")[0]     # a name inside a module: the module
        if target in known and target != module:
            found.append((line, target))

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "loractld":
                    add(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(up + ([node.module] if node.module else []))
            if base.split(".")[0] != "loractld":
                continue
            for alias in node.names:
                add(node.lineno, f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value.startswith("loractld") \
                and ast.unparse(node.func) in ("importlib.import_module", "import_module", "__import__"):
            add(node.lineno, node.args[0].value)
    return sorted(set(found))


def _graph(modules=DAEMON) -> dict[str, list[tuple[int, str]]]:
    return {name: arrows(name, tree, path.name == "__init__.py", modules) for name, (path, tree) in modules.items()}


def upward(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    bad = []
    for module, targets in sorted(graph.items()):
        for line, target in targets:
            if floor_of(target) > floor_of(module):
                bad.append(f"{module}:{line} imports {target} ({FLOORS[floor_of(module)][0]} floor imports "
                           f"{FLOORS[floor_of(target)][0]} floor)")
    return bad


def cycles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Each group of modules that import each other, as one cycle through it (Tarjan's strongly
    connected components, then a path back to the start)."""
    edges = {m: sorted({t for _, t in targets}) for m, targets in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                found.append(_cycle_in(sorted(group)[0], group, edges))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def _cycle_in(start: str, group: set[str], edges: dict[str, list[str]]) -> list[str]:
    paths, seen = [[start]], {start}
    while paths:   # breadth first: the shortest way back to ``start`` within the group
        path = paths.pop(0)
        for w in edges.get(path[-1], ()):
            if w == start:
                return path + [start]
            if w in group and w not in seen:
                seen.add(w)
                paths.append(path + [w])
    return sorted(group)


GRAPH = _graph()


def test_every_daemon_module_is_on_a_floor():
    unplaced = sorted(m for m in DAEMON if floor_of(m) is None)
    assert not unplaced, f"{unplaced} are on no floor: add them to FLOORS in tests/test_layout.py"


def test_arrows_point_down():
    bad = upward(GRAPH)
    assert not bad, "imports from a lower floor to a higher one (move the thing to the floor where it " \
                    "belongs, or pass it in):\n" + "\n".join(bad)


def test_no_import_cycles():
    found = cycles(GRAPH)
    assert not found, "daemon modules import each other in a cycle:\n" + \
        "\n".join(" -> ".join(c) for c in found)


def _planted(files: dict[str, str]) -> dict[str, tuple[Path, ast.AST]]:
    """The real tree with ``files`` (module name -> source) added or replaced."""
    planted = dict(DAEMON)
    for name, source in files.items():
        planted[name] = (Path(name.rpartition(".")[2] + ".py"), ast.parse(source))
    return planted


def test_the_floor_rule_catches_an_upward_import_wherever_it_hides():
    """A planted engine module reaching up to the core, each way an import can be written, is
    named with its line; the same imports from a process-level module are fine."""
    ways = ["from loractld.core import Core",
            "def later():\n    from loractld.core.state import Catalog",
            "import typing\nif typing.TYPE_CHECKING:\n    import loractld.api.http.app",
            "from ..core import policy",
            "import importlib\ndef late():\n    return importlib.import_module('loractld.serving.tiers')"]
    for source in ways:
        bad = upward(_graph(_planted({"loractld.engine.planted": source})))
        assert [b for b in bad if b.startswith("loractld.engine.planted:")], source
        assert not upward(_graph(_planted({"loractld.lifecycle": source.replace("..", ".")})))
    assert upward(GRAPH) == []   # nothing planted: nothing found (the rule is not always failing)


def test_the_cycle_rule_catches_a_cycle_through_a_function_level_import():
    planted = _planted({"loractld.store.planted_a": "from loractld.store.planted_b import x",
                        "loractld.store.planted_b": "def f():\n    from loractld.store import planted_a"})
    assert ["loractld.store.planted_a", "loractld.store.planted_b", "loractld.store.planted_a"] in cycles(_graph(planted))
    # A longer one through real modules (identity -> disk -> leases): the lease holder made to import back.
    planted = _planted({"loractld.store.leases": "def back():\n    from loractld.store.identity import AdapterResolver"})
    found = cycles(_graph(planted))
    assert any("loractld.store.leases" in c and "loractld.store.identity" in c for c in found), found


def test_the_floor_table_names_real_modules():
    """A floor entry for a module that is gone would hide nothing, but says what is not there."""
    for _, prefixes in FLOORS:
        for prefix in prefixes:
            assert any(m == prefix or m.startswith(prefix + ".") for m in DAEMON), \
                f"FLOORS names {prefix}, which is not a daemon module"

