"""A mixture-of-experts base on the CPU (issues 56 and 59): the engine starts with LoRA on and
serves; an adapter on the attention projections answers as HF + PEFT token for token; an adapter
that trains the experts is refused by name and the engine keeps serving.

Before: the first request on a MoE base killed the engine (vLLM picks Triton's MoE experts
whenever LoRA is on, and the CPU has no Triton). The model is a random Qwen3-MoE built here from
transformers' own config class; the adapters are made by ``peft`` itself.
"""

from __future__ import annotations

import asyncio

import pytest

import moe_factory
from conftest import collect, run_cli, start_daemon, sub_home

PROMPT = "hello world"
TOKENS = 12


@pytest.fixture(scope="module")
def moe(home, demo):
    root = sub_home(home, "moe")
    folder = moe_factory.build(root, demo / "model")
    d = start_daemon(root, name="moe", model=str(folder))
    yield root, d
    d.stop()


def hf_greedy(folder, adapter=None) -> list[int]:
    return moe_factory.hf_greedy(folder, PROMPT, TOKENS, adapter)


def served(d, lora=None) -> list[int]:
    async def go():
        async with d.client() as client:
            return await collect(client, prompt=PROMPT, lora=lora, max_tokens=TOKENS, min_tokens=TOKENS,
                                 temperature=0.0)
    return asyncio.run(go())["ids"]


def test_a_moe_base_serves_with_lora_on(moe):
    root, d = moe
    assert served(d) == hf_greedy(root / "moe-model")
    status = run_cli("status", "--socket", str(d.socket)).stdout
    assert "lora_target_modules" in status and "mixture-of-experts" in status   # said, with why


def test_an_attention_adapter_answers_as_peft(moe):
    root, d = moe
    pulled = run_cli("pull", str(root / "a-attn"), "--name", "moe-attn/v1", "--socket", str(d.socket))
    assert pulled.returncode == 0, pulled.stderr
    expected = hf_greedy(root / "moe-model", root / "a-attn")
    assert expected != hf_greedy(root / "moe-model")   # the adapter changes the answer: the oracle can tell
    assert served(d, "moe-attn/v1") == expected


def test_an_expert_adapter_is_refused_by_name_and_nothing_breaks(moe):
    root, d = moe
    pulled = run_cli("pull", str(root / "a-experts"), "--name", "moe-exp/v1", "--socket", str(d.socket))
    assert pulled.returncode != 0
    assert "trains the experts of this mixture-of-experts base" in pulled.stderr
    assert "hint:" in pulled.stderr and "q_proj" in pulled.stderr
    listed = run_cli("ls", "--socket", str(d.socket)).stdout
    assert "moe-exp/v1" not in listed
    as_folder = run_cli("run", "--lora", str(root / "a-experts"), "-n", "2", "hi", "--socket", str(d.socket))
    assert as_folder.returncode != 0 and "trains the experts" in as_folder.stderr
    assert served(d) == hf_greedy(root / "moe-model")   # the engine still serves
