"""The ``loractl`` command line: one module per command group, assembled in ``app``.

``main`` is the console script. It keeps the hottest invocations cheap: see ``_fast_read`` and
``_fast_help``.
"""

from __future__ import annotations

import os
import sys

# Environment variables that change what Typer and rich print for a help page going into a
# pipe (width, forced colour or terminal, cell widths, Typer without rich), or that make the
# invocation something else entirely (shell completion). tests/test_cli_fast.py checks this
# list against the variables Typer and rich read.
HELP_ENV = frozenset({
    "COLUMNS", "TERMINAL_WIDTH", "FORCE_COLOR", "PY_COLORS", "GITHUB_ACTIONS", "TTY_COMPATIBLE",
    "TTY_INTERACTIVE", "_TYPER_FORCE_DISABLE_TERMINAL", "TYPER_USE_RICH", "UNICODE_VERSION",
    "JUPYTER_COLUMNS", "JUPYTER_LINES", "DATABRICKS_RUNTIME_VERSION", "_LORACTL_COMPLETE",
})


# The read commands that skip Typer (see _fast_read): name -> how many positional arguments.
FAST_READS = {"ls": 0, "status": 0, "ps": 0, "show": 1}


def _fast_read(argv: list[str]) -> bool:
    """``loractl ls|status|ps [--json] [--socket S] [--home H]`` and ``show NAME [...]``, the
    commands people and scripts type most, skip Typer entirely (its import and its
    pydantic-based argument coercion were ~170 ms of a ~330 ms run) and call the same
    implementation the Typer command does. Anything else (another flag, ``--help``, ``status
    --wait``), including LORACTL_SOCKET/LORACTL_HOME (read by the client itself), behaves
    exactly as through Typer."""
    if not argv or argv[0] not in FAST_READS:
        return False
    options: dict[str, object] = {"socket": None, "home": None, "json_output": False}
    positional: list[str] = []
    rest = argv[1:]
    while rest:
        flag = rest.pop(0)
        if flag == "--json":
            options["json_output"] = True
        elif flag in ("--socket", "--home") and rest and not rest[0].startswith("-"):
            options[flag.lstrip("-")] = rest.pop(0)
        elif not flag.startswith("-") and len(positional) < FAST_READS[argv[0]]:
            positional.append(flag)
        else:
            return False
    if len(positional) != FAST_READS[argv[0]]:
        return False
    if argv[0] == "ls":
        from loractl.cli.listing import list_adapters

        list_adapters(**options)  # type: ignore[arg-type]
        return True
    from loractl.cli import _reads

    if argv[0] == "show":
        _reads.adapter_report(positional[0], **options)  # type: ignore[arg-type]
    else:
        (_reads.status_report if argv[0] == "status" else _reads.requests_report)(**options)  # type: ignore[arg-type]
    return True


def _pipe_width() -> int:
    """The width rich would give a console here: the first standard stream that is a
    terminal, overridden by $COLUMNS, else 80."""
    width = 0
    for fd in (0, 1, 2):
        try:
            width = os.get_terminal_size(fd).columns
        except (AttributeError, ValueError, OSError):
            continue
        break
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        width = int(columns)
    return width or 80


# The width of command output that goes to a pipe or a file: lines are not folded there (a
# revision hash, an events line or a path split across lines breaks grep, cut and copying).
UNWRAPPED = 1 << 16


def _output_width() -> int | None:
    """The width a command lays its output out at: $COLUMNS when set; else, with stdout not a
    terminal, :data:`UNWRAPPED`; else None (rich's own: the terminal's). Help pages keep
    :func:`_pipe_width` (Typer renders them at 80 columns in a pipe)."""
    columns = os.environ.get("COLUMNS")
    if columns is not None and columns.isdigit():
        return int(columns)
    out = sys.stdout
    try:
        return None if out is None or out.isatty() else UNWRAPPED
    except (AttributeError, ValueError):
        return None


def _fast_help(argv: list[str], prog: str) -> bool:
    """``loractl --help``, ``-h`` and bare ``loractl`` print the page scripts/gen_help.py
    rendered through Typer (whose import and rich rendering were ~85% of the run), when this
    run would render exactly that page: into a pipe, at its width, in UTF-8, under the same
    program name, none of HELP_ENV set. A terminal gets Typer itself (colours, its width)."""
    if argv not in ([], ["--help"], ["-h"]) or prog != "loractl" or sys.platform == "win32":
        return False
    out = sys.stdout
    if out is None or out.isatty() or not (getattr(out, "encoding", "") or "").lower().startswith("utf"):
        return False
    if HELP_ENV.intersection(os.environ):
        return False
    from loractl.cli import _help

    if _pipe_width() != _help.WIDTH:
        return False
    out.write(_help.HELP if argv else _help.NO_ARGS)
    out.flush()
    if not argv:
        raise SystemExit(2)  # as Typer's no_args_is_help does
    return True


def main() -> None:
    try:
        argv = sys.argv[1:]
        if _fast_help(argv, os.path.basename(sys.argv[0])) or _fast_read(argv):
            return
        from loractl.cli.app import app  # Typer, rich and the commands: the first half second

        app()
    except KeyboardInterrupt:
        # Ctrl-C before a command's own handler (loractl.cli._output.cli_errors) runs: during the
        # imports or Typer's parsing. One line and 130, as a command interrupted later exits.
        try:
            sys.stderr.write("interrupted\n")
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        raise SystemExit(130) from None
