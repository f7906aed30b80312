"""The daemon's start-up progress on stderr, while a command waits for the engine.

On a terminal: one live line, rewritten on each poll (``loractl: training demo adapter
pirate/v1 (once): 12/30 steps, loss 1.234, about 40 s left``); a finished stage's line stays
above the next one. In a pipe or a log: one line per stage, when it begins.

Invariants: the live line never wraps (cut to the terminal's width, since a wrapped line
cannot be rewritten with a carriage return), and it is ended with a newline before the
command's own output (the wait's last call, with the ready status, ends it).
"""

from __future__ import annotations

import shutil
import sys
from typing import Any, TextIO


def describe(startup: dict[str, Any] | None, fallback: str, brief: bool = False) -> tuple[str, str]:
    """(stage key, the line's text) for a ``Status.startup`` (``fallback`` when it says nothing);
    ``brief``: the stage and its size only, for the one line a pipe gets when it begins."""
    if not startup or not startup.get("stage"):
        return "", fallback
    text = startup.get("message") or startup["stage"]
    done, total, unit = float(startup.get("done") or 0), float(startup.get("total") or 0), startup.get("unit") or ""
    key = f"{startup['stage']}:{text}"
    if brief:
        size = {"s": f"about {total:.0f} s, as the last start", "bytes": f"{total / 1e6:.1f} MB"}.get(
            unit, f"{total:.0f} {unit}".rstrip())
        return key, f"{text} ({size})" if total else text
    parts = []
    if unit == "s":
        parts.append(f"{done:.0f} s" + (f" of about {total:.0f} s (the last start)" if total else ""))
    elif unit == "bytes" and (done or total):
        parts.append(f"{done / 1e6:.1f}" + (f"/{total / 1e6:.1f}" if total else "") + " MB")
    elif done or total:
        parts.append(f"{done:.0f}" + (f"/{total:.0f}" if total else "") + f" {unit}".rstrip())
    if startup.get("detail"):
        parts.append(startup["detail"])
    eta = float(startup.get("eta_s") or 0)
    if eta >= 1 and unit != "s":
        parts.append(f"about {eta:.0f} s left")
    elif not parts:
        parts.append(f"{float(startup.get('elapsed_s') or 0):.0f} s")
    return key, f"{text}: {', '.join(parts)}"


_live: list[StartupNotice] = []


def end_live_lines() -> None:
    """End any live line still open (before an error message, which must start a line)."""
    for notice in list(_live):
        notice._end()


class StartupNotice:
    """An ``on_wait`` for :meth:`Client.wait_ready` that shows what the daemon is doing."""

    def __init__(self, fallback: str = "waiting for the engine to start", stream: TextIO | None = None,
                 live: bool | None = None) -> None:
        self.fallback = fallback
        self.stream = stream or sys.stderr
        self.live = self.stream.isatty() if live is None else live
        self._stage: str | None = None
        self._shown = False    # a live line is on the screen, not yet ended

    def __call__(self, elapsed: float, status: dict[str, Any] | None) -> None:
        if status is not None and status.get("ready"):
            self._end()
            return
        stage, text = describe((status or {}).get("startup"), self.fallback, brief=not self.live)
        if not stage:
            text = f"{text} ({elapsed:.0f} s)" if self.live else text
        line = f"loractl: {text}"
        if self.live:
            if stage != self._stage:
                self._end()
            width = max(shutil.get_terminal_size((100, 24)).columns - 1, 20)
            self.stream.write("\r\x1b[K" + line[:width])
            self._shown = True
            if self not in _live:
                _live.append(self)
        elif stage != self._stage:
            self.stream.write(line + "\n")
        self._stage = stage
        self.stream.flush()

    def _end(self) -> None:
        if self._shown:
            self.stream.write("\n")
            self.stream.flush()
            self._shown = False
            if self in _live:
                _live.remove(self)


ASLEEP_STATES = ("asleep", "waking")


async def woken(status: dict[str, Any] | None, chunks, stream: TextIO | None = None):
    """``chunks`` (a generation's stream), with a notice until its first chunk while the daemon's
    engine sleeps (``loractld --keep-alive``): the request wakes it and waits, for seconds (a full
    engine start on the CPU), which should not read as a hang. ``status``: the daemon's, just read."""
    if not status or status.get("state") not in ASLEEP_STATES:
        async for chunk in chunks:
            yield chunk
        return
    import asyncio
    import time

    notice = StartupNotice("waking the engine (asleep after --keep-alive idle)", stream=stream)
    began = time.monotonic()

    async def tick() -> None:
        while True:
            notice(time.monotonic() - began, None)
            await asyncio.sleep(0.5)

    ticker: asyncio.Task | None = asyncio.ensure_future(tick())
    try:
        async for chunk in chunks:
            if ticker is not None:
                ticker.cancel()
                ticker = None
                notice._end()
            yield chunk
    finally:
        if ticker is not None:
            ticker.cancel()
        notice._end()
