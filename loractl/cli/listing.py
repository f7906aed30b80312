"""``loractl ls`` rendering, free of Typer so that ``loractl.cli.main`` can run it directly."""

from __future__ import annotations

import os
import re
import sys

from loractl.cli._units import ago, human_bytes, short_revision  # noqa: F401  (ago: for the commands that import it here)

# typing's import is ~4 ms of a command that prints a table; the annotations are never evaluated.
TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

COLUMNS = ("NAME", "TIER", "PIN", "SIZE", "RANK", "REVISION", "USED")
# States shown in the TIER column instead of the tier (checking: listed before it was validated).
_STATE_COLOURS = {"failed": "red", "loading": "yellow", "checking": "yellow"}
# Text rich prints as it is: no markup ([), no emoji codes (:), no wide or control characters.
_PLAIN_CELL = re.compile(r"[A-Za-z0-9 ._/*+-]*\Z")


def list_adapters(socket: str | None, home: str | None, json_output: bool) -> None:
    if json_output:
        text = _quick_json(socket, home)
        if text is not None:
            sys.stdout.write(text + "\n")
            return
    else:
        listed = _quick_table(socket, home)
        if listed is not None:
            _print_listing(*listed)
            return
    from loractl.cli._output import print_json, with_client

    adapters = with_client(socket, home, lambda client: client.list())
    if json_output:
        print_json(adapters)
        return
    profiles = [a for a in adapters if a.get("kind") == "profile"]
    adapters = [a for a in adapters if a.get("kind") != "profile"]
    _print_listing([_row(a) for a in adapters], [a["state"] for a in adapters], profiles)


def _row(a: dict[str, Any]) -> tuple[str, ...]:
    """One adapter's cells (COLUMNS), from its dict or its message (``_Fields``)."""
    return (a["name"], a["tier"], a["pin"] or ("host" if a["pinned"] else "-"), human_bytes(int(a["size_bytes"])),
            str(a["rank"]), short_revision(a["revision"]), ago(a["last_used"]))


class _Fields:
    """A message read as ``_row`` reads a dict: the table's few fields, not all of them (at
    10,000 adapters their dicts, files and all, were half of ``loractl ls``)."""

    __slots__ = ("message",)

    def __init__(self, message) -> None:
        self.message = message

    def __getitem__(self, name: str):
        return getattr(self.message, name)


def _print_listing(rows: list[tuple[str, ...]], states: list[str], profiles: list[dict[str, Any]]) -> None:
    if not rows and not profiles:
        from loractl.cli._output import stderr

        stderr.print("no adapters yet: loractl pull ORG/REPO")
        return
    if rows:
        _adapter_table(rows, states)
    if profiles:
        sys.stdout.write(("\n" if rows else "") + profile_table(profiles))
        sys.stdout.flush()


def profile_table(profiles: list[dict[str, Any]]) -> str:
    """The profiles and what each is made of: PROFILE, RUNS (its adapter or the base model),
    DEFAULTS (system prompt, few-shot messages, parameters)."""
    rows = [("PROFILE", "RUNS", "DEFAULTS")] + [
        (p["name"], (p.get("profile") or {}).get("adapter") or "base model", describe(p.get("profile") or {}) or "-")
        for p in profiles]
    widths = [max(len(r[i]) for r in rows) for i in range(2)]
    return "".join(f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]}".rstrip() + "\n" for r in rows)


def describe(profile: dict) -> str:
    """What a profile adds, in a few words: ``system, 2 messages, temperature=0``."""
    parts = ["system" if profile.get("system") is not None else "", "template" if profile.get("template") else "",
             f"{len(profile['messages'])} messages" if profile.get("messages") else ""]
    parts += [f"{k}={v}" for k, v in sorted((profile.get("parameters") or {}).items())]
    return ", ".join(p for p in parts if p)


def _adapter_table(rows: list[tuple[str, ...]], states: list[str]) -> None:
    # Names are what users copy into the next command: they never get cut.
    min_widths = (min(40, max(len(row[0]) for row in rows)), 7, 6, 8, 4, 12, 7)
    text = plain_table(rows, states, min_widths, _plain_width()) if _plain_width() else None
    if text is not None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return
    from rich.table import Table
    from rich.text import Text

    from loractl.cli._output import stdout

    table = Table(box=None, pad_edge=False, header_style="bold")
    for header, min_width in zip(COLUMNS, min_widths):
        table.add_column(header, no_wrap=True, min_width=min_width)
    for row, state in zip(rows, states):
        colour = _STATE_COLOURS.get(state)
        table.add_row(row[0], Text(state, style=colour) if colour else row[1], *row[2:])
    stdout.print(table)


def _quick_table(socket: str | None, home: str | None
                 ) -> tuple[list[tuple[str, ...]], list[str], list[dict[str, Any]]] | None:
    """The table's rows and states and the profiles, asked without asyncio or grpclib
    (``loractl.cli._quick``) and read from the reply's messages; None when that cannot be done
    (tests/test_cli_fast.py compares the two paths' output)."""
    from loractl.cli._quick import message
    from loractl.v1 import loractl_pb2 as pb

    answer = message(socket, home, "/loractl.v1.Loractl/List", pb.ListRequest(), pb.ListReply)
    if answer is None:
        return None
    rows, states, profiles = [], [], []
    for adapter in answer.adapters:
        if adapter.kind == "profile":
            from loractl.messages import to_dict

            profiles.append(to_dict(adapter))
        else:
            rows.append(_row(_Fields(adapter)))
            states.append(adapter.state)
    return rows, states, profiles


def _quick_json(socket: str | None, home: str | None) -> str | None:
    """``ls --json``'s text as the daemon wrote it (``ListReply.json``), or written here from the
    reply's messages (a daemon from before that field), no dicts between (at 10,000 adapters
    they cost more than the text; ``loractl.message_json``); None: the dicts' way."""
    from loractl.cli._quick import message
    from loractl.message_json import messages_json
    from loractl.v1 import loractl_pb2 as pb

    answer = message(socket, home, "/loractl.v1.Loractl/List", pb.ListRequest(json=True), pb.ListReply)
    if answer is None:
        return None
    return answer.json or messages_json(answer.adapters)


def _plain_width() -> int | None:
    """The width rich would print at, when it would print plain text (no colour, no terminal
    quirks); else None and rich does the printing."""
    from loractl.cli import HELP_ENV, _output_width

    out = sys.stdout
    if sys.platform == "win32" or out is None or out.isatty() or HELP_ENV.intersection(os.environ):
        return None
    return _output_width()


def plain_table(rows: list[tuple[str, ...]], states: list[str], min_widths: tuple[int, ...],
                width: int) -> str | None:
    """The table exactly as rich prints ``Table(box=None, pad_edge=False)`` of no_wrap columns
    without colour, or None when rich would do more than pad (cut, wrap, interpret markup)."""
    rows = [(row[0], state if state in _STATE_COLOURS else row[1], *row[2:]) for row, state in zip(rows, states)]
    if not all(_PLAIN_CELL.match(cell) for row in rows for cell in row):
        return None
    last = len(COLUMNS) - 1
    # Each cell is padded one space each side, except the table's outer edges (pad_edge=False).
    pads = [(0 if i == 0 else 1) + (0 if i == last else 1) for i in range(len(COLUMNS))]
    widths = [max(min_widths[i], len(COLUMNS[i]), *(len(row[i]) for row in rows)) for i in range(len(COLUMNS))]
    if sum(w + p for w, p in zip(widths, pads)) > width:
        return None
    lines = []
    for row in [COLUMNS, *rows]:
        cells = [("" if i == 0 else " ") + cell.ljust(widths[i]) + ("" if i == last else " ")
                 for i, cell in enumerate(row)]
        lines.append("".join(cells) + "\n")
    return "".join(lines)
