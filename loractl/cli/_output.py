"""Output and error handling shared by every command, without Typer (so the fast path of
``loractl ls`` can use it without paying for Typer's import).

Invariant: a command body never prints a traceback for a failure a user can cause. Domain
errors become ``loractl: error: ...`` plus ``hint: ...`` on stderr and the error's exit code;
``LORACTL_DEBUG=1`` re-raises so the traceback shows.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from loractl.cli._units import human_bytes, short_revision  # noqa: F401  (re-exported)
from loractl.errors import LoractlError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.text import Text

    from loractl.client import Client

T = TypeVar("T")

_consoles: dict[str, Console] = {}


def __getattr__(name: str) -> Console:
    """``stdout`` and ``stderr``, rich consoles made at first use: rich's import is a large
    share of a fast ``loractl ls``, which mostly needs neither."""
    if name not in ("stdout", "stderr"):
        raise AttributeError(name)
    if name not in _consoles:
        from rich.console import Console

        # No markup and no emoji codes: what these consoles print is mostly names, paths, hints and
        # error text that users and remote sources wrote ('[/subfolder]' ended in a MarkupError);
        # colour comes from Text styles, or from markup=True over escape()d values (styled()).
        if name == "stdout":
            from loractl.cli import _output_width

            # Tables fit the terminal; into a pipe or a file nothing is folded (unless $COLUMNS says).
            width = _output_width()
            _consoles[name] = Console(highlight=False, markup=False, emoji=False, width=width,
                                      soft_wrap=width is not None and "COLUMNS" not in os.environ)
        else:
            _consoles[name] = Console(stderr=True, highlight=False, soft_wrap=True, markup=False, emoji=False)
    return _consoles[name]


def styled(style: str, label: str, text: str = "") -> Text:
    """``label`` in ``style``, then ``text`` as it is (never read as markup)."""
    from rich.text import Text

    return Text.assemble((label, style), text)


def print_error(error: LoractlError, prefix: str = "loractl: error:") -> None:
    """A domain error's message and hint on stderr, both printed exactly as they read."""
    stderr = __getattr__("stderr")
    stderr.print(styled("bold red", prefix, f" {error.message}"))
    if error.hint:
        stderr.print(styled("dim", "hint:", f" {error.hint}"))


def fail(error: LoractlError) -> SystemExit:
    """Print a domain error as one line plus a hint; the caller raises the returned exit."""
    print_error(error)
    return SystemExit(error.exit_code)


def with_client(socket: str | None, home: str | None, body: Callable[[Client], Awaitable[T]]) -> T:
    """Run ``body`` with a connected client; map every domain error to a clean exit."""

    import asyncio

    from loractl.client import Client  # here, not at import: `loractl --help` needs no gRPC

    async def go() -> T:
        async with Client(socket, home=home) as client:
            return await body(client)

    with cli_errors():
        return asyncio.run(go())


def waiting_notice(what: str = "the engine to start"):
    """An ``on_wait`` for :meth:`Client.wait_ready`: what the starting daemon is doing, as a live
    line on a terminal and a line per stage in a pipe (``loractl.cli._progress``)."""
    from loractl.cli._progress import StartupNotice

    return StartupNotice(f"waiting for {what}")


@contextlib.contextmanager
def working(what: str):
    """A spinner with ``what`` and the seconds so far on a terminal's stderr while the body runs
    (a merge, a create: seconds with nothing to show otherwise); nothing in a pipe."""
    err = __getattr__("stderr")
    if not err.is_terminal:
        yield
        return
    import time

    started = time.monotonic()
    with err.status(what) as shown:
        import threading

        done = threading.Event()

        def tick() -> None:
            while not done.wait(1.0):
                shown.update(f"{what} ({time.monotonic() - started:.0f} s)")
        ticker = threading.Thread(target=tick, daemon=True)
        ticker.start()
        try:
            yield
        finally:
            done.set()


def _end_progress_line() -> None:
    progress = sys.modules.get("loractl.cli._progress")
    if progress is not None:
        progress.end_live_lines()


@contextlib.contextmanager
def cli_errors():
    """Domain errors become one error line, one hint and their exit code; Ctrl-C exits 130."""
    try:
        yield
    except LoractlError as e:
        _end_progress_line()
        if os.environ.get("LORACTL_DEBUG"):
            raise
        raise fail(e) from None
    except KeyboardInterrupt:
        _end_progress_line()
        __getattr__("stderr").print("interrupted")
        raise SystemExit(130) from None


def print_json(data: Any) -> None:
    sys.stdout.write(dumps_indented(data) + "\n")


def dumps_indented(data: Any) -> str:
    """``json.dumps(data, indent=2, sort_keys=True)``, the same text: the standard library's C
    encoder does not indent (before 3.14), and its Python one took 0.4 s of ``ls --json`` at
    10,000 adapters; this one encodes each string and number with the C functions (~2x faster).
    Anything but str keys and JSON's own types goes to the standard library."""
    out: list[str] = []
    try:
        _emit(data, "\n", out.append)
    except _NotPlain:
        pass
    else:
        return "".join(out)
    return json.dumps(data, indent=2, sort_keys=True)


class _NotPlain(Exception):
    pass


_string = json.encoder.encode_basestring_ascii   # C: what json.dumps uses (ensure_ascii)


def _scalar(value: Any) -> str | None:
    kind = type(value)
    if kind is str:
        return _string(value)
    if value is None:
        return "null"
    if value is True:
        return "true"
    if value is False:
        return "false"
    if kind is int:
        return int.__repr__(value)
    if kind is float:
        if value != value:
            return "NaN"
        if value in (float("inf"), float("-inf")):
            return "Infinity" if value > 0 else "-Infinity"
        return float.__repr__(value)
    return None


def _emit(value: Any, newline: str, put: Callable[[str], Any]) -> None:
    text = _scalar(value)
    if text is not None:
        put(text)
        return
    kind = type(value)
    if kind is dict:
        if not value:
            put("{}")
            return
        if not all(type(k) is str for k in value):
            raise _NotPlain   # json.dumps turns other keys into strings, and sorts them as such
        inner = newline + "  "
        lead = "{" + inner
        for key in sorted(value):
            item = value[key]
            text = _scalar(item)
            if text is not None:
                put(lead + _string(key) + ": " + text)
            else:
                put(lead + _string(key) + ": ")
                _emit(item, inner, put)
            lead = "," + inner
        put(newline + "}")
    elif kind is list or kind is tuple:
        if not value:
            put("[]")
            return
        inner = newline + "  "
        lead = "[" + inner
        for item in value:
            text = _scalar(item)
            if text is not None:
                put(lead + text)
            else:
                put(lead)
                _emit(item, inner, put)
            lead = "," + inner
        put(newline + "]")
    else:
        raise _NotPlain


