"""Engine defaults come from the model, not from constants that only the tiny model satisfies.

A variant of the demo model with a 160-token context (shorter than the old fixed 1,024
default, which killed the engine at start), a tokenizer that adds BOS and no chat template,
served with no context flag at all: the daemon starts, reports the model's own context,
refuses a request past it in one line, a raw prompt gets its BOS token and equals HF's
answer, and a chat request says in one line that there is no template and what to do.
"""

from __future__ import annotations

import asyncio
import json
import shutil

import pytest

from conftest import ENGINE_FLAGS, Reference, add_bos, collect, run_cli, start_daemon
from test_errors import assert_one_error
from loractl.errors import InvalidRequest

CONTEXT = 160
NO_CONTEXT_FLAGS = [f for i, f in enumerate(ENGINE_FLAGS)
                    if f != "--max-model-len" and (i == 0 or ENGINE_FLAGS[i - 1] != "--max-model-len")]


@pytest.fixture(scope="module")
def short_model(demo, tmp_path_factory):
    model = tmp_path_factory.mktemp("short") / "model"
    shutil.copytree(demo / "model", model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = CONTEXT
    (model / "config.json").write_text(json.dumps(config))
    bos = add_bos(model)
    (model / "chat_template.jinja").unlink()  # a base model: no chat template
    return model, bos


def test_a_short_context_model_with_bos_starts_with_no_context_flag(short_model, home):
    model, bos = short_model
    sub = home / "short"
    sub.mkdir(exist_ok=True)
    d = start_daemon(sub, name="s", model=str(model), engine_flags=NO_CONTEXT_FLAGS)
    try:
        status = json.loads(run_cli("status", "--json", "--socket", str(d.socket)).stdout)
        assert status["engine"]["max_model_len"] == CONTEXT
        reference = Reference(model)
        prompt = "SELECT name FROM"
        expected_ids = reference.tokenizer.encode(prompt)
        assert expected_ids[0] == bos

        async def go():
            async with d.client() as client:
                answer = await collect(client, prompt=prompt, max_tokens=12, temperature=0.0)
                with pytest.raises(InvalidRequest) as refused:
                    await collect(client, prompt=prompt, max_tokens=CONTEXT, temperature=0.0)
                return answer, refused.value

        answer, refused = asyncio.run(go())
        assert answer["prompt_ids"] == expected_ids
        assert answer["ids"] == reference.greedy(expected_ids, None, 12)
        assert f"the context of {CONTEXT} tokens" in refused.message
        assert_one_error(run_cli("run", "hi", "--socket", str(d.socket)), 2, "has no chat template",
                         "--chat-template FILE")
        # run's default --max-tokens fits what the context has left (a fixed 256 was refused here).
        whole = run_cli("run", "--raw", "-t", "0", prompt, "--socket", str(d.socket))
        assert whole.returncode == 0, whole.stderr
        assert whole.stdout.rstrip("\n") == reference.text(reference.greedy(expected_ids, None, CONTEXT - len(expected_ids)))
    finally:
        d.stop()


def test_chat_template_flag_serves_chat_on_a_model_without_one(short_model, home, tmp_path):
    model, _ = short_model
    template = tmp_path / "t.jinja"
    template.write_text("{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
                        "{% if add_generation_prompt %}[assistant] {% endif %}")
    sub = home / "short-t"
    sub.mkdir(exist_ok=True)
    d = start_daemon(sub, "--chat-template", str(template), name="t", model=str(model),
                     engine_flags=NO_CONTEXT_FLAGS)
    try:
        reference = Reference(model)
        text = "[user] hello\n[assistant] "
        ids = reference.tokenizer.encode(text, add_special_tokens=False)

        async def go():
            async with d.client() as client:
                return await collect(client, messages=[{"role": "user", "content": "hello"}], max_tokens=8,
                                     temperature=0.0)
        answer = asyncio.run(go())
        assert answer["prompt_ids"] == ids and answer["ids"] == reference.greedy(ids, None, 8)
    finally:
        d.stop()
    missing = run_cli_daemon_refusal(model, sub, "--chat-template", str(tmp_path / "nope.jinja"))
    assert missing.returncode == 2 and "cannot read the chat template" in missing.stderr and "Traceback" not in missing.stderr


def run_cli_daemon_refusal(model, home, *flags):
    import subprocess

    from conftest import BIN

    return subprocess.run([str(BIN / "loractld"), "--model", str(model), "--home", str(home), *flags],
                          capture_output=True, text=True, timeout=60)


def test_a_truncated_gguf_model_is_refused_in_one_line(tmp_path):
    import subprocess

    from conftest import BIN

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF\x03\x00\x00\x00")
    home = tmp_path / "h"
    result = subprocess.run([str(BIN / "loractld"), "--model", str(gguf), "--home", str(home), "--socket",
                             f"/tmp/lct-gguf-{tmp_path.name[-8:]}.sock", *ENGINE_FLAGS],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 1, result.stderr[-2000:]
    assert "model.gguf is not a readable GGUF file" in result.stderr
    assert "Traceback" not in result.stderr
    assert not list((home / "models").glob("*")), "nothing half-converted may be left"


# ---- CPU defaults derived from the model and the machine (no engine) ----------------------

SMOLLM2 = {"num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
           "head_dim": 64, "max_position_embeddings": 8192}
LLAMA_8B_128K = {"num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096,
                 "max_position_embeddings": 131072}
GiB = 1 << 30


def test_cpu_kv_cache_holds_a_small_models_whole_context():
    from loractld.models.defaults import choose

    chosen = choose(SMOLLM2, 135_000_000, available=20 * GiB)
    assert chosen.dtype == "float32"
    assert chosen.kv_cache_bytes == 2 * 30 * 3 * 64 * 4 * (8192 + 256)  # 8192 tokens + a margin, float32
    assert "8192 tokens of context" in chosen.reason


def test_cpu_defaults_for_a_long_context_model_are_capped_and_big_weights_go_bfloat16():
    from loractld.models.defaults import MAX_KV_BYTES, MIN_KV_BYTES, choose

    roomy = choose(LLAMA_8B_128K, 8_000_000_000, available=128 * GiB)
    assert roomy.dtype == "float32" and roomy.kv_cache_bytes == MAX_KV_BYTES  # 128k tokens would need 16 GiB
    tight = choose(LLAMA_8B_128K, 8_000_000_000, available=24 * GiB)
    assert tight.dtype == "bfloat16" and "half of the 24.0 GiB" in tight.reason
    assert tight.kv_cache_bytes == 3 * GiB  # an eighth of what is available
    assert choose(LLAMA_8B_128K, 8_000_000_000, available=1 * GiB).kv_cache_bytes == MIN_KV_BYTES
    # Explicit flags are kept; an unreadable config falls back to the old fixed defaults.
    kept = choose(LLAMA_8B_128K, 8_000_000_000, 24 * GiB, dtype="float16", kv_cache_bytes=GiB)
    assert (kept.dtype, kept.kv_cache_bytes) == ("float16", GiB)
    fallback = choose({}, None, 24 * GiB)
    assert (fallback.dtype, fallback.kv_cache_bytes) == ("float32", MIN_KV_BYTES)


def test_cpu_defaults_read_a_model_folder(demo):
    from loractld.models.defaults import for_model

    chosen = for_model(str(demo / "model"), "auto", None)  # the tiny model: 256 context, 2 layers
    assert chosen.dtype == "float32" and chosen.kv_cache_bytes == 256 << 20
    assert for_model("org/not-downloaded", "auto", None).kv_cache_bytes == 256 << 20


def test_served_model_name_lets_a_folder_named_otherwise_take_its_adapters(demo, tmp_path):
    """The offline case: an adapter names the Hub id, the model is a local folder without it."""
    from loractl.errors import InvalidAdapter
    from loractld.models.basemodel import describe
    from loractld.store.validate import validate_adapter

    model = tmp_path / "some-folder"
    shutil.copytree(demo / "model", model)
    config = json.loads((model / "config.json").read_text())
    del config["_name_or_path"]
    (model / "config.json").write_text(json.dumps(config))
    adapter = demo / "adapters" / "sql-expert" / "v1"  # base_model_name_or_path: loractl/demo-tiny-llama

    def check(base):
        return validate_adapter(adapter, max_lora_rank=16, base_shapes=base.shapes, model_names=base.names, force=False)

    with pytest.raises(InvalidAdapter, match="trained for 'loractl/demo-tiny-llama'"):
        check(describe(str(model), str(model)))
    assert check(describe(str(model), str(model), served_name="loractl/demo-tiny-llama")).base_model == "loractl/demo-tiny-llama"
