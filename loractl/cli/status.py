"""``loractl status``: is the daemon up, and what does it run."""

from __future__ import annotations

from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, with_client
from loractl.cli._output import waiting_notice
from loractl.cli._reads import requests_report, status_report


def status(
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
    wait: Annotated[bool, typer.Option("--wait", help="Wait until the engine is ready (a daemon still starting "
                                                      "or not listening yet counts as starting).")] = False,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds --wait waits at most.")] = 300.0,
) -> None:
    """Show the daemon's state: model, device, LoRA capacity, uptime.

    Capacity is read from the engine: device slots and host entries used and free, pins, disk.

    Examples:

        loractl status

        loractl status --json | jq .engine.max_loras

        loractl status --wait --timeout 120      # in scripts, right after starting the service
    """
    info = None
    if wait:
        info = with_client(socket, home, lambda client: client.wait_ready(timeout, missing_ok=True,
                                                                          on_wait=waiting_notice()))
    status_report(socket, home, json_output, info)

def ps(socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """List the requests the daemon holds: running in the engine, or waiting for a device slot.

    A request for an adapter waits at the admission gate while the device slots the pins leave
    free hold other adapters; POS is its place in the line, WAITED how long it waited. Above
    the requests, one line per adapter: requests running and waiting, and how long its oldest
    waiting request has waited (the longest first: an adapter starving shows at the top).

    Examples:

        loractl ps

        loractl ps --json | jq '[.requests[] | select(.state == "queued")] | length'

        loractl ps --json | jq '.adapters[0].oldest_wait_s'
    """
    requests_report(socket, home, json_output)

def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("ps")(ps)
