"""Generation through the real daemon equals HF transformers + PEFT, token for token."""

from __future__ import annotations

import asyncio

import pytest

from conftest import collect, run_cli

PROMPTS = ["Write a query that lists every user", "How do I reverse a list in Python?"]
ADAPTERS = [None, "sql-expert/v1", "python-expert/v1"]
TOKENS = 16


def adapter_path(demo, name):
    return None if name is None else demo / "adapters" / name


@pytest.mark.parametrize("adapter", ADAPTERS, ids=["base", "sql", "python"])
@pytest.mark.parametrize("prompt", PROMPTS, ids=["p0", "p1"])
def test_client_generation_matches_reference(daemon, demo, reference, adapter, prompt):
    path = adapter_path(demo, adapter)

    async def go():
        async with daemon.client() as client:
            return await collect(client, messages=[{"role": "user", "content": prompt}],
                                 lora=str(path) if path else None, max_tokens=TOKENS, min_tokens=TOKENS,
                                 temperature=0.0)

    got = asyncio.run(go())
    prompt_ids = reference.chat_ids(prompt)
    assert got["prompt_ids"] == prompt_ids
    expected = reference.greedy(prompt_ids, path, TOKENS, TOKENS)
    assert got["ids"] == expected
    assert got["text"] == reference.text(expected)
    assert got["finish"] == "length"
    assert got["adapter"].startswith(adapter) if adapter else got["adapter"] == ""


def test_adapters_change_the_output(reference, demo):
    """Guards the oracle itself: if adapters did nothing, the tests above would prove little."""
    ids = reference.chat_ids(PROMPTS[0])
    outputs = {name: tuple(reference.greedy(ids, adapter_path(demo, name), TOKENS, TOKENS)) for name in ADAPTERS}
    assert len(set(outputs.values())) == len(ADAPTERS)


@pytest.mark.parametrize("adapter", [None, "sql-expert/v1"], ids=["base", "sql"])
def test_cli_run_streams_the_reference_text(daemon, demo, reference, adapter):
    path = adapter_path(demo, adapter)
    prompt = "Write a query"
    args = ["run", "--socket", str(daemon.socket), "--temperature", "0", "--max-tokens", "24", prompt]
    if path:
        args[1:1] = ["--lora", str(path)]
    result = run_cli(*args)
    assert result.returncode == 0, result.stderr
    expected = reference.greedy(reference.chat_ids(prompt), path, 24)  # stops at EOS like vLLM
    assert result.stdout == reference.text(expected) + "\n"


def test_cli_run_raw_prompt(daemon, reference):
    prompt = "SELECT name FROM"
    result = run_cli("run", "--raw", "--socket", str(daemon.socket), "-t", "0", "-n", "12", prompt)
    assert result.returncode == 0, result.stderr
    ids = reference.tokenizer.encode(prompt)  # special tokens as the tokenizer adds them, as HF and vLLM do
    assert result.stdout == reference.text(reference.greedy(ids, None, 12)) + "\n"


def test_concurrent_mixed_batch_equals_single_requests(daemon, demo, reference):
    """Base + two adapters in flight at once: the CPU mixed-batch fix keeps each one exact."""
    n = 32
    prompt = PROMPTS[1]

    async def go():
        async with daemon.client() as client:
            return await asyncio.gather(*[
                collect(client, messages=[{"role": "user", "content": prompt}],
                        lora=str(adapter_path(demo, name)) if name else None,
                        max_tokens=n, min_tokens=n, temperature=0.0)
                for name in ADAPTERS
            ])

    results = asyncio.run(go())
    ids = reference.chat_ids(prompt)
    for name, got in zip(ADAPTERS, results):
        assert got["ids"] == reference.greedy(ids, adapter_path(demo, name), n, n), name


def test_sampling_with_seed_is_repeatable(daemon):
    async def go():
        async with daemon.client() as client:
            kwargs = dict(prompt="Once upon a time", max_tokens=12, min_tokens=12, temperature=1.0, seed=7)
            return await collect(client, **kwargs), await collect(client, **kwargs)

    first, second = asyncio.run(go())
    assert first["ids"] == second["ids"] and len(first["ids"]) == 12


def test_the_daemon_log_carries_no_vllm_warnings_by_default(daemon):
    """vLLM's start-up warnings (Triton, tcmalloc, deprecated raw prompts) are noise to a
    loractl user; at the default log level only loractld's own lines and vLLM's errors show."""
    import re

    log = daemon.log.read_text(errors="replace")
    assert "loractld: ready: model" in log
    vllm_warnings = [line for line in log.splitlines() if re.search(r"\) WARNING \d\d-\d\d ", line)]
    assert not vllm_warnings, vllm_warnings[:5]
