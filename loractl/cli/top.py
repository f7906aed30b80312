"""``loractl top``: a live view of the daemon, refreshed about once a second.

Each refresh also shows the exchange between tiers (``loractl.cli._exchange``): loads, bytes
and evictions per second per tier, and how long requests waited for a device slot or for their
adapter's load; ``--json`` prints each refresh as one JSON object per line instead.

Each refresh asks Status, List and Metrics at once (their reads of the engine's tiers are
shared: one read serves the three), and the Events stream runs beside them, so tier moves
show as they happen. Nothing here touches the request path: the daemon answers these calls
from what it already keeps (tokens per adapter are a counter the generations bump).

On a terminal the screen is redrawn in place and ``q`` quits (Ctrl-C too); in a pipe each
refresh is a plain-text block, and ``--iterations`` stops after that many.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import os
import sys
import time
from typing import Annotated, Any

import typer

from loractl.cli import _exchange
from loractl.cli._common import HomeOpt, SocketOpt
from loractl.cli._output import cli_errors

TOKENS = "loractl_adapter_generated_tokens_total"
DISK_SHOWN = 8
KV_USAGE = "vllm:kv_cache_usage_perc"
MOVES = {"LOADED_TO_DEVICE": "-> device", "UNLOADED_FROM_DEVICE": "device ->", "LOADED_TO_HOST": "-> host",
         "EVICTED_FROM_HOST": "host ->", "PINNED": "pinned", "UNPINNED": "unpinned", "FAILED": "failed",
         "DOWNLOADED_TO_DISK": "-> disk", "DELETED_FROM_DISK": "deleted"}


def parse_metrics(text: str) -> tuple[dict[str, float], float | None]:
    """(tokens generated so far per adapter label, the KV cache's use 0..1 or None)."""
    tokens: dict[str, float] = {}
    kv = None
    for name, labels, value in _exchange.samples(text):
        if name == TOKENS:
            tokens[labels.get("adapter", "")] = value
        elif name == KV_USAGE:
            kv = max(kv or 0.0, value)
    return tokens, kv


def render(status: dict[str, Any], adapters: list[dict[str, Any]], rates: dict[str, float], kv: float | None,
           moves: collections.deque, now: float, exchange: dict[str, Any] | None = None) -> list[str]:
    """The view as lines of plain text."""
    engine, cap, gate = status["engine"], status["capacity"], status.get("admission") or {}
    requests = gate.get("requests") or []
    running = [r for r in requests if r["state"] == "running"]
    waiting = [r for r in requests if r["state"] == "queued"]
    lines = [f"loractl top - {engine.get('model_name') or engine['model']} on {engine['device'] or '-'} - "
             f"{time.strftime('%H:%M:%S', time.localtime(now))}",
             f"requests: {len(running)} running, {len(waiting)} waiting for a device slot"
             f" (admission {gate.get('policy') or '-'}{', ' + gate['mode'] if gate.get('mode') else ''}); KV cache "
             + (f"{kv * 100:.1f}% used" if kv is not None else "use unknown"), ""]
    stored = [a for a in adapters if a.get("kind") != "profile"]   # a profile holds no slot and no file of its own
    tiers = {"device": [], "host": [], "disk": []}
    in_slot: dict[int, list[str]] = {}
    for a in stored:
        pin = a.get("pin") or ("host" if a.get("pinned") else "")
        shown = a["name"] + (f" [pin {pin}]" if pin else "")
        if a["tier"] == "device" and int(a.get("slot", -1)) >= 0:
            in_slot.setdefault(int(a["slot"]), []).append(shown)   # copies that share content share a slot
        else:
            tiers.setdefault(a["tier"], []).append(shown)
    tiers["device"] = [" = ".join(names) for _, names in sorted(in_slot.items())] + tiers["device"]
    lines.append(f"device  {cap['device_used']}/{cap['device_slots']} slots  " + (", ".join(tiers["device"]) or "-"))
    lines.append(f"host    {cap['host_used']}/{cap['host_slots']} slots  " + (", ".join(tiers["host"]) or "-"))
    # Only the first few: with thousands of adapters on disk the line would fill the screen.
    disk = tiers["disk"]
    lines.append(f"disk    {len(stored)} adapters  " + (", ".join(disk[:DISK_SHOWN]) or "-")
                 + (f", ... {len(disk) - DISK_SHOWN} more" if len(disk) > DISK_SHOWN else ""))
    if exchange is not None:
        lines += ["", *_exchange.lines(exchange)]
    lines.append("")
    per = collections.defaultdict(lambda: {"running": 0, "waiting": 0, "longest": 0.0})
    for r in requests:
        row = per[r["adapter"]]
        if r["state"] == "running":
            row["running"] += 1
        else:
            row["waiting"] += 1
            row["longest"] = max(row["longest"], float(r.get("waited_s") or 0.0))
    shown = sorted(set(per) | {label for label, rate in rates.items() if rate > 0})
    lines.append(f"{'ADAPTER':<28} {'RUNNING':>7} {'WAITING':>7} {'LONGEST WAIT':>12} {'TOKENS/S':>9}")
    for label in shown:
        row = per[label]
        wait = f"{row['longest']:.1f} s" if row["waiting"] else "-"
        lines.append(f"{(label or '(base model)'):<28} {row['running']:>7} {row['waiting']:>7} {wait:>12} "
                     f"{rates.get(label, 0.0):>9.1f}")
    if not shown:
        lines.append("(no requests)")
    lines += ["", "TIER MOVES"]
    lines += [f"{time.strftime('%H:%M:%S', time.localtime(m['time']))}  {m['adapter']} {MOVES[m['kind']]}"
              + (f" ({m['reason']})" if m.get("reason") else "") for m in moves] or ["-"]
    return lines


class _Keys:
    """``q`` from a terminal in cbreak mode (restored on exit); nothing when stdin is not one."""

    def __init__(self) -> None:
        self.quit = asyncio.Event()
        self._saved = None

    def __enter__(self) -> _Keys:
        if sys.stdin.isatty():
            import termios
            import tty

            self._saved = termios.tcgetattr(sys.stdin)
            tty.setcbreak(sys.stdin)
            asyncio.get_running_loop().add_reader(sys.stdin, self._read)
        return self

    def _read(self) -> None:
        if os.read(sys.stdin.fileno(), 64).lower().count(b"q"):
            self.quit.set()

    def __exit__(self, *exc: object) -> None:
        if self._saved is not None:
            import termios

            asyncio.get_running_loop().remove_reader(sys.stdin)
            termios.tcsetattr(sys.stdin, termios.TCSADRAIN, self._saved)


async def _follow(client, moves: collections.deque) -> None:
    async for event in client.events():
        if event.get("kind") in MOVES:
            moves.append(event)


def frame(status: dict[str, Any], adapters: list[dict[str, Any]], rates: dict[str, float], kv: float | None,
          exchange: dict[str, Any], now: float) -> dict[str, Any]:
    """One refresh as data (``top --json``): what the screen shows, numbers unrounded."""
    cap, requests = status["capacity"], (status.get("admission") or {}).get("requests") or []
    held = {tier: sorted(a["name"] for a in adapters if a["tier"] == tier) for tier in ("device", "host")}
    return {"time": now, "kv_cache_used": kv,
            "requests": {"running": sum(r["state"] == "running" for r in requests),
                         "waiting": sum(r["state"] == "queued" for r in requests)},
            "tiers": {"device": {"used": cap["device_used"], "slots": cap["device_slots"], "adapters": held["device"]},
                      "host": {"used": cap["host_used"], "slots": cap["host_slots"], "adapters": held["host"]},
                      "disk": {"adapters": len(adapters)}},
            "tokens_per_s": rates, "exchange": exchange}


async def _watch(socket: str | None, home: str | None, interval: float, iterations: int,
                 as_json: bool = False) -> None:
    from loractl.client import Client

    live = sys.stdout.isatty() and not as_json
    moves: collections.deque = collections.deque(maxlen=8)
    async with Client(socket, home=home) as client, Client(socket, home=home) as events:
        await client.status()  # no daemon: the usual one-line error, before the screen is taken
        follower = asyncio.create_task(_follow(events, moves))
        # A rate needs two readings: the first frame (all that --iterations 1 prints) measures
        # from one taken a moment before it, not from nothing (it showed 0.0 tokens/s).
        text = await client.metrics()
        previous = (time.monotonic(), parse_metrics(text)[0], _exchange.counters(text))
        await asyncio.sleep(min(interval, 1.0))
        shown = 0
        with _Keys() as keys:
            if live:
                sys.stdout.write("\x1b[?25l")  # hide the cursor while redrawing
            try:
                while not keys.quit.is_set() and (not iterations or shown < iterations):
                    began = time.monotonic()
                    status, adapters, text = await asyncio.gather(client.status(), client.list(), client.metrics())
                    tokens, kv = parse_metrics(text)
                    counted = _exchange.counters(text)
                    elapsed = max(began - previous[0], 1e-6)
                    rates = {k: max(v - previous[1].get(k, 0.0), 0.0) / elapsed for k, v in tokens.items()}
                    exchange = _exchange.over(previous[2], counted, elapsed)
                    previous = (began, tokens, counted)
                    lines = render(status, adapters, rates, kv, moves, time.time(), exchange)
                    if as_json:
                        sys.stdout.write(json.dumps(frame(status, adapters, rates, kv, exchange, time.time()),
                                                    sort_keys=True) + "\n")
                    elif live:
                        sys.stdout.write("\x1b[H\x1b[2J" + "\n".join(lines) + "\n\n(q quits)")
                    else:
                        sys.stdout.write("\n".join(lines) + "\n\n")
                    sys.stdout.flush()
                    shown += 1
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(keys.quit.wait(), max(interval - (time.monotonic() - began), 0.05))
            finally:
                follower.cancel()
                await asyncio.gather(follower, return_exceptions=True)
                if live:
                    sys.stdout.write("\x1b[?25h\n")
                    sys.stdout.flush()


def top(
    socket: SocketOpt = None,
    home: HomeOpt = None,
    interval: Annotated[float, typer.Option("--interval", "-d", min=0.2,
                                            help="Seconds between refreshes.")] = 1.0,
    iterations: Annotated[int, typer.Option("--iterations", "-n", min=0,
                                            help="Stop after this many refreshes (0: until q or Ctrl-C).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Each refresh as one JSON object per line: requests, "
                                                         "tiers, tokens/s, exchange per tier and waits.")] = False,
) -> None:
    """Watch the daemon live: tiers, requests per adapter, tokens/s, tier moves, KV cache.

    Refreshed about once a second: each tier with its adapters and pins, requests running and
    waiting for a device slot per adapter (with the longest wait), tokens generated per second
    per adapter, the exchange between tiers (loads, bytes and evictions per second, disk to host
    and host to device) and how long requests waited for a slot or for their adapter's load,
    tier moves as they happen, and the share of the engine's KV cache in use.
    On a terminal press q to quit; in a pipe each refresh prints as plain text.

    Examples:

        loractl top

        loractl top --iterations 1 | grep WAITING      # one snapshot, in a script

        loractl top -d 5 -n 12 > top.log               # a minute, every 5 s

        loractl top --json -n 10 | jq .exchange.tiers   # loads and bytes per tier, 10 refreshes
    """
    with cli_errors():
        asyncio.run(_watch(socket, home, interval, iterations, as_json))


def register(app: typer.Typer) -> None:
    app.command("top")(top)
