"""What every command shares: option aliases, the error map, output helpers.

Invariant: a command body never prints a traceback for a failure a user can cause. Domain
errors become ``loractl: error: ...`` plus ``hint: ...`` on stderr and the error's exit code;
``LORACTL_DEBUG=1`` re-raises so the traceback shows.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console

from loractl.client import Client
from loractl.errors import LoractlError

T = TypeVar("T")

SocketOpt = Annotated[
    str | None,
    typer.Option("--socket", envvar="LORACTL_SOCKET", show_envvar=True,
                 help="Daemon socket (default: under LORACTL_HOME or the user runtime dir)."),
]
HomeOpt = Annotated[
    str | None,
    typer.Option("--home", envvar="LORACTL_HOME", show_envvar=True, help="loractl's home folder."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]


stdout = Console(highlight=False)  # tables must fit the terminal: no soft wrap here
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(error: LoractlError) -> typer.Exit:
    """Print a domain error as one line plus a hint; the caller raises the returned Exit."""
    stderr.print(f"[bold red]loractl: error:[/] {error.message}", markup=True, highlight=False)
    if error.hint:
        stderr.print(f"[dim]hint:[/] {error.hint}", markup=True, highlight=False)
    return typer.Exit(error.exit_code)


def with_client(socket: str | None, home: str | None, body: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``body`` with a connected client; map every domain error to a clean exit."""

    async def go() -> T:
        async with Client(socket, home=home) as client:
            return await body(client)

    try:
        return asyncio.run(go())
    except LoractlError as e:
        if os.environ.get("LORACTL_DEBUG"):
            raise
        raise fail(e) from None
    except KeyboardInterrupt:
        stderr.print("interrupted")
        raise typer.Exit(130) from None


def print_json(data: Any) -> None:
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def short_revision(revision: str) -> str:
    return revision.split(":", 1)[-1][:12]
