"""``loractl status``: is the daemon up, and what does it run."""

from __future__ import annotations

from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, print_json, stdout, with_client
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

# The daemon's admission policies (loractld.serving.admission.POLICIES; tests/test_admission.py
# checks the two agree): the CLI imports nothing of the daemon.
ADMISSION_POLICIES = ("measured", "batching", "adaptive", "first-come", "passthrough", "auto")


def _policies(incomplete: str) -> list[str]:
    return [p for p in ADMISSION_POLICIES if p.startswith(incomplete)]


def admission(
    policy: Annotated[str | None, typer.Argument(help=f"The policy to take: {', '.join(ADMISSION_POLICIES)}. "
                                                      "Without it: show the one in force.",
                                                 autocompletion=_policies, show_default=False)] = None,
    max_wait: Annotated[float | None, typer.Option("--max-wait", metavar="SECONDS",
                                                   help="The hand-over bound (as loractld --admission-max-wait); "
                                                        "default: the one in force.", show_default=False)] = None,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Show or change how requests for adapters are admitted to the device slots.

    passthrough: every request enters the engine at once and vLLM's scheduler keeps each step
    within max_loras, as vLLM's own server does (the choice where a slot change costs
    microseconds: a GPU); it holds as batching while a device pin is held or waiting.
    auto: measured on the CPU with loractl's LoRA ops, where a step of mixed adapters costs
    more than one of one adapter; passthrough elsewhere (a GPU), with the measured price of an
    exchange shown beside the mode.
    measured, batching, adaptive, first-come: a request for an adapter waits at the gate while
    the slots hold others (see loractld --help). A change holds until the daemon stops; set
    loractld --admission for good. Requests running or waiting stay.

    Examples:

        loractl admission

        loractl admission passthrough

        loractl admission batching --max-wait 0.05

        loractl admission --json | jq .mode
    """
    if policy is None:
        if max_wait is not None:
            raise typer.BadParameter("--max-wait needs a POLICY, e.g. loractl admission batching --max-wait 0.1")
        gate = with_client(socket, home, lambda client: client.status())["admission"]
    else:
        gate = with_client(socket, home, lambda client: client.set_admission(policy, max_wait_s=max_wait))
    if json_output:
        print_json(gate)
        return
    bound = f", hand-over after {gate['max_wait_s']:.3g} s" if gate["policy"] not in ("first-come", "passthrough") else ""
    stdout.print(f"admission {gate['policy']}{bound}: {gate['mode']} ({gate['mode_reason']})")
    stdout.print(f"{gate['active']} adapter(s) running in {gate['places']} device slot(s), {gate['pinned']} pinned, "
                 f"{gate['queued']} request(s) waiting")


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("ps")(ps)
    app.command("admission")(admission)
