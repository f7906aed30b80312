"""The CLI's fast paths (``loractl.cli.main``) print exactly what the Typer app prints.

No engine: the help checks need nothing, the ``ls`` checks talk to a stub gRPC server that
answers List with a canned reply.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from loractl.cli import HELP_ENV

# Run as the console script does: argv[0] is the script's path, the entry is loractl.cli.main.
MAIN = "import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli import main\nmain()\n"
TYPER = "import sys\nsys.argv = [{prog!r}, *{argv!r}]\nfrom loractl.cli.app import app\napp()\n"
REPORT = "\nimport atexit\natexit.register(lambda: print('TYPER', 'typer' in sys.modules, file=sys.stderr))\n"


def run(template: str, argv: list[str], env: dict[str, str] | None = None, prog: str = "/usr/bin/loractl"):
    base = {k: v for k, v in os.environ.items() if k not in HELP_ENV}
    code = REPORT + template.format(prog=prog, argv=argv)
    return subprocess.run([sys.executable, "-c", code], env={**base, **(env or {})}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, encoding="utf-8", timeout=120)


def test_help_module_is_current():
    done = subprocess.run([sys.executable, str(REPO / "scripts" / "gen_help.py"), "--check"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{done.stderr}{done.stdout}"


@pytest.mark.parametrize("argv", [["--help"], ["-h"], []], ids=["--help", "-h", "bare"])
def test_fast_help_is_typers_page_without_typer(argv):
    fast, typer = run(MAIN, argv), run(TYPER, argv)
    assert "TYPER False" in fast.stderr, "the help fast path was not taken (or imported Typer)"
    assert "TYPER True" in typer.stderr
    assert (fast.stdout, fast.returncode) == (typer.stdout, typer.returncode)
    assert "Usage: loractl [OPTIONS] COMMAND [ARGS]..." in fast.stdout


@pytest.mark.parametrize("env, prog", [({"COLUMNS": "100"}, "/usr/bin/loractl"), ({"FORCE_COLOR": "1"}, "/usr/bin/loractl"),
                                       ({}, "/usr/bin/lctl")], ids=["columns", "force-color", "other-name"])
def test_help_that_would_differ_goes_through_typer(env, prog):
    fast, typer = run(MAIN, ["--help"], env, prog), run(TYPER, ["--help"], env, prog)
    assert "TYPER True" in fast.stderr, "the fast path printed a page rendered for other conditions"
    assert fast.stdout == typer.stdout


def test_help_env_names_every_variable_typer_and_rich_read():
    """A Typer or rich upgrade that reads a new variable must be classified here, or the fast
    path could print a stale page when it is set."""
    # Read by them, but with no effect on a page going into a pipe (colours and terminal
    # type matter only on a terminal; LINES only sets the height; help never pages).
    harmless = {"NO_COLOR", "COLORTERM", "TERM", "LINES", "XDG_CONFIG_HOME", "PYDANTIC_DISABLE_PLUGINS",
                "COMP_WORDS", "COMP_CWORD", "TYPER_STANDARD_TRACEBACK", "_TYPER_STANDARD_TRACEBACK",
                "PAGER", "LESS"}
    read = set()
    for package in ("typer", "rich", "click"):
        try:
            root = Path(__import__(package).__file__).parent
        except ImportError:
            continue
        for source in root.rglob("*.py"):
            text = source.read_text(encoding="utf-8", errors="replace")
            read |= set(re.findall(r"""(?:environ\b[^\n]{0,20}?|getenv\()\s*[\[(.]?(?:get\()?\s*["']([A-Z_][A-Z0-9_]*)["']""",
                                   text))
    read = {name for name in read if not name.startswith("_TYPER_COMPLETE")}
    assert {"COLUMNS", "FORCE_COLOR", "TERMINAL_WIDTH"} <= read, f"the scan found too little: {sorted(read)}"
    unclassified = read - HELP_ENV - harmless
    assert not unclassified, f"classify in loractl.cli.HELP_ENV or here: {sorted(unclassified)}"
