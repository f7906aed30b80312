"""Output and error handling shared by every command, without Typer (so the fast path of
``loractl ls`` can use it without paying for Typer's import).

Invariant: a command body never prints a traceback for a failure a user can cause. Domain
errors become ``loractl: error: ...`` plus ``hint: ...`` on stderr and the error's exit code;
``LORACTL_DEBUG=1`` re-raises so the traceback shows.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from rich.console import Console

from loractl.errors import LoractlError

if TYPE_CHECKING:
    from loractl.client import Client

T = TypeVar("T")

stdout = Console(highlight=False)  # tables must fit the terminal: no soft wrap here
stderr = Console(stderr=True, highlight=False, soft_wrap=True)


def fail(error: LoractlError) -> SystemExit:
    """Print a domain error as one line plus a hint; the caller raises the returned exit."""
    stderr.print(f"[bold red]loractl: error:[/] {error.message}", markup=True, highlight=False)
    if error.hint:
        stderr.print(f"[dim]hint:[/] {error.hint}", markup=True, highlight=False)
    return SystemExit(error.exit_code)


def with_client(socket: str | None, home: str | None, body: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``body`` with a connected client; map every domain error to a clean exit."""

    from loractl.client import Client  # here, not at import: `loractl --help` needs no gRPC

    async def go() -> T:
        async with Client(socket, home=home) as client:
            return await body(client)

    with cli_errors():
        return asyncio.run(go())


@contextlib.contextmanager
def cli_errors():
    """Domain errors become one error line, one hint and their exit code; Ctrl-C exits 130."""
    try:
        yield
    except LoractlError as e:
        if os.environ.get("LORACTL_DEBUG"):
            raise
        raise fail(e) from None
    except KeyboardInterrupt:
        stderr.print("interrupted")
        raise SystemExit(130) from None


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
