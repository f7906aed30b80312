"""No production module reads a test's setting or imports test code; the suite's hook reaches
the daemon only through the ``loractld.hooks`` entry point, which loractl itself never registers.

Production is every module under daemon/loractld and loractl/. Read from their syntax:
- no string constant (docstrings and f-string pieces included) names a ``LORACTL_TEST_*``
  variable;
- every read of the environment (``os.environ.get`` or ``[...]``, ``os.getenv``,
  ``NAME in os.environ``) has a key that resolves to a string constant (a literal, or a
  module-level constant of a production module) not starting with ``LORACTL_TEST``, or is one of
  the few reads whose key is computed, listed below with why it cannot be a test's;
- no import names a module of tests/ (conftest, support_*, the hook plugin, doubles).
Then, in fresh interpreters: with loractl as installed, ``loractld.worker.hooks`` finds no hook;
with the suite's folder on the path, it finds the suite's.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TESTS = REPO / "tests"
PRODUCTION = sorted([*(REPO / "daemon" / "loractld").rglob("*.py"), *(REPO / "loractl").rglob("*.py")])
PREFIX = "LORACTL_TEST"
# Environment reads whose key is computed, each with why it is no test's setting.
COMPUTED = {
    ("daemon/loractld/config.py", "env_name(dest)"): "LORACTLD_<FLAG>: a flag's own variable",
}
ENV_METHODS = {"get", "__getitem__"}  # pop and setdefault: a write (a key named in them is still seen)


def _test_module_names() -> set[str]:
    """What production code would import to reach test code: tests/'s modules and folders,
    and the hook plugin's."""
    names = {"tests"}
    for folder in (TESTS, TESTS / "hooks_plugin"):
        names |= {p.stem for p in folder.glob("*.py")}
        names |= {p.name for p in folder.iterdir() if p.is_dir() and p.name.isidentifier()}
    return names


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ") or (
        isinstance(node, ast.Name) and node.id == "environ")


def _env_keys(tree: ast.AST):
    """The key expression of every read of the environment in ``tree``."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and node.args:
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr in ENV_METHODS and _is_environ(f.value):
                yield node.args[0]
            elif (isinstance(f, ast.Attribute) and f.attr == "getenv") or (isinstance(f, ast.Name) and f.id == "getenv"):
                yield node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and _is_environ(node.value):
            yield node.slice
        elif isinstance(node, ast.Compare) and len(node.ops) == 1 and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and _is_environ(node.comparators[0]):
            yield node.left


def _constants(tree: ast.AST) -> dict[str, str]:
    """Module-level ``NAME = "text"``."""
    found = {}
    for node in getattr(tree, "body", []):
        if isinstance(node, (ast.Assign, ast.AnnAssign)) and isinstance(node.value, ast.Constant) \
                and isinstance(node.value.value, str):
            for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                if isinstance(target, ast.Name):
                    found[target.id] = node.value.value
    return found


def breaches(source: str, rel: str = "<planted>", everywhere: dict[str, set[str]] | None = None) -> list[str]:
    """What in ``source`` (the module ``rel``) reads a test's setting or imports test code.
    ``everywhere``: constant name -> its values over all production modules (for ``mod.NAME``)."""
    tree = ast.parse(source, rel)
    own = _constants(tree)
    everywhere = everywhere or {}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and PREFIX in node.value:
            found.append(f"{rel}:{node.lineno}: names {node.value[:60]!r}")
    for key in _env_keys(tree):
        text = ast.unparse(key)
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            values = {key.value}
        elif isinstance(key, ast.Name) and key.id in own:
            values = {own[key.id]}
        elif isinstance(key, (ast.Name, ast.Attribute)):
            values = everywhere.get(key.id if isinstance(key, ast.Name) else key.attr, set())
        else:
            values = set()
        if not values and (rel, text) not in COMPUTED:
            found.append(f"{rel}:{key.lineno}: reads the environment at {text!r}, a key not known to be no test's")
        found += [f"{rel}:{key.lineno}: reads {v}" for v in sorted(values) if v.startswith(PREFIX)]
    tests = _test_module_names()
    for node in ast.walk(tree):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
            [node.module] if isinstance(node, ast.ImportFrom) and node.module and node.level == 0 else [])
        found += [f"{rel}:{node.lineno}: imports {n} (test code)" for n in names if n.split(".")[0] in tests]
    return found


def _everywhere() -> dict[str, set[str]]:
    merged: dict[str, set[str]] = {}
    for path in PRODUCTION:
        for name, value in _constants(ast.parse(path.read_text())).items():
            merged.setdefault(name, set()).add(value)
    return merged


def test_no_production_module_reads_a_test_setting_or_imports_test_code():
    assert len(PRODUCTION) > 50  # both packages were found
    everywhere = _everywhere()
    found = [b for path in PRODUCTION
             for b in breaches(path.read_text(), str(path.relative_to(REPO)), everywhere)]
    assert found == [], "\n".join(found)


def test_the_computed_reads_listed_are_still_there():
    """An entry of COMPUTED whose read is gone would excuse a future one unseen."""
    seen = {(str(p.relative_to(REPO)), ast.unparse(k)) for p in PRODUCTION for k in _env_keys(ast.parse(p.read_text()))}
    assert set(COMPUTED) <= seen


@pytest.mark.parametrize("planted", [
    'import os\nARMED = os.environ.get("LORACTL_TEST_KILL_AT")\n',
    'import os\nKEY = "LORACTL_TEST_POISON"\ndef f():\n    return os.getenv(KEY)\n',
    'import os\nfrom loractld.worker import extension\nos.environ[extension.FAULT]\n',
    'import os\ndef f(name):\n    return os.environ.get(f"LORACTL_{name}")\n',
    'import os\nif "LORACTL_TEST_PAUSE_DIR" in os.environ:\n    pass\n',
    'from loractl_test_hooks import armed\n',
    'import conftest\n',
    'def f():\n    from support_rigs import Rig\n',
])
def test_the_check_catches_a_planted_breach(planted):
    assert breaches(planted, everywhere={"FAULT": {"LORACTL_TEST_LOAD_FAULT"}})
    # ... and passes the same module without it
    assert breaches('import os\nFLAG = "LORACTL_ENGINE"\nos.environ.get(FLAG)\n') == []


def test_loractl_registers_no_hook():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    assert "loractld.hooks" not in project.get("entry-points", {})


def _hook_in_fresh_interpreter(pythonpath: str) -> str:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"} | ({"PYTHONPATH": pythonpath} if pythonpath else {})
    out = subprocess.run([sys.executable, "-c", "from loractld.worker import hooks; print(getattr(hooks._hook, '__name__', None))"],
                         capture_output=True, text=True, env=env, cwd="/", timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


def test_the_hook_is_the_suites_only_where_the_suite_puts_it():
    assert _hook_in_fresh_interpreter("") == "None"
    assert _hook_in_fresh_interpreter(str(TESTS / "hooks_plugin")) == "loractl_test_hooks"
