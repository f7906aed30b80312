"""The ``loractl`` command line: one module per command group, assembled in ``app``.

``main`` is the console script. It keeps the hottest command cheap: see ``_fast_ls``.
"""

from __future__ import annotations

import sys


def _fast_ls(argv: list[str]) -> bool:
    """``loractl ls [--json] [--socket S] [--home H]``, the command scripts call in loops,
    skips Typer entirely (its import and its pydantic-based argument coercion were ~170 ms of
    a ~330 ms run) and calls the same implementation ``ls`` does. Anything else, including
    LORACTL_SOCKET/LORACTL_HOME (read by the client itself), behaves exactly as through Typer."""
    if not argv or argv[0] != "ls":
        return False
    options: dict[str, object] = {"socket": None, "home": None, "json_output": False}
    rest = argv[1:]
    while rest:
        flag = rest.pop(0)
        if flag == "--json":
            options["json_output"] = True
        elif flag in ("--socket", "--home") and rest and not rest[0].startswith("-"):
            options[flag.lstrip("-")] = rest.pop(0)
        else:
            return False
    from loractl.cli.listing import list_adapters

    list_adapters(**options)  # type: ignore[arg-type]
    return True


def main() -> None:
    if _fast_ls(sys.argv[1:]):
        return
    from loractl.cli.app import app

    app()
