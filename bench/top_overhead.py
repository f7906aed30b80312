"""What ``loractl top`` costs the request path: tokens/s with and without it attached.

    .venv/bin/python bench/top_overhead.py --rounds 4 --out bench/results/top-overhead.json

One daemon (tiny model, CPU) with ``--adapters`` adapters pulled; a closed-loop load of
``--streams`` clients over them (round-robin, ``--tokens`` tokens each, ``min_tokens`` too, so
every request does the same work) runs for ``--seconds`` per cell. Cells alternate, in an order
that flips every round: ``none`` (nothing attached), ``top`` (``loractl top`` in a pipe at its
default one-second refresh) and ``top-fast`` (``--interval 0.2``, its fastest, five times the
polling). Reported per cell: tokens/s, TTFT p50/p99, and the CPU seconds the daemon process
(not its engine core) and the ``top`` process spent per second of the cell; per round, the ratio
of each ``top`` cell's tokens/s to the ``none`` cells beside it; the report gives the median and
spread of those ratios over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402

MESSAGES = [{"role": "user", "content": "Write a query that lists every customer."}]


def cpu_seconds(pid: int) -> float:
    """utime + stime of one process (its threads included, its children not)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def load(socket: Path, names: list[str], streams: int, tokens: int, seconds: float) -> dict:
    from loractl import Client

    ttfts: list[float] = []
    produced = 0
    deadline = time.perf_counter() + seconds
    counter = iter(range(10**9))

    async def client_loop(client) -> None:
        nonlocal produced
        while time.perf_counter() < deadline:
            name = names[next(counter) % len(names)]
            began, first = time.perf_counter(), None
            async for chunk in client.generate(messages=MESSAGES, lora=name, max_tokens=tokens, min_tokens=tokens,
                                               temperature=0.0):
                if chunk.token_ids:
                    first = first or time.perf_counter()
                    produced += len(chunk.token_ids)
            ttfts.append((first or time.perf_counter()) - began)

    async with Client(socket) as client:
        began = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(streams)))
        wall = time.perf_counter() - began
    return {"tokens_per_s": produced / wall, "requests": len(ttfts), "wall_s": wall,
            "ttft_p50_s": _setup.percentile(ttfts, 0.5), "ttft_p99_s": _setup.percentile(ttfts, 0.99)}


def cell(kind: str, daemon: _setup.Daemon, names: list[str], args) -> dict:
    top, shown = None, []
    if kind != "none":
        interval = ["--interval", "0.2"] if kind == "top-fast" else []
        top = subprocess.Popen([str(_setup.BIN / "loractl"), "top", "--socket", str(daemon.socket), *interval],
                               stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL)
        # a reader that keeps up, as a terminal would; what it read shows top really refreshed
        threading.Thread(target=lambda: shown.append(top.stdout.read()), daemon=True).start()
        time.sleep(1.5)  # attached and refreshing before the load starts
    time.sleep(0.4)  # the engine's OpenMP threads spin for a while after the last step
    daemon_cpu, top_cpu = cpu_seconds(daemon.proc.pid), cpu_seconds(top.pid) if top else 0.0
    result = asyncio.run(load(daemon.socket, names, args.streams, args.tokens, args.seconds))
    result["daemon_cpu_per_s"] = (cpu_seconds(daemon.proc.pid) - daemon_cpu) / result["wall_s"]
    if top:
        result["top_cpu_per_s"] = (cpu_seconds(top.pid) - top_cpu) / result["wall_s"]
        top.terminate()
        top.wait(30)
        for _ in range(100):
            if shown:
                break
            time.sleep(0.05)
        result["top_refreshes"] = shown[0].count(b"loractl top - ") if shown else 0
    result["cell"] = kind
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=4)
    p.add_argument("--streams", type=int, default=16)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--seconds", type=float, default=20.0)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    work = _setup.workdir(args.work)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/{i}" for i in range(len(paths))]
    home = work / "home"
    home.mkdir(exist_ok=True)
    daemon = _setup.Daemon(model, args, home)
    try:
        async def pull() -> None:
            from loractl import Client

            async with Client(daemon.socket) as c:
                for name, path in zip(names, paths):
                    async for _ in c.pull(str(path), name=name):
                        pass
        asyncio.run(pull())
        cell("none", daemon, names, argparse.Namespace(**{**vars(args), "seconds": min(5.0, args.seconds)}))  # warm-up, not reported
        rounds = []
        for i in range(args.rounds):
            order = ["none", "top", "none", "top-fast", "none"] if i % 2 == 0 else ["none", "top-fast", "none", "top", "none"]
            cells = [cell(kind, daemon, names, args) for kind in order]
            ratios = {}
            for j, c in enumerate(cells):
                if c["cell"] != "none":
                    beside = statistics.mean([cells[j - 1]["tokens_per_s"], cells[j + 1]["tokens_per_s"]])
                    ratios[c["cell"]] = c["tokens_per_s"] / beside
            rounds.append({"cells": cells, "tokens_per_s_ratio": ratios, "load_average": os.getloadavg()})
            print(f"round {i}: {ratios}", file=sys.stderr)
    finally:
        daemon.stop()
    summary = {kind: {"median": statistics.median(r["tokens_per_s_ratio"][kind] for r in rounds),
                      "min": min(r["tokens_per_s_ratio"][kind] for r in rounds),
                      "max": max(r["tokens_per_s_ratio"][kind] for r in rounds)} for kind in ("top", "top-fast")}
    for kind in ("none", "top", "top-fast"):
        cells = [c for r in rounds for c in r["cells"] if c["cell"] == kind]
        summary[f"{kind}_daemon_cpu_per_s"] = statistics.median(c["daemon_cpu_per_s"] for c in cells)
        if kind != "none":
            summary[f"{kind}_top_cpu_per_s"] = statistics.median(c["top_cpu_per_s"] for c in cells)
    _setup.write({"machine": _setup.machine(), "versions": _setup.versions(), "args": vars(args),
                  "summary": summary, "rounds": rounds}, args.out)


if __name__ == "__main__":
    main()
