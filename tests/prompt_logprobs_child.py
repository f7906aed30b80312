"""Run rounds of concurrent requests asking prompt and sample logprobs on a real engine, in a
process of its own (the CPU fixes patch vLLM process-wide; the test process must stay clean).

Usage: ``python prompt_logprobs_child.py JOB.json`` where the job holds ``model``, ``cpu_fixes``,
``adapters`` ({key: folder}) and ``rounds`` (lists of [adapter key or null, prompt token ids]).
Prints one JSON line: ``{"rounds": [[{"prompt": [...], "sampled": [...], "prompt_logprobs":
[...], "sample_logprobs": [...], "scheduled": ts}, ...], ...]}`` (prompt logprobs from the second
prompt token on), or ``{"error": ...}`` where the engine failed.
"""

from __future__ import annotations

import asyncio
import json
import sys
import uuid

MAX_TOKENS = 4


async def _round(llm, requests, ids: dict[str, int], folders: dict[str, str]):
    from vllm import SamplingParams
    from vllm.lora.request import LoRARequest

    params = SamplingParams(max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS, temperature=0, prompt_logprobs=0, logprobs=0)

    async def one(n: int, key: str | None, prompt: list[int]) -> dict:
        lora = LoRARequest(lora_name=key, lora_int_id=ids[key], lora_path=folders[key]) if key else None
        last = None
        async for last in llm.generate({"prompt_token_ids": prompt}, params, uuid.uuid4().hex, lora_request=lora):
            pass
        sampled = list(last.outputs[0].token_ids)
        return {
            "prompt": prompt, "sampled": sampled,
            "prompt_logprobs": [last.prompt_logprobs[i][prompt[i]].logprob for i in range(1, len(prompt))],
            "sample_logprobs": [step[token].logprob for step, token in zip(last.outputs[0].logprobs, sampled)],
            # The scheduler stamps every request it first schedules in a step with that step's time.
            "scheduled": last.metrics.scheduled_ts,
        }

    # In one step: the scheduler is paused while every request reaches the engine core, then
    # resumed; its next step schedules them all (the test checks the scheduler's stamps).
    await llm.pause_generation(mode="keep", clear_cache=False)
    tasks = [asyncio.create_task(one(n, key, prompt)) for n, (key, prompt) in enumerate(requests)]
    while llm.output_processor.get_num_unfinished_requests() < len(requests):
        await asyncio.sleep(0.005)
    await llm.resume_generation()
    return await asyncio.gather(*tasks)


async def main(job: dict) -> dict:
    from loractld.engine.client import Engine, EngineSettings

    engine = await Engine.start(EngineSettings(
        model=job["model"], device="cpu", dtype="float32", max_model_len=256, max_loras=3, max_cpu_loras=4,
        max_lora_rank=16, kv_cache_bytes=64 << 20, enable_prefix_caching=False, cpu_fixes=job["cpu_fixes"]))
    ids = {key: n + 1 for n, key in enumerate(job["adapters"])}
    try:
        return {"rounds": [await _round(engine._llm, requests, ids, job["adapters"]) for requests in job["rounds"]]}
    except Exception as e:  # noqa: BLE001 - reported to the test, which says what it expects
        return {"error": f"{type(e).__name__}: {e}", "engine_dead": engine.errored}
    finally:
        engine.shutdown()


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        result = asyncio.run(main(json.load(f)))
    print("RESULT " + json.dumps(result), flush=True)
