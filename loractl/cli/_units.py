"""How the CLI writes sizes, revisions and times, in a module of its own: ``ls``, ``status``,
``ps`` and ``show`` run without Typer (``loractl.cli.main``), and each module they import is
paid for on every command (``loractl.cli._output`` and datetime were ~7 ms of ``loractl ls``)."""

from __future__ import annotations

import time


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def short_revision(revision: str) -> str:
    return revision.split(":", 1)[-1][:12]


def ago(timestamp: float) -> str:
    if not timestamp:
        return "-"
    seconds = max(0, time.time() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
