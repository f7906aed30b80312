"""``loractl status``: is the daemon up, and what does it run."""

from __future__ import annotations

from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, human_bytes, print_json, stdout, with_client
from loractl.cli._output import waiting_notice


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
    if wait:
        info = with_client(socket, home, lambda client: client.wait_ready(timeout, missing_ok=True,
                                                                          on_wait=waiting_notice()))
    else:
        info = with_client(socket, home, lambda client: client.status())
    if json_output:
        print_json(info)
        return
    engine = info["engine"]
    from rich.table import Table

    table = Table(show_header=False, box=None, pad_edge=False)
    table.add_column(style="bold")
    table.add_column()
    table.add_row("state", "[green]ready[/]" if info["ready"] else "[yellow]starting[/]")
    name, asked = engine.get("model_name") or engine["model"], engine.get("model_arg") or ""
    table.add_row("model", (name or "-") + (f" (--model {asked})" if asked and asked != name else ""))
    if engine["model"] and engine["model"] != name:
        table.add_row("model folder", engine["model"])
    table.add_row("device", f"{engine['device'] or '-'} ({engine['dtype'] or '-'})")
    cap = info["capacity"]
    table.add_row("device slots", f"{cap['device_used']} used, {cap['device_slots'] - cap['device_used']} free "
                                  f"(device pins {cap.get('device_pins', 0)}/{cap.get('max_device_pins', 0)})")
    table.add_row("host slots", f"{cap['host_used']} used, {cap['host_slots'] - cap['host_used']} free "
                                f"(host pins {cap['pins']}/{cap['max_pins']})")
    table.add_row("disk", f"{cap['disk_adapters']} adapters, {human_bytes(int(cap['disk_bytes']))}")
    table.add_row("max rank", str(cap["max_lora_rank"] or engine["max_lora_rank"]))
    table.add_row("context", f"{engine['max_model_len']} tokens")
    kv = int(engine.get("kv_cache_bytes") or 0)
    table.add_row("kv cache", (human_bytes(kv) if kv else "sized by vLLM")
                  + f", up to {engine.get('max_num_seqs') or '-'} sequences a step")
    table.add_row("in flight", str(info["requests_in_flight"]))
    gate = info.get("admission") or {}
    if gate.get("policy"):
        bound = f", hand-over after {gate['max_wait_s']:g} s" if gate["policy"] == "batching" else ""
        table.add_row("admission", f"{gate['policy']}{bound}: {gate['active']} adapter(s) running, "
                                   f"{gate['queued']} request(s) waiting for a slot (loractl ps)")
    table.add_row("uptime", f"{info['uptime_s']:.0f} s (engine start {info['engine_start_s']:.1f} s)")
    table.add_row("daemon", f"loractld {info['version']}, vllm {engine['vllm_version'] or '-'}, pid {info['pid']}")
    table.add_row("socket", info["socket"])
    if info.get("http"):
        table.add_row("http", f"{info['http']}/v1 (OpenAI-compatible)")
    stdout.print(table)


def ps(socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """List the requests the daemon holds: running in the engine, or waiting for a device slot.

    A request for an adapter waits at the admission gate while the device slots the pins leave
    free hold other adapters; POS is its place in the line, WAITED how long it waited.

    Examples:

        loractl ps

        loractl ps --json | jq '[.[] | select(.state == "queued")] | length'
    """
    info = with_client(socket, home, lambda client: client.status())
    requests = sorted((info.get("admission") or {}).get("requests", []),
                      key=lambda r: (r["state"] != "queued", r.get("position", 0), -r.get("age_s", 0.0)))
    if json_output:
        print_json(requests)
        return
    if not requests:
        stdout.print("no requests in flight")
        return
    from rich.table import Table

    table = Table(box=None, pad_edge=False, header_style="bold")
    for header in ("ID", "ADAPTER", "STATE", "POS", "WAITED", "AGE"):
        table.add_column(header, no_wrap=True)
    for r in requests:
        table.add_row(r["id"], r["adapter"] or "(base model)", r["state"], str(r.get("position") or "-"),
                      f"{r.get('waited_s', 0.0):.2f}s", f"{r.get('age_s', 0.0):.1f}s")
    stdout.print(table)


def register(app: typer.Typer) -> None:
    app.command("status")(status)
    app.command("ps")(ps)
