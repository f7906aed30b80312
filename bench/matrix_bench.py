"""The benchmark matrix: loractl's admission policies against vLLM's own OpenAI server, over
adapters, host entries, device slots, clients, output length, Zipf exponent, arrival and CPU
contention.

    .venv/bin/python bench/matrix_bench.py --rounds 3 --out bench/results/matrix-cpu.json
    .venv/bin/python bench/matrix_bench.py --quick            # the CI subset: 2 cells, 1 round

A full factorial is too slow on two cores, so the matrix is a centre point and one axis varied
at a time (``CELLS``). The centre: 8 adapters (tiny model, rank 16), ``max_loras`` 2,
``max_cpu_loras`` 4, 16 closed-loop clients sharing ``--requests`` requests of 16 tokens
(``min_tokens`` too), each naming an adapter drawn Zipf(1.0), the same sequence for every
system. Axes: adapters 4 / 16 (of the 16 generated and known to every system; a cell draws
over the first N), ``max_cpu_loras`` 3 (``max_loras``+1) / 8 / 16 (2 x adapters), ``max_loras``
4 (with ``max_cpu_loras`` 5: vLLM needs host entries >= slots), clients 4 / 64, 128-token
outputs, Zipf 0.6 / 1.4, open-loop arrival (Poisson, ``--rate`` requests/s, requests launched
at their times whatever is still running), and a CPU-bound job: a second Python process
spinning ``while True: pass`` pinned with ``os.sched_setaffinity`` to one core, started before
a cell's three runs and killed after them. vLLM's CPU worker binds its OpenMP thread to core 0
on two cores (``VLLM_CPU_OMP_THREADS_BIND=auto``), every engine here alike; the API processes
float. ``cpu-job@core0`` pins the job to the engines' core, ``cpu-job@core1`` to the other.

Cells are grouped by engine configuration (``max_loras``, ``max_cpu_loras``): per group the two
daemons (``--admission measured``, the default, and ``first-come``; ``--systems`` for others) and the server
(``python -m vllm.entrypoints.openai.api_server``, same engine and LoRA flags) start once, side
by side, and stop after. Per round and cell the three systems run back to back (the others
idle), the order rotated per cell and round; the load average (``os.getloadavg``, what
``uptime`` prints) is recorded before and after. Figures per run: tokens/s over the run's wall
time, TTFT p50/p99/max. Ratios: policy / server per round, reported as median and range.

A cell *loses* when every round's ratio is on the wrong side of parity (tokens/s below the
server's, or TTFT p99 above it): the rounds' own spread is the noise.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
from serve_bench import Sample, adapter_sequence, figures, settle  # noqa: E402
from thrash_bench import POLICIES, PolicySystem, connect, launched  # noqa: E402

SYSTEMS = (*POLICIES, "server")
RATIO_FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms")
CENTRE = {"adapters": 8, "max_loras": 2, "max_cpu_loras": 4, "clients": 16, "tokens": 16, "zipf": 1.0,
          "arrival": "closed", "cpu_job": None, "omp_threads": None}
# One axis at a time from the centre: (cell name, what differs from the centre).
CELLS = [
    ("centre", {}),
    ("adapters=4", {"adapters": 4}),
    ("adapters=16", {"adapters": 16}),
    ("host=3", {"max_cpu_loras": 3}),
    ("host=8", {"max_cpu_loras": 8}),
    ("host=16", {"max_cpu_loras": 16}),
    ("slots=4", {"max_loras": 4, "max_cpu_loras": 5}),
    ("clients=4", {"clients": 4}),
    ("clients=64", {"clients": 64}),
    ("tokens=128", {"tokens": 128}),
    ("zipf=0.6", {"zipf": 0.6}),
    ("zipf=1.4", {"zipf": 1.4}),
    ("open-loop", {"arrival": "open"}),
    ("cpu-job@core0", {"cpu_job": 0}),
    ("cpu-job@core1", {"cpu_job": 1}),
    ("cpu-job@core0+clients=4", {"cpu_job": 0, "clients": 4}),
    ("cpu-job@core0+clients=64", {"cpu_job": 0, "clients": 64}),
    ("omp=1", {"omp_threads": 1}),
    ("omp=1+cpu-job@core0", {"omp_threads": 1, "cpu_job": 0}),
]
QUICK_CENTRE = {**CENTRE, "adapters": 4, "max_cpu_loras": 3, "clients": 8, "tokens": 8}
QUICK_CELLS = [("quick-closed", {}), ("quick-open", {"arrival": "open"})]
BUSY_LOOP = "import os, sys\nos.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True:\n    pass\n"


def specs(args) -> list[dict]:
    """Every cell's full settings, its request count and its engine configuration."""
    centre, cells = (QUICK_CENTRE, QUICK_CELLS) if args.quick else (CENTRE, CELLS)
    wanted = set(args.cells.split(",")) if args.cells else None
    out = []
    for name, change in cells:
        if wanted is not None and name not in wanted:
            continue
        spec = {"name": name, "varies": change, **centre, **change}
        if spec["arrival"] == "open":
            spec["rate"] = args.rate
        # Long outputs: fewer requests (a third of the centre's, at least 2 per client).
        base = args.requests if spec["tokens"] <= 32 else args.requests // 3
        spec["requests"] = max(base, 2 * spec["clients"])
        spec["timeout_s"] = args.run_timeout
        out.append(spec)
    if wanted is not None and len(out) != len(wanted):
        raise SystemExit(f"unknown cells: {sorted(wanted - {s['name'] for s in out})}")
    return out


def configurations(cells: list[dict]) -> dict[tuple, list[dict]]:
    """Cells grouped by what the engines are started with: slots, host entries, OMP threads."""
    groups: dict[tuple, list[dict]] = {}
    for spec in cells:
        groups.setdefault((spec["max_loras"], spec["max_cpu_loras"], spec["omp_threads"]), []).append(spec)
    return groups


@contextlib.contextmanager
def omp_threads(threads: int | None):
    """``OMP_NUM_THREADS`` for the engines started inside (inherited by every system)."""
    before = os.environ.get("OMP_NUM_THREADS")
    if threads is not None:
        os.environ["OMP_NUM_THREADS"] = str(threads)
    try:
        yield
    finally:
        if before is None:
            os.environ.pop("OMP_NUM_THREADS", None)
        else:
            os.environ["OMP_NUM_THREADS"] = before


async def run(system, spec: dict, seed: int) -> dict:
    """One system through one cell's load: closed loop (``clients`` workers sharing a queue)
    or open loop (each request launched at its Poisson arrival time)."""
    await settle()
    sequence = adapter_sequence("zipf", spec["requests"], spec["adapters"], seed, spec["zipf"])
    samples: list[Sample] = []
    began = time.perf_counter()
    if spec["arrival"] == "closed":
        queue = list(reversed(sequence))

        async def client() -> None:
            while queue:
                samples.append(await system.request(queue.pop(), spec["tokens"]))

        load = asyncio.gather(*(client() for _ in range(spec["clients"])))
    else:
        arrivals = random.Random(seed + 1)
        at, times = 0.0, []
        for _ in sequence:
            at += arrivals.expovariate(spec["rate"])
            times.append(at)

        async def arrive(when: float, adapter: int) -> None:
            await asyncio.sleep(max(0.0, when - (time.perf_counter() - began)))
            samples.append(await system.request(adapter, spec["tokens"]))

        load = asyncio.gather(*(arrive(when, adapter) for when, adapter in zip(times, sequence)))
    try:
        await asyncio.wait_for(load, spec["timeout_s"])
    except asyncio.TimeoutError:
        # Cut short (a collapsed system would hold the matrix for minutes): the figures are
        # those of the requests that finished, tokens/s over the time allowed.
        wall = time.perf_counter() - began
        await asyncio.sleep(2.0)  # what was cancelled leaves the engine
        if not samples:
            return {"requests": 0, "tokens_per_s": 0.0, "timed_out": True, "unfinished": spec["requests"],
                    "wall_s": round(wall, 3), **{f: None for f in ("ttft_p50_ms", "ttft_p99_ms", "ttft_p999_ms", "ttft_max_ms")}}
        return {**figures(samples, wall), "timed_out": True, "unfinished": spec["requests"] - len(samples)}
    return figures(samples, time.perf_counter() - began)


def start_cpu_job(core: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(core)])


def stop_cpu_job(job: subprocess.Popen) -> None:
    job.kill()
    job.wait()


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


async def run_configuration(systems: list, cells: list[dict], args, results: dict, seed: int | None = None) -> None:
    """Per round and cell, every system back to back, the order rotated; the request sequence is
    drawn from ``seed`` (default 1000 + the cell's index), the same every round."""
    for round_no in range(args.rounds):
        for index, spec in enumerate(cells):
            turn = (round_no + index) % len(systems)
            order = systems[turn:] + systems[:turn]
            job = start_cpu_job(spec["cpu_job"]) if spec["cpu_job"] is not None else None
            try:
                if job is not None:
                    await asyncio.sleep(1.0)  # the job is spinning before the first system runs
                entry = {"round": round_no, "order": [s.name for s in order], "load_average_before": load_average()}
                for system in order:
                    result = await run(system, spec, seed=1000 + index if seed is None else seed)
                    if isinstance(system, PolicySystem):
                        await asyncio.sleep(0.3)  # the last WAITED_FOR_SLOT event reaches the watcher
                        result["longest_gate_wait_ms"] = round(system.take_longest_wait() * 1000, 1)
                        gate = (await system.client.status())["admission"]   # what the rule decided from
                        result["gate_ms"] = {name: round(float(gate.get(k, 0.0)) * 1000, 1) for name, k in (
                            ("bound", "max_wait_s"), ("handover", "handover_s"), ("service", "service_s"))}
                    entry[system.name] = result
                    print(f"round {round_no} {spec['name']:26s} {system.name:10s} {result}", file=sys.stderr,
                          flush=True)
                entry["load_average_after"] = load_average()
            finally:
                if job is not None:
                    stop_cpu_job(job)
            results[spec["name"]]["rounds"].append(entry)


def ratios(rounds: list[dict], system: str, baseline: str = "server", figures=RATIO_FIGURES) -> dict:
    out = {}
    for figure in figures:
        values = [r[system][figure] / r[baseline][figure] for r in rounds
                  if r[baseline][figure] and r[system][figure] is not None]
        if values:
            out[figure] = _setup.spread(values)
    return out


def verdict(r: dict) -> list[str]:
    """Where the policy loses to the server beyond the rounds' spread, and where it only
    leans that way (median on the wrong side, range across parity)."""
    out = []
    tps, p99 = r.get("tokens_per_s"), r.get("ttft_p99_ms")
    if tps and tps["max"] < 1:
        out.append("LOSES tok/s")
    elif tps and tps["median"] < 1:
        out.append("tok/s < 1 within noise")
    if p99 and p99["min"] > 1:
        out.append("LOSES p99")
    elif p99 and p99["median"] > 1:
        out.append("p99 > 1 within noise")
    return out


def summarise(results: dict) -> None:
    for entry in results.values():
        rounds = entry["rounds"]
        if not rounds:
            continue
        entry["ratios"] = {policy: ratios(rounds, policy) for policy in POLICIES if all(policy in r for r in rounds)}
        entry["medians"] = {s: {f: statistics.median(r[s][f] for r in rounds if r[s][f] is not None)
                                for f in (*RATIO_FIGURES, "ttft_max_ms") if any(r[s][f] is not None for r in rounds)}
                            for s in SYSTEMS if all(s in r for r in rounds)}
        entry["timed_out"] = sorted({s for r in rounds for s in SYSTEMS if r.get(s, {}).get("timed_out")})
        entry["load_average_1min"] = [r["load_average_before"][0] for r in rounds]
        entry["verdict"] = {policy: verdict(r) for policy, r in entry["ratios"].items()}


def markdown(results: dict) -> str:
    def fmt(r: dict, figure: str) -> str:
        v = r.get(figure)
        return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else "—"

    ran = {p for e in results.values() for p in e.get("ratios", {})}
    lead = next((p for p in ("measured", "batching") if p in ran), "batching")   # the default, where it ran
    every = " / ".join(SYSTEMS)   # the absolute columns list every system, "—" where one did not run
    lines = [f"| cell | {lead} tok/s ×server | {lead} TTFT p50 ×server | {lead} TTFT p99 ×server | "
             f"first-come tok/s ×server | first-come TTFT p99 ×server | tok/s {every} | "
             f"TTFT p99 ms {every} | load avg (1 min) | {lead} loses? |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        if lead not in entry.get("ratios", {}) or "server" not in entry.get("medians", {}):
            continue
        b, f, m = entry["ratios"][lead], entry["ratios"].get("first-come", {}), entry["medians"]
        absolute = " / ".join(f"{m[s]['tokens_per_s']:.0f}" if s in m else "—" for s in SYSTEMS)
        p99 = " / ".join(f"{m[s]['ttft_p99_ms']:.0f}" if "ttft_p99_ms" in m.get(s, {}) else "—" for s in SYSTEMS)
        loads = entry["load_average_1min"]
        load = f"{min(loads):.1f}–{max(loads):.1f}" if len(loads) > 1 else f"{loads[0]:.1f}"
        lose = ", ".join(entry["verdict"][lead]) or "no"
        if entry["timed_out"]:
            lose += f" (cut short at {entry['spec']['timeout_s']:.0f} s: {', '.join(entry['timed_out'])})"
        lines.append(f"| {name} | {fmt(b, 'tokens_per_s')} | {fmt(b, 'ttft_p50_ms')} | {fmt(b, 'ttft_p99_ms')} | "
                     f"{fmt(f, 'tokens_per_s')} | {fmt(f, 'ttft_p99_ms')} | {absolute} | {p99} | {load} | {lose} |")
    adaptive = [(name, e) for name, e in results.items() if "adaptive" in e.get("ratios", {})]
    if adaptive:
        lines += ["", "| cell | adaptive tok/s ×server | adaptive TTFT p50 ×server | adaptive TTFT p99 ×server | "
                      "adaptive loses? |", "|---|---|---|---|---|"]
        for name, entry in adaptive:
            a = entry["ratios"]["adaptive"]
            lines.append(f"| {name} | {fmt(a, 'tokens_per_s')} | {fmt(a, 'ttft_p50_ms')} | {fmt(a, 'ttft_p99_ms')} | "
                         f"{', '.join(entry['verdict']['adaptive']) or 'no'} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=16)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own")
    p.add_argument("--max-wait", type=float, default=None, help="--admission-max-wait for the batching and adaptive daemons")
    p.add_argument("--requests", type=int, default=96, help="requests per cell of short outputs (a third for long)")
    p.add_argument("--rate", type=float, default=20.0, help="open-loop arrival rate, requests/s")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=30.0,
                   help="seconds one system may take over one cell; after it the run is cut short and marked")
    p.add_argument("--cells", default=None, help="comma-separated cell names (default: all)")
    p.add_argument("--systems", default="measured,first-come,server",
                   help=f"of {','.join(SYSTEMS)} (adaptive: loractld --admission adaptive)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds: start no engine configuration after this much wall time (its cells: skipped)")
    p.add_argument("--quick", action="store_true", help="the CI subset: 2 cells of one configuration, 1 round")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    if args.quick:
        args.rounds, args.requests = 1, min(args.requests, 24)
    cells = specs(args)
    wanted = args.systems.split(",")
    args.adapters = max(args.adapters, *(spec["adapters"] for spec in cells))
    work = _setup.workdir(args.workdir)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/a{i}" for i in range(len(paths))]
    results = {spec["name"]: {"spec": spec, "rounds": []} for spec in cells}
    began = time.monotonic()
    for (max_loras, max_cpu_loras, threads), group in configurations(cells).items():
        if args.budget and time.monotonic() - began > args.budget:
            print(f"over the {args.budget:.0f} s budget: skipping {[s['name'] for s in group]}", file=sys.stderr)
            for spec in group:
                results[spec["name"]]["skipped"] = "over the time budget"
            continue
        config = argparse.Namespace(**{**vars(args), "max_loras": max_loras, "max_cpu_loras": max_cpu_loras})
        print(f"configuration max_loras={max_loras} max_cpu_loras={max_cpu_loras} omp_threads={threads}: "
              f"{[s['name'] for s in group]} ({time.monotonic() - began:.0f} s in)", file=sys.stderr, flush=True)
        home = work / f"l{max_loras}-h{max_cpu_loras}-t{threads or 0}"
        home.mkdir(parents=True, exist_ok=True)
        with omp_threads(threads), launched(model, names, paths, config, home, wanted) as (daemons, server):
            async def go() -> None:
                systems = await connect(daemons, server, model, names, paths)
                try:
                    await run_configuration(systems, group, args, results)
                finally:
                    for s in systems:
                        await s.close()

            asyncio.run(go())
    summarise(results)
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
              "settings": {k: getattr(args, k) for k in ("device", "rank", "adapters", "max_model_len", "max_num_seqs",
                                                         "kv_cache", "requests", "rate", "max_wait", "rounds", "quick",
                                                         "budget", "run_timeout")},
              "centre": QUICK_CENTRE if args.quick else CENTRE, "wall_s": round(time.monotonic() - began, 1),
              "cells": results}
    report["markdown"] = markdown(results)
    print(report["markdown"], file=sys.stderr)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
