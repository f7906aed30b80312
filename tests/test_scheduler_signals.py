"""The series routers score this daemon by (llm-d's endpoint picker, the Gateway API Inference
Extension), read as they read them: counted at loractl's admission gate, named as clients name
adapters. See loractld/serving/signals.py and notes/fleet.md."""

from __future__ import annotations

import asyncio
import re
import time

from conftest import collect, run_cli
from loractld.serving.admission import Gate
from loractld.serving.policies import make_policy
from loractld.serving.signals import scheduler_series

NAMES = ("sig-sql/v1", "sig-poet/v1", "sig-python/v1")
SOURCES = ("sql-expert/v1", "poet/v1", "python-expert/v1")

VLLM_TEXT = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 1.0
# HELP vllm:lora_requests_info Running stats on lora requests.
# TYPE vllm:lora_requests_info gauge
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a@0123",waiting_lora_adapters=""} 1.7e+09
# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
"""


def parse(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by series name, as a Prometheus text parser (and llm-d's extractor) sees them."""
    series: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = re.match(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)$", line)
        assert match, f"not a Prometheus sample: {line!r}"
        labels = dict(re.findall(r'(\w+)="((?:[^"\\]|\\.)*)"', match.group(3) or ""))
        series.setdefault(match.group(1), []).append((labels, float(match.group(4))))
    return series


def lora_info(series) -> tuple[set[str], set[str], int]:
    """What llm-d scores from: the newest ``vllm:lora_requests_info`` series."""
    labels, _ = max(series["vllm:lora_requests_info"], key=lambda s: s[1])
    split = lambda v: set(filter(None, v.split(",")))  # noqa: E731
    return split(labels["running_lora_adapters"]), split(labels["waiting_lora_adapters"]), int(labels["max_lora"])


def test_gate_queue_counts_as_waiting_and_names_are_the_clients():
    async def go():
        gate = Gate(1, make_policy("first-come"))
        first = await gate.enter(7, "sql/v1")
        queued = asyncio.create_task(gate.enter(8, "poet/v1"))
        await asyncio.sleep(0)
        text = scheduler_series(gate, 2, VLLM_TEXT, "base")
        gate.finish(first)
        gate.finish(await queued)
        return text, scheduler_series(gate, 2, VLLM_TEXT, "base")

    busy, idle = asyncio.run(go())
    series = parse(busy)
    for name in ("vllm:lora_requests_info", "vllm:num_requests_waiting", "vllm:num_requests_running"):
        assert len(series[name]) == 1, (name, series[name])  # vLLM's own answer is replaced, not repeated
    assert series["vllm:num_requests_waiting"][0][1] == 1 + 1    # vLLM's waiting plus the gate's queue
    assert series["vllm:num_requests_running"][0][1] == 2
    assert lora_info(series) == ({"sql/v1"}, {"poet/v1"}, 2)     # never the engine's "a@0123"
    assert series["vllm:kv_cache_usage_perc"][0][1] == 0.25       # the rest passes through
    assert abs(series["vllm:lora_requests_info"][0][1] - time.time()) < 60  # the value is a timestamp
    assert lora_info(parse(idle))[:2] == (set(), set())


def test_metrics_under_contention_match_ps(daemon, demo):
    """Three adapters for two places: one adapter's requests wait at the gate. Each scrape of
    the daemon's real /metrics text, taken between two identical ``ps`` readings, says exactly
    what ``ps`` says: admitted adapters running, queued ones waiting."""
    for name, source in zip(NAMES, SOURCES):
        assert run_cli("pull", str(demo / "adapters" / source), "--name", name,
                       "--socket", str(daemon.socket)).returncode == 0

    def snapshot(requests) -> tuple[frozenset, frozenset]:
        running = frozenset(r["adapter"] for r in requests if r["state"] == "running" and r["adapter"])
        waiting = frozenset(r["adapter"] for r in requests if r["state"] == "queued") - running
        return running, waiting

    async def go():
        async with daemon.client() as client:
            stop = asyncio.Event()

            async def loop(name):
                while not stop.is_set():
                    await collect(client, prompt="hi", lora=name, max_tokens=200, min_tokens=200, temperature=0.0)

            loops = [asyncio.create_task(loop(name)) for name in NAMES]
            matched, seen_waiting = 0, False
            deadline = time.monotonic() + 120
            try:
                while (matched < 3 or not seen_waiting) and time.monotonic() < deadline:
                    before = snapshot((await client.status())["admission"]["requests"])
                    text = await client.metrics()
                    after = snapshot((await client.status())["admission"]["requests"])
                    if before != after:
                        continue  # something moved mid-scrape: no single truth to compare with
                    series = parse(text)
                    running, waiting, max_lora = lora_info(series)
                    assert (running, waiting) == (set(before[0]), set(before[1])), text
                    assert max_lora == 2 and len(running) <= 2
                    assert not any("@" in n for n in running | waiting), text  # no engine-internal names
                    assert series["vllm:num_requests_waiting"][0][1] >= len(waiting)
                    matched += 1
                    seen_waiting |= bool(waiting)
            finally:
                stop.set()
                await asyncio.gather(*loops)
            return matched, seen_waiting

    matched, seen_waiting = asyncio.run(go())
    assert matched >= 3 and seen_waiting, (matched, seen_waiting)
