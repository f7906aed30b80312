"""``loractl instances``: the daemons in the service registry."""

from __future__ import annotations

import datetime
import sys

import typer

from loractl.cli._common import HomeOpt, JsonOpt, print_json, stderr, stdout


def instances(home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """List the live loractld instances on this machine, with what each holds on device.

    Read from the file-based service registry; a daemon that died is gone from it at once.

    Examples:

        loractl instances

        loractl instances --json | jq -r '.[].instance_id'
    """
    from loractl.client import Client

    found = Client(home=home).instances()
    if json_output:
        print_json(found)
        return
    if not found:
        stderr.print("no loractld instances are running; start one with: loractld --model demo")
        return
    columns = ("INSTANCE", "STATUS", "MODEL", "ON DEVICE", "SINCE")
    rows = []
    for i in found:
        meta = i["metadata"]
        loaded = meta.get("lora", {}).get("loaded_loras", [])
        since = datetime.datetime.fromtimestamp(i["started"]).strftime("%H:%M:%S") if i["started"] else "-"
        rows.append((i["instance_id"], i["status"], str(meta.get("model", "-")), ", ".join(loaded) or "-", since))
    if not sys.stdout.isatty():
        # A pipe gets whole lines, however long: a name split across two lines is no name to grep.
        widths = [max(len(r[n]) for r in [columns, *rows]) for n in range(len(columns))]
        for row in [columns, *rows]:
            sys.stdout.write("  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() + "\n")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for column in columns:
        table.add_column(column, no_wrap=column != "ON DEVICE", overflow="fold")
    for row in rows:
        table.add_row(*row)
    stdout.print(table)


def register(app: typer.Typer) -> None:
    app.command("instances")(instances)
