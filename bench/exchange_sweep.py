"""The GPU's regime on a CPU (issue 58, item 4): loractl's admission policies against vLLM's
own OpenAI server where steps cost the same at any batch and an exchange costs a set fraction
of a step.

    .venv/bin/python bench/exchange_sweep.py --rounds 3 --out bench/results/exchange-sweep.json
    .venv/bin/python bench/exchange_sweep.py --cells 0.05:0.5,3:10 --streams 16 --rounds 1   # two cells, quick

Both systems load ``bench/cost_injector.py`` (a vLLM general plugin put on their path, nothing
installed): every step that runs the model is padded to ``--step-ms``; each copy of an adapter
into a device slot costs ``exchange × step`` more and each load from disk ``disk × step`` more,
inside the step, as the real ones are. A cell is one ``exchange:disk`` pair (``--cells``); each
cell starts one loractld and one server with those costs. loractld runs vLLM's own CPU LoRA ops
(``--no-cpu-fixes``, unless ``--cpu-fixes``), as the server does, so that the schedule is all
that differs. Its policies are switched on the one daemon between runs
(``loractl admission``'s RPC), so every policy meets the same engine.

Load: thrash_bench's, ``--adapters`` adapters (more than the host entries, more than the
slots), each request drawn Zipf(1.1), ``--streams`` closed-loop clients sharing ``--requests``
requests (``--requests-per-stream`` × streams) of ``--tokens`` tokens (``min_tokens`` too). Per round and load level every system
runs back to back, the order rotated. Figures per run: tokens/s, TTFT p50/p99, the exchanges
and disk loads the engine was charged for (counted by the plugin), for loractl the longest
gate wait. Ratios are each policy over the server, per round: median and range. With n rounds
the range covers the median ratio with probability 1 - 2^(1-n) (0.75 at 3, 0.94 at 5): the
confidence interval reported.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
import cost_injector  # noqa: E402
from serve_bench import cell  # noqa: E402
from thrash_bench import connect, launched  # noqa: E402

FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")


class Policy:
    """One admission policy of a running daemon: set by the runtime switch before each run."""

    def __init__(self, daemon, policy: str) -> None:
        self.daemon, self.name, self.policy = daemon, policy, policy

    async def prepare(self) -> None:
        view = await self.daemon.client.set_admission(self.policy)
        assert view["policy"] == self.policy, view

    async def request(self, adapter, tokens):
        return await self.daemon.request(adapter, tokens)


async def run_round(systems: list, args, log: Path, round_no: int) -> dict:
    out: dict = {s.name: {} for s in systems}
    for level, streams in enumerate(args.streams):
        if args.requests_per_stream:
            args.requests = args.requests_per_stream * streams   # every load level runs about as long
        turn = (round_no + level) % len(systems)
        for system in systems[turn:] + systems[:turn]:
            if isinstance(system, Policy):
                await system.prepare()
                system.daemon.take_longest_wait()
            before = cost_injector.counts(log)
            result = await cell(system, "zipf", streams, args, seed=1000 + streams)
            if isinstance(system, Policy):
                await asyncio.sleep(0.3)   # the last WAITED_FOR_SLOT event reaches the watcher
                result["longest_gate_wait_ms"] = round(system.daemon.take_longest_wait() * 1000, 1)
                gate = (await system.daemon.client.status())["admission"]
                result["gate_mode_after"] = f"{gate['mode']}: {gate['mode_reason']}"
            after = cost_injector.counts(log)
            result.update({f"{k}s_charged": after[k] - before[k] for k in after})
            out[system.name][f"zipf@{streams}"] = result
            print(f"round {round_no} {system.name:11s} zipf@{streams}: {result}", file=sys.stderr, flush=True)
    return out


def ratios(rounds: list[dict], system: str) -> dict:
    out = {}
    for key in rounds[0][system]:
        out[key] = {f: _setup.spread([r[system][key][f] / r["server"][key][f] for r in rounds
                                      if r["server"][key][f]]) for f in FIGURES}
    return out


def goal(exchange: float, figures: dict) -> str:
    """The issue's bar: cheap exchange, at par with the server; costly, well ahead of it."""
    tps, p99 = figures["tokens_per_s"]["median"], figures["ttft_p99_ms"]["median"]
    if exchange < 1:
        return "met" if tps >= 0.95 and p99 <= 1.05 else "missed"
    return "met" if tps >= 1.5 and p99 <= 0.5 else "missed"


def markdown(cells: list[dict], policies: list[str]) -> str:
    def fmt(v: dict) -> str:
        return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"

    lines = ["| exchange / step | disk / step | load | policy | tok/s ×server | TTFT p50 ×server | TTFT p99 ×server "
             "| p99 ms policy / server | exchanges policy / server | goal |", "|---|---|---|---|---|---|---|---|---|---|"]
    for c in cells:
        for policy in policies:
            for key, figures in c["ratios"][policy].items():
                med = {s: {f: statistics.median(r[s][key][f] for r in c["rounds"])
                           for f in ("ttft_p99_ms", "exchanges_charged")} for s in (policy, "server")}
                lines.append(f"| {c['exchange']} | {c['disk']} | {key} | {policy} | {fmt(figures['tokens_per_s'])} | "
                             f"{fmt(figures['ttft_p50_ms'])} | {fmt(figures['ttft_p99_ms'])} | "
                             f"{med[policy]['ttft_p99_ms']:.0f} / {med['server']['ttft_p99_ms']:.0f} | "
                             f"{med[policy]['exchanges_charged']:.0f} / {med['server']['exchanges_charged']:.0f} | "
                             f"{goal(c['exchange'], figures)} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=8)
    p.set_defaults(max_cpu_loras=4)
    p.add_argument("--step-ms", type=float, default=15.0, help="every step padded to this (above the CPU's own)")
    p.add_argument("--cells", default="0.05:0.5,0.3:0.5,1:0.5,3:0.5,0.3:3,0.3:10",
                   help="exchange:disk pairs, each a multiple of the step")
    p.add_argument("--policies", default="passthrough,measured,auto")
    p.add_argument("--cpu-fixes", action="store_true", help="loractl's CPU LoRA ops (default: vLLM's own, as the server)")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streams", default="4,16")
    p.add_argument("--requests", type=int, default=192, help="requests per run")
    p.add_argument("--requests-per-stream", type=int, default=12, help="requests per run: this x streams (0: --requests)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.max_num_seqs, args.max_wait = None, None   # launched's settings: vLLM's own, the policy's own
    policies = args.policies.split(",")
    work = _setup.workdir(args.workdir)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/a{i}" for i in range(len(paths))]
    daemon_system = "measured" + ("" if args.cpu_fixes else "+no-cpu-fixes")

    cells = []
    for index, pair in enumerate(args.cells.split(",")):
        exchange, disk = (float(x) for x in pair.split(":"))
        log = work / f"cost-log-{index}"
        os.environ.update(cost_injector.environment(work / "cost-plugin", step_ms=args.step_ms,
                                                    exchange_ms=exchange * args.step_ms, disk_ms=disk * args.step_ms,
                                                    log=log))
        began = time.perf_counter()
        with launched(model, names, paths, args, work, [daemon_system, "server"]) as (daemons, server):
            async def go() -> list[dict]:
                systems = await connect(daemons, server, model, names, paths)
                daemon, server_system = systems
                drive = [Policy(daemon, policy) for policy in policies] + [server_system]
                try:
                    return [await run_round(drive, args, log, i) for i in range(args.rounds)]
                finally:
                    for s in systems:
                        await s.close()

            rounds = asyncio.run(go())
        c = {"exchange": exchange, "disk": disk, "exchange_ms": exchange * args.step_ms,
             "disk_ms": disk * args.step_ms, "wall_s": round(time.perf_counter() - began, 1), "rounds": rounds}
        c["ratios"] = {policy: ratios(rounds, policy) for policy in policies}
        cells.append(c)
        print(markdown([c], policies), file=sys.stderr, flush=True)
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
              "settings": {k: getattr(args, k) for k in ("device", "rank", "adapters", "max_loras", "max_cpu_loras",
                                                         "max_model_len", "tokens", "streams", "requests_per_stream", "rounds",
                                                         "step_ms", "cpu_fixes")},
              "cells": cells, "markdown": markdown(cells, policies)}
    print(report["markdown"], file=sys.stderr)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
