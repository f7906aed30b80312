"""Adapter activation latency, serving overhead and thrash: loractl vs plain vLLM, same run.

    python bench/lora_bench.py --model tiny --device cpu --out bench/results/cpu.json   # CPU smoke
    python bench/lora_bench.py --model /models/llama3-8b-random --device cuda --rank 16 \\
        --adapters 32 --max-loras 8 --max-cpu-loras 16 --out bench/results/h100.json     # GPU

Scenarios (each reported for loractl, through its socket, and for vLLM's own AsyncLLM in
this process with identical settings; ratios are loractl / vLLM from the same run):
- activation: time to first token for an adapter already on device (hot), in host RAM only
  (warm: evicted from the device by requests for max_loras others), and on disk only (cold:
  removed from the engine and its files dropped from the page cache); plus the floors:
  adapter bytes / measured disk read bandwidth and / measured host->device bandwidth.
- serving: N concurrent streams mixing the base model and adapters: tokens/s and TTFT.
- thrash: K > max_loras adapters requested with a Zipf distribution: p50/p99 TTFT and
  tokens/s; loractl pins the most popular max_cpu_loras - max_loras adapters in RAM; vLLM has no such policy.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402

PROMPT = "Write a query that lists every user who ordered twice"


# -- the two paths, behind one small interface ------------------------------------------
class LoractlPath:
    name = "loractl"

    def __init__(self, daemon: _setup.Daemon, names: list[str]) -> None:
        from loractl import Client

        self.client = Client(daemon.socket)
        self.names = names

    async def request(self, adapter: int | None, max_tokens: int) -> tuple[float, int]:
        began, first, tokens = time.perf_counter(), None, 0
        async for chunk in self.client.generate(messages=[{"role": "user", "content": PROMPT}],
                                                lora=self.names[adapter] if adapter is not None else None,
                                                max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0):
            if chunk.token_ids and first is None:
                first = time.perf_counter() - began
            tokens += len(chunk.token_ids)
        return first or 0.0, tokens

    async def to_disk(self, adapter: int) -> Path:
        await self.client.evict(self.names[adapter], source="host")
        return Path((await self.client.show(self.names[adapter]))["path"])

    async def pin(self, adapter: int) -> None:
        await self.client.pin(self.names[adapter])

    def close(self) -> None:
        self.client.close()


class VllmPath:
    name = "vllm"

    def __init__(self, llm, paths: list[Path]) -> None:
        from vllm.lora.request import LoRARequest

        self.llm = llm
        self.requests = [LoRARequest(lora_name=f"bench-{i}", lora_int_id=i + 1, lora_path=str(p))
                         for i, p in enumerate(paths)]
        self.paths = paths
        self.tokenizer = llm.get_tokenizer()
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}], add_generation_prompt=True,
                                                  tokenize=False)
        self.prompt = {"prompt_token_ids": self.tokenizer.encode(text, add_special_tokens=False)}
        self.counter = 0

    async def request(self, adapter: int | None, max_tokens: int) -> tuple[float, int]:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.counter += 1
        params = SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
        began, first, tokens = time.perf_counter(), None, 0
        async for out in self.llm.generate(self.prompt, params, f"r{self.counter}",
                                           lora_request=self.requests[adapter] if adapter is not None else None):
            n = len(out.outputs[0].token_ids)
            if n and first is None:
                first = time.perf_counter() - began
            tokens += n
        return first or 0.0, tokens

    async def to_disk(self, adapter: int) -> Path:
        await self.llm.remove_lora(adapter + 1)
        return self.paths[adapter]

    async def pin(self, adapter: int) -> None:
        pass  # plain vLLM: no pin policy in the baseline

    def close(self) -> None:
        _setup.shutdown_vllm_engine(self.llm)


# -- scenarios ---------------------------------------------------------------------------
async def activation(path, args) -> dict:
    """hot / warm / cold TTFT of adapter 0, ``args.repeats`` times each."""
    results = {"hot": [], "warm": [], "cold": []}
    others = list(range(1, args.max_loras + 1))
    for _ in range(args.repeats):
        await path.request(0, 2)
        results["hot"].append((await path.request(0, 2))[0])
        for o in others:  # max_loras other adapters push adapter 0 off the device, not out of RAM
            await path.request(o, 2)
        results["warm"].append((await path.request(0, 2))[0])
        folder = await path.to_disk(0)
        _setup.drop_page_cache(folder)
        results["cold"].append((await path.request(0, 2))[0])
    return {tier: _setup.summary(v) for tier, v in results.items()}


async def serving(path, args) -> dict:
    streams = args.streams
    choices = [None if i % (args.max_loras + 1) == 0 else (i % args.max_loras) for i in range(streams)]
    for c in set(choices) - {None}:
        await path.request(c, 2)  # warm: this scenario measures serving, not loading
    began = time.perf_counter()
    results = await asyncio.gather(*(path.request(c, args.tokens) for c in choices))
    elapsed = time.perf_counter() - began
    return {"streams": streams, "tokens_per_stream": args.tokens, "tokens_per_s": round(sum(t for _, t in results) / elapsed, 1),
            "ttft": _setup.summary([t for t, _ in results]), "wall_s": round(elapsed, 3)}


async def thrash(path, args, pin: bool) -> dict:
    k = args.adapters
    weights = [1 / (i + 1) ** args.zipf for i in range(k)]
    rng = random.Random(7)
    sequence = rng.choices(range(k), weights=weights, k=args.thrash_requests)
    if pin:
        for i in range(args.max_cpu_loras - args.max_loras):
            await path.pin(i)
    queue = list(sequence)
    ttfts, tokens = [], 0

    async def worker():
        nonlocal tokens
        while queue:
            adapter = queue.pop()
            ttft, n = await path.request(adapter, args.tokens)
            ttfts.append(ttft)
            tokens += n

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.concurrency)))
    elapsed = time.perf_counter() - began
    return {"adapters": k, "requests": len(sequence), "concurrency": args.concurrency, "zipf_s": args.zipf,
            "ttft": _setup.summary(ttfts), "tokens_per_s": round(tokens / elapsed, 1)}


def floors(adapter: Path, device: str, work: Path) -> dict:
    """Bytes of the adapter's weights over measured disk-read and host->device bandwidth."""
    import torch

    size = (adapter / "adapter_model.safetensors").stat().st_size
    probe = work / "read-probe.bin"
    probe_size = max(64 << 20, 4 * size)
    with open(probe, "wb") as f:
        f.write(os.urandom(1 << 20) * (probe_size >> 20))
    fd = os.open(probe, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    began = time.perf_counter()
    while os.read(fd, 8 << 20):
        pass
    disk_bw = probe_size / (time.perf_counter() - began)
    os.close(fd)
    probe.unlink()
    n = max(size, 64 << 20) // 4
    if device == "cuda" and torch.cuda.is_available():
        src = torch.empty(n, dtype=torch.float32).pin_memory()
        dst = torch.empty(n, dtype=torch.float32, device="cuda")
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        began = time.perf_counter()
        for _ in range(5):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        h2d, what = 5 * n * 4 / (time.perf_counter() - began), "pinned host->device copy"
    else:
        src = torch.empty(n, dtype=torch.float32)
        dst = torch.empty_like(src)
        dst.copy_(src)
        began = time.perf_counter()
        for _ in range(5):
            dst.copy_(src)
        h2d, what = 5 * n * 4 / (time.perf_counter() - began), "host memcpy (no device on a CPU run)"
    return {"adapter_bytes": size, "disk_read_GBps": round(disk_bw / 1e9, 3), "copy_GBps": round(h2d / 1e9, 3),
            "copy_kind": what, "disk_floor_ms": round(1000 * size / disk_bw, 3),
            "copy_floor_ms": round(1000 * size / h2d, 3)}


async def run_path(path, args) -> dict:
    out = {}
    if "activation" in args.scenarios:
        out["activation"] = await activation(path, args)
    if "serving" in args.scenarios:
        out["serving"] = await serving(path, args)
    if "thrash" in args.scenarios:
        out["thrash"] = await thrash(path, args, pin=path.name == "loractl")
    return out


def ratios(a: dict, b: dict) -> dict:
    out = {}
    if "activation" in a:
        out["activation_ttft_p50"] = {t: round(a["activation"][t]["p50_ms"] / max(b["activation"][t]["p50_ms"], 1e-9), 2)
                                      for t in ("hot", "warm", "cold")}
    if "serving" in a:
        out["serving_tokens_per_s"] = round(a["serving"]["tokens_per_s"] / b["serving"]["tokens_per_s"], 2)
        out["serving_ttft_p50"] = round(a["serving"]["ttft"]["p50_ms"] / b["serving"]["ttft"]["p50_ms"], 2)
    if "thrash" in a:
        out["thrash_ttft_p50"] = round(a["thrash"]["ttft"]["p50_ms"] / b["thrash"]["ttft"]["p50_ms"], 2)
        out["thrash_ttft_p99"] = round(a["thrash"]["ttft"]["p99_ms"] / b["thrash"]["ttft"]["p99_ms"], 2)
        out["thrash_tokens_per_s"] = round(a["thrash"]["tokens_per_s"] / b["thrash"]["tokens_per_s"], 2)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=4)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--thrash-requests", type=int, default=24)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--zipf", type=float, default=1.1)
    p.add_argument("--scenarios", default="activation,serving,thrash")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.scenarios = set(args.scenarios.split(","))
    if args.adapters <= args.max_loras:
        raise SystemExit("--adapters must exceed --max-loras (the warm and thrash scenarios need evictions)")
    work = _setup.workdir(args.workdir)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/a{i}" for i in range(len(paths))]

    home = work / "home"  # fresh each run: pins and the store from an earlier run would skew it
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()
    daemon = _setup.Daemon(model, args, home)
    try:
        from loractl import Client

        async def pull_all():
            async with Client(daemon.socket) as c:
                for name, path in zip(names, paths):
                    async for _ in c.pull(str(path), name=name):
                        pass

        asyncio.run(pull_all())

        async def go_loractl():
            path = LoractlPath(daemon, names)
            try:
                return await run_path(path, args)
            finally:
                path.close()

        loractl_results = asyncio.run(go_loractl())
    finally:
        daemon.stop()

    async def go_vllm():
        path = VllmPath(_setup.vllm_engine(model, args), paths)
        try:
            return await run_path(path, args)
        finally:
            path.close()

    vllm_results = asyncio.run(go_vllm())
    report = {
        "machine": _setup.machine(), "device": args.device, "model": args.model, "rank": args.rank,
        "settings": {k: getattr(args, k) for k in ("adapters", "max_loras", "max_cpu_loras", "repeats", "streams",
                                                   "tokens", "thrash_requests", "concurrency", "zipf")},
        "loractl": loractl_results, "vllm": vllm_results, "ratio_loractl_over_vllm": ratios(loractl_results, vllm_results),
    }
    if "activation" in args.scenarios:
        report["floors"] = floors(paths[0], args.device, work)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
