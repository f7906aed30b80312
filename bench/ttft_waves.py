"""Time to first token over ``GenerateMany`` and over a ``Generate`` stream per request.

    .venv/bin/python bench/ttft_waves.py --rounds 3 --out bench/results/ttft-waves-cpu.json

serve_bench.py's base@64 cell runs 64 closed-loop clients whose requests all ask for the same
number of tokens. There, ``loractl.Client`` over ``GenerateMany`` showed a higher TTFT than a
``Generate`` stream per request, with the same tokens/s. This benchmark separates two causes:
time the transport adds, and waves: requests that start together and end together, then send
their next requests together, so each wave's prompts meet in one engine step and every
first token waits for all of them. One daemon, the two clients alternating per round, the
same request sequence for both, and two length patterns: ``fixed`` (every answer
``--tokens`` long, as serve_bench.py) and ``varied`` (each between half and 1.5 times it, a
seeded sequence), which breaks the waves. TTFT is reported for the first ``--streams``
requests (the opening burst) apart from the rest.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
from serve_bench import LoractlSystem, settle  # noqa: E402


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 1)


def lengths(pattern: str, tokens: int, count: int, seed: int) -> list[int]:
    if pattern == "fixed":
        return [tokens] * count
    rng = random.Random(seed)
    return [rng.randint(tokens // 2, tokens * 3 // 2) for _ in range(count)]


async def run(system: LoractlSystem, sizes: list[int], streams: int) -> dict:
    await settle()
    started, samples = 0, []

    async def client() -> None:
        nonlocal started
        while started < len(sizes):
            index, started = started, started + 1
            sample = await system.request(None, sizes[index])
            samples.append((index, sample))

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall = time.perf_counter() - began
    burst = [s.ttft for i, s in samples if i < streams]
    rest = [s.ttft for i, s in samples if i >= streams]
    return {"tokens_per_s": round(sum(s.tokens for _, s in samples) / wall, 1),
            "burst_ttft_p50_ms": _ms(statistics.median(burst)), "burst_ttft_max_ms": _ms(max(burst)),
            "ttft_p50_ms": _ms(statistics.median(rest)), "ttft_p99_ms": _ms(_setup.percentile(rest, 0.99)),
            "itl_p50_ms": _ms(statistics.median(s.itl for _, s in samples if s.itl is not None))}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=1)
    p.add_argument("--streams", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--patterns", default="fixed,varied")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.max_num_seqs = None
    work = _setup.workdir(args.workdir)
    model, _ = _setup.prepare(args.model, 0, args.rank, work)
    home = work / "home"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    daemon = _setup.Daemon(model, args, home, [])

    async def go() -> list[dict]:
        systems = [LoractlSystem(daemon.socket, []), LoractlSystem(daemon.socket, [], stream_per_request=True)]
        rounds = []
        try:
            for r in range(args.rounds):
                result = {}
                for pattern in args.patterns.split(","):
                    sizes = lengths(pattern, args.tokens, args.requests, seed=r)
                    for system in systems if r % 2 == 0 else systems[::-1]:
                        result.setdefault(pattern, {})[system.name] = cell = await run(system, sizes, args.streams)
                        print(f"round {r + 1} {pattern:6s} {system.name:17s} {cell}", file=sys.stderr, flush=True)
                rounds.append(result)
        finally:
            for system in systems:
                await system.close()
        return rounds

    try:
        rounds = asyncio.run(go())
    finally:
        daemon.stop()
    ratios = {}
    for pattern in args.patterns.split(","):
        for key in ("tokens_per_s", "burst_ttft_p50_ms", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms"):
            values = [r[pattern]["loractl"][key] / r[pattern]["loractl-generate"][key] for r in rounds]
            ratios.setdefault(pattern, {})[key] = _setup.spread(values)
    _setup.write({"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
                  "settings": {k: getattr(args, k) for k in ("streams", "tokens", "requests", "patterns", "rounds")},
                  "rounds": rounds, "loractl_over_loractl-generate": ratios}, args.out)


if __name__ == "__main__":
    main()
