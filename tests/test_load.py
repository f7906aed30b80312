"""A regression guard for the request path under load (not a benchmark: the figures are in
docs/benchmarks.md, from bench/serve_bench.py).

32 concurrent streams of base-model requests, then the same load on one adapter, against the
real daemon: no adapter request may wait for its first token much longer than the slowest
base-model request of the same run (a ratio, never an absolute time, so a slow machine
cannot fail it and a stall cannot pass it), and every output equals the HF + PEFT reference.
"""

from __future__ import annotations

import asyncio
import time

from conftest import collect

STREAMS, REQUESTS, TOKENS = 32, 64, 16
PROMPT = "List every table"
# Generous: an adapter step costs more than a base step, and two cores are noisy. What the
# guard catches is a stall — a request held for a multiple of a whole wave's time.
BOUND = 5.0


async def _wave(client, lora: str | None) -> list[tuple[float, list[int]]]:
    queue = list(range(REQUESTS))
    results: list[tuple[float, list[int]]] = []

    async def stream() -> None:
        while queue:
            queue.pop()
            began, first = time.perf_counter(), None
            ids: list[int] = []
            async for chunk in client.generate(messages=[{"role": "user", "content": PROMPT}], lora=lora,
                                               max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0):
                if chunk.token_ids and first is None:
                    first = time.perf_counter() - began
                ids += chunk.token_ids
            results.append((first, ids))

    await asyncio.gather(*(stream() for _ in range(STREAMS)))
    return results


def test_adapter_requests_under_load_never_stall_behind_the_base_model(daemon, demo, reference):
    adapter = str(demo / "adapters" / "sql-expert" / "v1")

    async def go():
        async with daemon.client() as client:
            for lora in (None, adapter):  # loaded and warm: this measures serving, not loading
                await collect(client, messages=[{"role": "user", "content": PROMPT}], lora=lora, max_tokens=2)
            return await _wave(client, None), await _wave(client, adapter)

    base, lora = asyncio.run(go())
    ids = reference.chat_ids(PROMPT)
    assert all(got == reference.greedy(ids, None, TOKENS, TOKENS) for _, got in base)
    assert all(got == reference.greedy(ids, demo / "adapters" / "sql-expert" / "v1", TOKENS, TOKENS) for _, got in lora)
    slowest_base = max(t for t, _ in base)
    slowest_lora = max(t for t, _ in lora)
    assert slowest_lora <= BOUND * slowest_base, (
        f"an adapter request waited {slowest_lora * 1000:.0f} ms for its first token, "
        f"{slowest_lora / slowest_base:.1f}x the slowest base-model request ({slowest_base * 1000:.0f} ms)")
