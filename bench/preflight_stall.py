"""What a first use of new adapter content costs the streams already running: the engine's own
step timings while preflights run, inline (the old path: the load between two steps) against
the preflight thread (``worker_ext.loractl_preflight_start``), alternating in one run.

    python bench/preflight_stall.py --out bench/results/preflight-stall-cpu.json
    python bench/preflight_stall.py --model /models/llama3-8b-random --device cuda --streams 32 --rank 16

Default: a random model with SmolLM2-135M's shapes (bench/make_model.py --shape smollm2-135m),
adapters of rank 64 on all seven projections (78 MB each in float32), 32 greedy streams. The
worker records each step's start and how long each preflight utility call held the engine's
loop (the test suite's hook, tests/hooks_plugin, with ``LORACTL_TEST_STEP_TIMES=1``): the loop runs utility calls between steps, so the time it is
held is time every running stream waits. A step interval is the time between two consecutive
step starts; for each preflight the report gives its duration, the loop time it held, the steps
that started meanwhile, and the longest step interval overlapping it (baseline: every interval
overlapping no preflight).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
# The step timers are the test suite's hook's (loractld/worker/hooks.py finds it here): on the
# path before loractld is imported; the engine core (a child process) finds it on the same path.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "hooks_plugin"))
import _setup  # noqa: E402


async def run(args) -> dict:
    import loractl_test_hooks

    os.environ[loractl_test_hooks.STEP_TIMES] = "1"  # read when the engine installs its worker
    from loractld.engine import vllm_requests
    from loractld.engine.client import Engine, EngineSettings
    from loractld.engine.openai_serving import unadmitted_surface
    from loractld.engine.sampling import Sampling
    from loractld.engine import compat
    from loractld.models.tiny import DemoAdapter, build_adapter

    work = _setup.workdir(args.workdir)
    model = args.model
    if model is None:
        model = str(work / "smollm2-135m-random")
        if not Path(model, "config.json").exists():
            subprocess.run([sys.executable, str(Path(__file__).parent / "make_model.py"), "--shape", "smollm2-135m",
                            "--dtype", "float32", "--out", model], check=True)
    adapters = []
    for i in range(args.adapters):
        dest = work / f"pf-r{args.rank}-{i}"
        if not (dest / "adapter_model.safetensors").exists():
            build_adapter(Path(model), DemoAdapter(f"pf/{i}", rank=args.rank, alpha=args.rank), dest, base_model=model)
        adapters.append(dest)
    size_mb = (adapters[0] / "adapter_model.safetensors").stat().st_size / 1e6
    engine = await Engine.start(EngineSettings(model=model, device=args.device, max_loras=2, max_cpu_loras=4,
                                               max_lora_rank=max(16, args.rank), max_model_len=1024,
                                               kv_cache_bytes=_setup.parse_kv(args.kv_cache) if args.device == "cpu"
                                               else None))
    from vllm.lora.request import LoRARequest

    windows: dict[str, list[tuple[float, float]]] = {"inline": [], "thread": []}
    stop = asyncio.Event()
    surface = unadmitted_surface(engine)

    async def stream(i: int) -> int:
        done = 0
        while not stop.is_set():
            # Lengths staggered per stream: requests that all ended in one step would all start
            # again in one prefill step (seconds on a CPU), a stall of its own that is no preflight's.
            length = args.tokens + 3 * i
            async for delta in vllm_requests.generate(
                    surface, Sampling(max_tokens=length, min_tokens=length, temperature=0.0),
                    prompt_token_ids=[1 + (i * 7 + j) % 400 for j in range(24)]):
                done += len(delta.token_ids)
        return done

    async def preflight(mode: str, n: int) -> str | None:
        path = str(adapters[n % len(adapters)])
        engine_id = 1000 + n
        began = time.monotonic()
        if mode == "inline":  # the old path: the whole load inside one utility call, between steps
            kwargs = compat.lora_request_kwargs(LoRARequest.__struct_fields__, name=f"pf{n}", engine_id=engine_id,
                                                path=path)
            reason = (await engine._llm.collective_rpc("loractl_preflight", args=(kwargs,)))[0]
        else:
            reason = await engine.preflight(f"pf{n}", engine_id, path)
        windows[mode].append((began, time.monotonic()))
        return reason

    tasks = [asyncio.create_task(stream(i)) for i in range(args.streams)]
    await asyncio.sleep(args.warmup)
    n = 0
    for _ in range(args.rounds):
        for mode in ("inline", "thread"):
            reason = await preflight(mode, n)
            assert reason is None, reason
            n += 1
            await asyncio.sleep(args.gap)
    stop.set()
    tokens = sum(await asyncio.gather(*tasks))
    # The engine core is a child process: its hook's records come back through a worker method.
    recorded = (await engine._llm.collective_rpc("loractl_hook_report"))[0]
    starts, held = recorded["steps"], recorded["held"]
    engine.shutdown()

    intervals = [(a, b) for a, b in zip(starts, starts[1:]) if a >= windows["inline"][0][0] - args.gap]

    def overlapping(window):
        return [b - a for a, b in intervals if a < window[1] and b > window[0]]

    busy = [w for ws in windows.values() for w in ws]
    baseline = [b - a for a, b in intervals if not any(a < w[1] and b > w[0] for w in busy)]
    report = {"bench": "preflight_stall", "machine": _setup.machine(), "versions": _setup.versions(),
              "model": model, "device": args.device, "streams": args.streams, "tokens_per_request": args.tokens,
              "adapter_rank": args.rank, "adapter_mb": round(size_mb, 1), "rounds": args.rounds,
              "tokens_generated": tokens,
              "baseline_step_interval": _setup.summary(baseline) | {"max_ms": round(1000 * max(baseline), 1)}}
    for mode, ws in windows.items():
        longest = [max(overlapping(w), default=0.0) for w in ws]
        # how long the engine loop itself was held by this mode's utility calls, per preflight
        # (inline: the whole load; thread: the start and each poll)
        methods = ("loractl_preflight",) if mode == "inline" else ("loractl_preflight_start", "loractl_preflight_poll")
        loop_held = [sum(s for m, t, s in held if m in methods and w[0] <= t <= w[1]) for w in ws]
        report[mode] = {
            "engine_loop_held_ms": _setup.spread([1000 * x for x in loop_held], 3),
            "steps_started_during_preflight": _setup.spread(
                [sum(1 for t in starts if w[0] <= t <= w[1]) for w in ws], 1),
            "preflight_ms": _setup.spread([1000 * (b - a) for a, b in ws], 1),
            "longest_overlapping_step_interval_ms": _setup.spread([1000 * x for x in longest], 1),
            # what one preflight added to every running stream: its longest interval over the baseline median
            "added_to_streams_ms": _setup.spread([1000 * (x - statistics.median(baseline)) for x in longest], 1),
            "each": [{"at_s": round(w[0] - windows["inline"][0][0], 2), "preflight_ms": round(1000 * (w[1] - w[0]), 1),
                      "loop_held_ms": round(1000 * h, 3), "longest_interval_ms": round(1000 * x, 1)}
                     for w, h, x in zip(ws, loop_held, longest)],
        }
    return report


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", help="a model folder (default: a random SmolLM2-135M-shaped model, built once)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--kv-cache", default="512MiB", help="KV cache size on the CPU")
    p.add_argument("--streams", type=int, default=32)
    p.add_argument("--tokens", type=int, default=64, help="tokens per request (each stream repeats requests)")
    p.add_argument("--rank", type=int, default=64)
    p.add_argument("--adapters", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6, help="preflights of each kind, alternating")
    p.add_argument("--warmup", type=float, default=8.0)
    p.add_argument("--gap", type=float, default=1.5, help="seconds between preflights")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    _setup.write(asyncio.run(run(args)), args.out)


if __name__ == "__main__":
    main()
