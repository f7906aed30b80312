"""The drawn matrix: loractl's admission policies against vLLM's own OpenAI server on shapes
drawn at random from wide ranges, not chosen (issue 40), plus the held-out shapes the issue
measured. Seeds are fixed here and were written down (docs/benchmarks.md) before the
hand-over rule was changed.

    .venv/bin/python bench/drawn_matrix.py --print-shapes          # the shapes, no engine
    .venv/bin/python bench/drawn_matrix.py --rounds 3 --out bench/results/drawn-cpu.json
    .venv/bin/python bench/drawn_matrix.py --model tiny-random --shapes held-out-2,held-out-3 --systems measured,server

``--model tiny-random``: ``bench/make_model.py --shape tiny`` (the demo model's shapes, random
weights of its own, stored in bfloat16, served in float32 as the demo model is), built once in
the work folder: the "two-layer random model" of issue 48, item 5 (docs/benchmarks.md, "The
tail on fast steps").

Draws (``DRAW_SEED``, ``DRAWN`` shapes, in this order from one ``random.Random``):
adapters uniform 3-32; device slots (``max_loras``) uniform 1-4; host entries
(``max_cpu_loras``) uniform from the slots to max(slots, adapters) (vLLM needs at least the
slots); clients log-uniform 4-64; Zipf exponent uniform 0.5-1.5; answer length log-uniform
16-256 tokens (``min_tokens`` too: every request does the same work); arrival open or closed
with even odds. Open loop: Poisson arrivals at a rate drawn uniform 0.4-1.0 of 600 tokens/s
(about the slower system's throughput here) divided by the answer length. Requests per shape:
6000 tokens' worth, at least 24 and at least one per client, at most 160.

Each shape is its own engine configuration: the systems start side by side (thrash_bench's
``launched``), then per round each runs the shape's load back to back, the order rotated per
shape and round (matrix_bench's ``run_configuration``), the same request sequence for all.
Figures per run: tokens/s over the run's wall time, TTFT p50, p99, p99.9 and max (with fewer
than 1000 requests p99.9 is the largest or second-largest TTFT: reported, read as such).
Ratios: each policy over the server, per round; median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
from matrix_bench import ratios, run_configuration  # noqa: E402
from thrash_bench import connect, launched  # noqa: E402

DRAW_SEED = 4040
DRAWN = 10
TOKEN_BUDGET = 6000          # tokens per run: 6-20 s of one system on this CPU
OPEN_LOOP_TOKENS_PER_S = 600
# The issue's held-out shapes (max_loras 2, 32-token answers, closed loop), never tuned on.
HELD_OUT = [
    ("held-out-1", {"adapters": 1, "max_loras": 2, "max_cpu_loras": 3, "clients": 32, "requests": 96,
                    "zipf": 1.0}),
    ("held-out-2", {"adapters": 6, "max_loras": 2, "max_cpu_loras": 3, "clients": 16, "requests": 16 * 12,
                    "zipf": 1.1}),
    ("held-out-3", {"adapters": 10, "max_loras": 2, "max_cpu_loras": 4, "clients": 24, "requests": 24 * 8,
                    "zipf": 0.8}),
]
# Shapes the rule was chosen on (not drawn, not held out): run with --shapes train-a,train-b.
TRAIN = [
    ("train-a", {"adapters": 12, "max_loras": 2, "max_cpu_loras": 4, "clients": 24, "requests": 144, "zipf": 0.9,
                 "tokens": 48, "arrival": "closed"}),
    ("train-b", {"adapters": 8, "max_loras": 1, "max_cpu_loras": 3, "clients": 16, "requests": 160, "zipf": 1.2,
                 "tokens": 32, "arrival": "closed"}),
    ("train-c", {"adapters": 5, "max_loras": 2, "max_cpu_loras": 3, "clients": 12, "requests": 192, "zipf": 1.2,
                 "tokens": 32, "arrival": "closed"}),
    ("train-d", {"adapters": 4, "max_loras": 2, "max_cpu_loras": 4, "clients": 16, "requests": 160, "zipf": 0.7,
                 "tokens": 24, "arrival": "closed"}),
    ("train-e", {"adapters": 10, "max_loras": 4, "max_cpu_loras": 6, "clients": 32, "requests": 128, "zipf": 1.0,
                 "tokens": 64, "arrival": "closed"}),
    ("train-f", {"adapters": 8, "max_loras": 3, "max_cpu_loras": 4, "clients": 24, "requests": 150, "zipf": 0.8,
                 "tokens": 40, "arrival": "closed"}),
]
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_p999_ms")


def tiny_random(work: Path) -> Path:
    """``bench/make_model.py --shape tiny`` in ``work`` (built once; its weights are seeded)."""
    folder = work / "tiny-random"
    if not (folder / "config.json").exists():
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_model.py")), "--shape", "tiny",
                        "--out", str(folder)], check=True, stdout=subprocess.DEVNULL)
    return folder


def log_uniform(rng: random.Random, low: float, high: float) -> float:
    return math.exp(rng.uniform(math.log(low), math.log(high)))


def drawn_shapes(seed: int = DRAW_SEED, count: int = DRAWN) -> list[dict]:
    rng = random.Random(seed)
    shapes = []
    for i in range(count):
        adapters = rng.randint(3, 32)
        slots = rng.randint(1, 4)
        host = rng.randint(slots, max(slots, adapters))
        clients = round(log_uniform(rng, 4, 64))
        zipf = round(rng.uniform(0.5, 1.5), 2)
        tokens = round(log_uniform(rng, 16, 256))
        arrival = rng.choice(("open", "closed"))
        rate = round(rng.uniform(0.4, 1.0) * OPEN_LOOP_TOKENS_PER_S / tokens, 2)
        shape = {"adapters": adapters, "max_loras": slots, "max_cpu_loras": host, "clients": clients, "zipf": zipf,
                 "tokens": tokens, "arrival": arrival}
        if arrival == "open":
            shape["rate"] = rate
        shape["requests"] = min(160, max(24, clients, TOKEN_BUDGET // tokens))
        shapes.append((f"drawn-{i}", shape))
    return shapes


def specs(args) -> list[dict]:
    out = []
    held = [(n, {"tokens": 32, "arrival": "closed", **s}) for n, s in HELD_OUT]
    every = drawn_shapes(args.draw_seed, args.drawn) + held
    if args.shapes and "train" in args.shapes:
        every += TRAIN
    for index, (name, shape) in enumerate(every):
        if args.shapes and name not in args.shapes.split(","):
            continue
        out.append({"name": name, "index": index, "cpu_job": None, "omp_threads": None, **shape,
                    "timeout_s": args.run_timeout})
    return out


def goal(spec: dict, r: dict) -> str:
    """The issue's goal for this shape, on the medians: met, or what misses."""
    tps, p99 = r["tokens_per_s"]["median"], r["ttft_p99_ms"]["median"]
    thrash = spec["adapters"] > spec["max_loras"]
    want_tps, want_p99 = (1.2, 0.5) if thrash else (1.0, 1.0)
    misses = []
    if tps < want_tps:
        misses.append(f"tok/s {tps:.2f} < {want_tps}")
    if p99 > want_p99:
        misses.append(f"p99 {p99:.2f} > {want_p99}")
    return "met" if not misses else "MISSES " + ", ".join(misses)


def markdown(results: dict, policies: list[str]) -> str:
    def fmt(v: dict | None) -> str:
        return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else "—"

    lines = ["| shape | adapters / slots / host | clients | Zipf | tokens | arrival | policy | tok/s ×server | "
             "TTFT p99 ×server | TTFT p99.9 ×server | p99 ms policy / server | goal |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        s = entry["spec"]
        arrival = f"open {s['rate']}/s" if s["arrival"] == "open" else "closed"
        for policy in policies:
            r = entry.get("ratios", {}).get(policy)
            if not r or "tokens_per_s" not in r or "ttft_p99_ms" not in r:
                continue
            m = entry["medians"]
            lines.append(f"| {name} | {s['adapters']} / {s['max_loras']} / {s['max_cpu_loras']} | {s['clients']} | "
                         f"{s['zipf']} | {s['tokens']} | {arrival} | {policy} | {fmt(r['tokens_per_s'])} | "
                         f"{fmt(r['ttft_p99_ms'])} | {fmt(r.get('ttft_p999_ms'))} | "
                         f"{m[policy]['ttft_p99_ms']:.0f} / {m['server']['ttft_p99_ms']:.0f} | {goal(s, r)} |")
    return "\n".join(lines)


def summarise(results: dict) -> None:
    import statistics

    for entry in results.values():
        rounds = entry["rounds"]
        if not rounds or not all("server" in r for r in rounds):
            continue
        systems = [s for s in rounds[0] if isinstance(rounds[0][s], dict)]
        entry["ratios"] = {p: ratios(rounds, p, figures=FIGURES) for p in systems
                           if p != "server" and all(p in r for r in rounds)}
        entry["medians"] = {s: {f: statistics.median(r[s][f] for r in rounds if r[s].get(f) is not None)
                                for f in (*FIGURES, "ttft_max_ms") if any(r[s].get(f) is not None for r in rounds)}
                            for s in systems if all(s in r for r in rounds)}
        entry["timed_out"] = sorted({s for r in rounds for s in systems if r.get(s, {}).get("timed_out")})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=32)
    p.set_defaults(max_model_len=512)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own")
    p.add_argument("--max-wait", type=float, default=None, help="--admission-max-wait for loractl's daemons")
    p.add_argument("--draw-seed", type=int, default=DRAW_SEED)
    p.add_argument("--drawn", type=int, default=DRAWN)
    p.add_argument("--shapes", default=None, help="comma-separated shape names (default: all)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--run-timeout", type=float, default=60.0)
    p.add_argument("--systems", default="measured,batching,server",
                   help="loractl policies (POLICY@WAIT: with that --admission-max-wait) and server")
    p.add_argument("--print-shapes", action="store_true")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    cells = specs(args)
    if args.print_shapes:
        for spec in cells:
            print(spec)
        return
    wanted = args.systems.split(",")
    args.adapters = max(args.adapters, *(spec["adapters"] for spec in cells))
    work = _setup.workdir(args.workdir)
    if args.model == "tiny-random":
        args.model = str(tiny_random(work))
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    began = time.monotonic()
    results = {spec["name"]: {"spec": spec, "rounds": []} for spec in cells}
    for spec in cells:
        names = [f"bench/a{i}" for i in range(spec["adapters"])]
        config = argparse.Namespace(**{**vars(args), "max_loras": spec["max_loras"],
                                       "max_cpu_loras": spec["max_cpu_loras"]})
        print(f"{spec['name']}: {spec} ({time.monotonic() - began:.0f} s in)", file=sys.stderr, flush=True)
        home = work / spec["name"]
        home.mkdir(parents=True, exist_ok=True)
        with launched(model, names, paths[:len(names)], config, home, wanted) as (daemons, server):
            async def go() -> None:
                systems = await connect(daemons, server, model, names, paths[:len(names)])
                try:
                    await run_configuration(systems, [spec], args, results, seed=1000 + spec["index"])
                finally:
                    for s in systems:
                        await s.close()

            asyncio.run(go())
        summarise(results)
        _setup.write_quietly({"partial": True, "cells": results}, args.out)
    summarise(results)
    policies = [s for s in wanted if s != "server"]
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
              "draw_seed": args.draw_seed, "drawn": args.drawn,
              "settings": {k: getattr(args, k) for k in ("device", "rank", "max_model_len", "max_num_seqs", "kv_cache",
                                                         "max_wait", "rounds", "run_timeout", "systems")},
              "wall_s": round(time.monotonic() - began, 1), "cells": results}
    report["markdown"] = markdown(results, policies)
    print(report["markdown"], file=sys.stderr)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
