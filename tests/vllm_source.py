"""Find the seam's entries (loractld.worker.vllm_seam) in a vLLM source tree without importing it.

A release loractl does not run here (vLLM 0.33.0: no CPU wheel of it) can still be read: unpack
its wheel (``unzip vllm-X-*.whl 'vllm/*.py' -d DIR``) and resolve every entry in DIR's source,
as :func:`vllm_seam.check` resolves them in the installed vLLM: the owner module and class, the
name on the class or one of its bases (a method, a class attribute, a dataclass or msgspec field,
or a ``self.NAME =`` assignment), and a patched callable's leading parameters. Re-exports
(``from .x import name``) are followed. What it cannot see (a base class outside vLLM, a name made
at run time) is reported as missing, never as present.

    python tests/vllm_source.py DIR [0.33.0]   # every entry: where it is in DIR, or what is wrong

tests/test_vllm_seam.py checks this reader against the installed vLLM (it must agree with
``vllm_seam.check``) and keeps the table of where each entry is in 0.33.0 (``IN_033``).
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path


class Source:
    """The Python files of one vLLM release under ``root`` (the directory that holds ``vllm/``)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self._trees: dict[str, ast.Module | None] = {}

    def file(self, module: str) -> Path | None:
        base = self.root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
        return None

    def tree(self, module: str) -> ast.Module | None:
        if module not in self._trees:
            path = self.file(module)
            self._trees[module] = ast.parse(path.read_text()) if path else None
        return self._trees[module]

    def top(self, module: str, name: str, depth: int = 0) -> tuple[str, ast.AST | None, str] | None:
        """(kind, node, module defining it) of a module-level ``name``: "class", "function",
        "value" or "module"; import statements are followed (re-exports)."""
        tree = self.tree(module)
        if tree is None or depth > 8:
            return None
        found = None
        is_package = self.file(module).name == "__init__.py"

        def visit(body):
            nonlocal found
            for node in body:
                if isinstance(node, ast.ClassDef) and node.name == name:
                    found = ("class", node, module)
                elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
                    found = ("function", node, module)
                elif isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name
                                                          for t in node.targets):
                    found = ("value", node, module)
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
                    found = ("value", node, module)
                elif isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if (alias.asname or alias.name) == name:
                            source = _absolute(module, node.module, node.level, is_package)
                            found = self.top(source, alias.name, depth + 1) or (
                                ("module", None, f"{source}.{alias.name}")
                                if self.file(f"{source}.{alias.name}") else None)
                elif isinstance(node, (ast.If, ast.Try)):
                    visit(node.body)
                    for handler in getattr(node, "handlers", ()):
                        visit(handler.body)
                    visit(node.orelse)

        visit(tree.body)
        return found

    def mro(self, node: ast.ClassDef, module: str) -> list[tuple[ast.ClassDef, str]]:
        """The class and its bases found in this source, depth first (bases outside vLLM, and
        generic parameters, are skipped)."""
        seen: list[tuple[ast.ClassDef, str]] = []

        def walk(cls: ast.ClassDef, where: str) -> None:
            if any(c is cls for c, _ in seen):
                return
            seen.append((cls, where))
            for base in cls.bases:
                base = base.value if isinstance(base, ast.Subscript) else base
                if isinstance(base, ast.Name):
                    found = self.top(where, base.id)
                    if found and found[0] == "class":
                        walk(found[1], found[2])

        walk(node, module)
        return seen

    def find(self, owner: str, name: str) -> tuple[str, str, ast.AST] | None:
        """Where ``owner`` ("module:Class" or "module") has ``name``: (kind, "path:line", node);
        None where it has not (or the owner is not in this source)."""
        module, _, qualname = owner.partition(":")
        if self.file(module) is None:
            return None
        if not qualname:
            found = self.top(module, name)
            if found is None or found[1] is None:
                return None
            return found[0], self._where(found[2], found[1]), found[1]
        found = self.top(module, qualname)
        if found is None or found[0] != "class":
            return None
        for cls, where in self.mro(found[1], found[2]):
            member = _member(cls, name)
            if member is not None:
                return member[0], self._where(where, member[1]), member[1]
        return None

    def problem(self, entry) -> str | None:
        """Why ``entry`` (a vllm_seam.Internal) does not resolve in this source; None if it does."""
        module = entry.owner.partition(":")[0]
        if self.file(module) is None:
            return f"module {module} is gone"
        found = self.find(entry.owner, entry.name)
        if found is None:
            return "is gone"
        kind, _, node = found
        if entry.params and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            names = parameters(node)
            if names[:len(entry.params)] != list(entry.params):
                return f"takes ({', '.join(names)}), not ({', '.join(entry.params)})"
        return None

    def required(self, owner: str) -> list[str] | None:
        """The parameters of class ``owner``'s constructor ("module:Class") that have no default
        (the first ``__init__`` of its bases); None where the class is not in this source."""
        found = self.find(owner, "__init__")
        if found is None:
            return None
        args = found[2].args
        positional = [*args.posonlyargs, *args.args]
        names = [a.arg for a in positional[:len(positional) - len(args.defaults)]]
        names += [a.arg for a, default in zip(args.kwonlyargs, args.kw_defaults) if default is None]
        return [n for n in names if n != "self"]

    def _where(self, module: str, node: ast.AST) -> str:
        return f"{self.file(module).relative_to(self.root).as_posix()}:{node.lineno}"


def version(root: Path) -> tuple[int, int, int]:
    """The release of the source under ``root``, from ``vllm/_version.py`` (no import)."""
    text = (Path(root) / "vllm" / "_version.py").read_text()
    match = re.search(r"^__version__ = version = ['\"](\d+)\.(\d+)\.(\d+)", text, re.M)
    if match is None:
        raise ValueError(f"no release in {root}/vllm/_version.py")
    return int(match[1]), int(match[2]), int(match[3])


def parameters(function: ast.FunctionDef | ast.AsyncFunctionDef) -> list[str]:
    args = function.args
    names = [a.arg for a in (*args.posonlyargs, *args.args)]
    if args.vararg:
        names.append("*" + args.vararg.arg)
    names += [a.arg for a in args.kwonlyargs]
    return [n for n in names if n != "self"]


def _member(cls: ast.ClassDef, name: str) -> tuple[str, ast.AST] | None:
    for node in cls.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.name == name:
            return "method", node
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return "attribute", node
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.target.id == name:
            return "field", node
    for node in ast.walk(cls):
        if (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and node.attr == name
                and isinstance(node.value, ast.Name) and node.value.id == "self"):
            return "set by self", node
    return None


def _absolute(module: str, target: str | None, level: int, is_package: bool) -> str:
    if level == 0:
        return target or ""
    parts = module.split(".") if is_package else module.split(".")[:-1]
    parts = parts[:len(parts) - (level - 1)]
    return ".".join(parts + ([target] if target else []))


def main(argv: list[str]) -> int:
    sys.path[:0] = [str(Path(__file__).resolve().parent.parent / "daemon"), str(Path(__file__).resolve().parent.parent)]
    from loractld.worker import vllm_seam

    root = Path(argv[0])
    release = vllm_seam.parse_version(argv[1])[:2] if len(argv) > 1 else version(root)[:2]
    source = Source(root)
    failed = 0
    for e in vllm_seam.SEAM:
        applies = e.since <= release <= e.until
        problem = source.problem(e)
        found = source.find(e.owner, e.name)
        failed += bool(applies and problem)
        print(f"{'' if applies else '(not asked) '}{e.dotted}: {problem or found[1]}")
    return 1 if failed else 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
