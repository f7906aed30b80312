"""Regenerate the daemon's module lists: docs/architecture.md's "Every module" section (each
module with the first sentence of its docstring) and the README's ``daemon/loractld/`` layout
(each package with its summary and every module in it), both from the tree itself.

Usage: python scripts/gen_architecture.py [--check]

A module's line is its docstring's first sentence: what a module says of itself is where its
description is kept, and a new, renamed or removed module changes both pages. ``--check`` writes
nothing and exits 1 when a committed page differs from a fresh rendering (tests/test_docs.py
runs it). Standard library only: it reads the files, it imports nothing of the daemon.
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PKG = ROOT / "daemon" / "loractld"
ARCHITECTURE = ROOT / "docs" / "architecture.md"
README = ROOT / "README.md"
BEGIN, END = "<!-- modules: scripts/gen_architecture.py -->", "<!-- end of modules -->"
README_BEGIN = "daemon/loractld/    the daemon, on floors whose imports point down (docs/architecture.md;"
README_END = "tests/              "
WIDTH = 100
INDENT = 20

# Each package's line in the README, by what it is for; the modules are listed from the tree.
PACKAGES = {
    "": "the process: flags, start and stop, sd_notify, the self-check, the registry entry, "
        "plain data every floor shares",
    "api": "the doors over the core: gRPC on the socket, the HTTP app (OpenAI's API; "
           "ollama/: Ollama's), the Dynamo worker (dynamo/)",
    "core": "Core in parts: the request path, tiers' and disk's operations, profiles, merges, "
            "reports, who may change state",
    "serving": "what must agree on slot counts, one owner each: the admission gate and its policies, "
               "the tiers, pins, keep-alive",
    "store": "adapters on disk: names, sources, pulls, validation, preflight, leases, profiles, merges",
    "engine": "vLLM's AsyncLLM and its tiers, vLLM's serving classes over the admitted engine "
              "client, every door's request as vLLM's own",
    "models": "base models: the tiny test model, the demo, GGUF import, MoE, defaults from a model",
    "worker": "code that runs inside vLLM's processes (an exception there ends the engine), the "
              "vLLM seam, test hook points",
    "trust": "audit and peer identity, beneath every floor that decides or records",
}


def modules() -> dict[str, list[tuple[str, str]]]:
    """Package ('' for the top level) -> [(module path as imported, its docstring's first sentence)]."""
    found: dict[str, list[tuple[str, str]]] = {}
    for path in sorted(PKG.rglob("*.py")):
        rel = path.relative_to(PKG)
        if rel.parts[0] == "worker" and "child_startup" in rel.parts:
            name = "worker/child_startup/sitecustomize"
        else:
            name = "/".join(rel.with_suffix("").parts)
        package = rel.parts[0] if len(rel.parts) > 1 else ""
        doc = ast.get_docstring(ast.parse(path.read_text(), str(path))) or ""
        found.setdefault(package, []).append((name, first_sentence(doc)))
    return found


def first_sentence(doc: str) -> str:
    """The docstring's first sentence, its reST roles as Markdown code (``x``, :class:`a.B`)."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    match = re.search(r"(?<!\be\.g)(?<!\bi\.e)(?<!\bvs)\.(\s|$)", text)
    text = text[:match.start() + 1] if match else text
    text = re.sub(r":\w+:`~?([\w.]+)`", lambda m: f"`{m.group(1).rpartition('.')[2]}`", text)
    return text.replace("``", "`") or "(no docstring)"


def architecture_section(found: dict[str, list[tuple[str, str]]]) -> str:
    lines = [BEGIN, "", "| module | what it says of itself |", "|---|---|"]
    for package in sorted(found, key=lambda p: (p != "", p)):
        for name, sentence in found[package]:
            escaped = sentence.replace("|", "\\|")
            lines.append(f"| `{name}` | {escaped} |")
    lines += ["", END]
    return "\n".join(lines)


def _wrapped(head: str, text: str) -> list[str]:
    out, line = [], head.ljust(INDENT)
    for word in text.split():
        if len(line) + 1 + len(word) > WIDTH and line.strip():
            out.append(line.rstrip())
            line = " " * INDENT
        line += ("" if line.endswith(" ") or not line.strip() else " ") + word
    out.append(line.rstrip())
    return out


def readme_block(found: dict[str, list[tuple[str, str]]]) -> str:
    lines = [README_BEGIN, " " * INDENT + "tests/test_layout.py checks every import, function-level ones too)"]
    for package in ["", *[p for p in PACKAGES if p]]:
        names = [n.split("/", 1)[1] if package else n for n, _ in found.get(package, [])]
        names = [n.removesuffix("/__init__") for n in names if n not in ("__init__", "__main__")]
        head = "  " + (f"{package}/" if package else "*.py")
        lines += _wrapped(head, f"{PACKAGES[package]}. Modules: {', '.join(names)}")
    return "\n".join(lines) + "\n"


def render(found: dict[str, list[tuple[str, str]]]) -> dict[Path, str]:
    unknown = sorted(set(found) - set(PACKAGES))
    if unknown:
        raise SystemExit(f"packages with no README summary in scripts/gen_architecture.py: {unknown}")
    arch = ARCHITECTURE.read_text()
    start, end = arch.find(BEGIN), arch.find(END)
    if start < 0 or end < 0:
        raise SystemExit(f"{ARCHITECTURE} has no {BEGIN} ... {END} markers")
    readme = README.read_text()
    r_start = readme.find(README_BEGIN)
    r_end = readme.find(README_END, r_start)
    if r_start < 0 or r_end < 0:
        raise SystemExit(f"{README}'s layout has no daemon/loractld/ block")
    return {ARCHITECTURE: arch[:start] + architecture_section(found) + arch[end + len(END):],
            README: readme[:r_start] + readme_block(found) + readme[r_end:]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if a page is not current; write nothing")
    args = parser.parse_args()
    pages = render(modules())
    stale = [path for path, text in pages.items() if path.read_text() != text]
    if args.check:
        for path in stale:
            print(f"{path.relative_to(ROOT)} is not current: run python scripts/gen_architecture.py", file=sys.stderr)
        return 1 if stale else 0
    for path in stale:
        path.write_text(pages[path])
        print(f"wrote {path.relative_to(ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
