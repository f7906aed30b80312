"""The tiers: ``loractl load``, ``evict``, ``pin``, ``unpin``, ``events``, ``metrics``."""

from __future__ import annotations

import datetime
import json
import sys
from enum import Enum
from typing import TYPE_CHECKING, Annotated, Any

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, human_bytes, print_json, stderr, stdout, with_client
from loractl.cli._output import styled
from loractl.cli._complete import adapter_names

if TYPE_CHECKING:
    from loractl.client import Client

NameArg = Annotated[str, typer.Argument(help="Adapter name, e.g. sql-expert/v1 (see loractl ls).",
                                        autocompletion=adapter_names)]


class Tier(str, Enum):
    device = "device"
    host = "host"


def describe_residency(a: dict[str, Any]) -> str:
    where = {"device": f"on device (slot {a['slot']})", "host": "in host RAM", "disk": "on disk only"}[a["tier"]]
    extra = f", {human_bytes(int(a['host_bytes']))} in RAM" if int(a["host_bytes"]) else ""
    pin = a.get("pin") or ("host" if a["pinned"] else "")
    return f"{a['name']}: {where}{extra}" + ({"device": ", pinned to the device", "host": ", pinned in host RAM"}.get(pin, ""))


def _report(result: dict[str, Any], json_output: bool) -> None:
    if json_output:
        print_json(result)
    else:
        stdout.print(describe_residency(result))


def load(name: NameArg, to: Annotated[Tier, typer.Option("--to", help="Target tier.")] = Tier.device,
         socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """Load a stored adapter onto the device (default) or into host RAM.

    The reply is where the engine really holds it afterwards.

    Examples:

        loractl load sql-expert/v1

        loractl load sql-expert/v1 --to host
    """
    _report(with_client(socket, home, lambda c: c.load(name, to=to.value)), json_output)


def evict(name: NameArg,
          source: Annotated[Tier, typer.Option("--from", help="device: the host copy stays; host: frees RAM, "
                                                              "the disk copy stays.")] = Tier.device,
          socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """Evict an adapter from the device (default) or from host RAM.

    From the device, the host copy stays; from host RAM, the disk copy stays. Pinned adapters are refused.

    Examples:

        loractl evict sql-expert/v1

        loractl evict sql-expert/v1 --from host
    """
    _report(with_client(socket, home, lambda c: c.evict(name, source=source.value)), json_output)


def pin(name: NameArg,
        to: Annotated[Tier, typer.Option("--to", help="host: kept in RAM, one copy from a slot; device: kept in a "
                                                       "device slot, hot.")] = Tier.host,
        socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """Pin an adapter: loaded now and never evicted; pins survive restarts.

    --to host (the default) keeps it in host RAM: one memory copy from a device slot, never a
    disk read; at most max_cpu_loras - max_loras host pins. --to device keeps it in a device
    slot for good: no copy at all; at most max_loras - 1 device pins, and the slot is taken
    from the adapters that run now once their requests finish (new ones wait meanwhile).

    Examples:

        loractl pin sql-expert/v1

        loractl pin sql-expert/v1 --to device
    """
    _report(with_client(socket, home, lambda c: c.pin(name, to=to.value)), json_output)


def unpin(name: NameArg, socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """Unpin an adapter (host or device pin): it stays loaded, but LRU may evict it again.

    The pin is also dropped from the daemon's saved state, so it is not restored on restart.

    Examples:

        loractl unpin sql-expert/v1
    """
    _report(with_client(socket, home, lambda c: c.unpin(name)), json_output)


def events(
    count: Annotated[int, typer.Option("--count", "-n", min=0, help="Stop after this many events (0: never).")] = 0,
    history: Annotated[int, typer.Option("--history", min=0, max=256,
                                         help="First show this many of the most recent events (0: only new ones).")] = 20,
    socket: SocketOpt = None, home: HomeOpt = None,
    json_output: Annotated[bool, typer.Option("--json", help="One JSON object per line.")] = False,
) -> None:
    """Follow lifecycle events: pulls, loads, evictions, pins, failures.

    Evictions vLLM makes on its own (LRU) and lazy loads by requests are reported too.

    Examples:

        loractl events

        loractl events --history 0 --json -n 10     # the next ten, in a script
    """

    async def follow(client: Client) -> None:
        seen = 0
        if sys.stderr.isatty() and not json_output:   # a quiet daemon must not look like a hung command
            stderr.print(styled("dim", f"following loractld's events, after the {history} most recent; Ctrl-C stops"))
        async for event in client.events(history):
            if json_output:
                sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
            else:
                when = datetime.datetime.fromtimestamp(event["time"]).strftime("%H:%M:%S")
                reason = f" ({event['reason']})" if event["reason"] else ""
                stdout.print(f"{when} {event['kind']:<21} {event['adapter']}{reason}"
                             + (f": {event['message']}" if event["message"] else ""))
            sys.stdout.flush()
            seen += 1
            if count and seen >= count:
                return

    with_client(socket, home, follow)


def metrics(socket: SocketOpt = None, home: HomeOpt = None) -> None:
    """Print the daemon's metrics in the Prometheus text format.

    Load-time histograms by tier, loads and evictions by tier and reason, requests per adapter, bytes per tier.

    Examples:

        loractl metrics | grep loractl_adapter_loads_total
    """
    sys.stdout.write(with_client(socket, home, lambda c: c.metrics()))


def register(app: typer.Typer) -> None:
    for command in (load, evict, pin, unpin, events, metrics):
        app.command(command.__name__)(command)
