"""``loractl ls`` rendering, free of Typer so that ``loractl.cli.main`` can run it directly."""

from __future__ import annotations

import datetime

from loractl.cli._output import human_bytes, print_json, short_revision, stderr, stdout, with_client


def list_adapters(socket: str | None, home: str | None, json_output: bool) -> None:
    adapters = with_client(socket, home, lambda client: client.list())
    if json_output:
        print_json(adapters)
        return
    if not adapters:
        stderr.print("no adapters yet: loractl pull ORG/REPO")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    # Names are what users copy into the next command: they never get cut.
    table.add_column("NAME", no_wrap=True, min_width=min(40, max(len(a["name"]) for a in adapters)))
    table.add_column("TIER", no_wrap=True, min_width=7)
    table.add_column("SIZE", no_wrap=True, min_width=8)
    table.add_column("RANK", no_wrap=True, min_width=4)
    table.add_column("REVISION", no_wrap=True, min_width=12)
    table.add_column("USED", no_wrap=True, min_width=7)
    for a in adapters:
        tier = a["tier"] + ("*" if a["pinned"] else "")
        if a["state"] == "failed":
            tier = "[red]failed[/]"
        elif a["state"] == "loading":
            tier = "[yellow]loading[/]"
        table.add_row(a["name"], tier, human_bytes(int(a["size_bytes"])), str(a["rank"]),
                      short_revision(a["revision"]), ago(a["last_used"]))
    stdout.print(table)


def ago(timestamp: float) -> str:
    if not timestamp:
        return "-"
    seconds = max(0, datetime.datetime.now().timestamp() - timestamp)
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size:.0f}{unit} ago"
    return f"{seconds:.0f}s ago"
