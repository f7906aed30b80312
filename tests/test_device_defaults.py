"""The engine's defaults on a GPU (issue 56): sized from the card's free memory, the host's and the
model, each with its reason; a user's value always wins. ``choose`` is pure: its readings are
arguments, so the cards below are the readings NVML gives for them, not a GPU."""

from __future__ import annotations

import dataclasses

import pytest

from loractl.errors import EngineUnavailable
from loractld.engine import client, device_defaults as dd
from loractld.engine.client import EngineSettings

GiB = dd.GiB
H200 = dd.GpuMemory(0, free=int(139.8 * GiB), total=int(140.4 * GiB), name="NVIDIA H200")
DESKTOP = dd.GpuMemory(0, free=int(21.0 * GiB), total=24 * GiB, name="NVIDIA GeForce RTX 4090")   # a display on it
# Llama-3.1-8B's shapes: 32 layers, 8 KV heads of 128, 4096 hidden, 14336 MLP; bf16 weights, 128k context.
LLAMA_8B = dd.ModelFacts(weights_bytes=16 * GiB, kv_bytes_per_token=2 * 32 * 8 * 128 * 2, context=131072,
                         adapter_bytes_per_rank=dd._adapter_bytes_per_rank(
                             {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
                              "num_key_value_heads": 8, "intermediate_size": 14336}))
TINY = dd.ModelFacts(weights_bytes=2 << 20, kv_bytes_per_token=2 * 2 * 2 * 16 * 2, context=2048,
                     adapter_bytes_per_rank=dd._adapter_bytes_per_rank(
                         {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                          "num_key_value_heads": 2, "intermediate_size": 128}))


def chosen(given, gpus, model, host=64 * GiB, rank=16):
    return {c.name: c for c in dd.choose(given, gpus, host, model, rank)}


def test_the_share_is_the_free_memory_less_a_margin():
    c = chosen({}, [DESKTOP], LLAMA_8B)["gpu_memory_utilization"]
    # 21 GiB free of 24, less max(1.5 GiB, 5 % = 1.2 GiB): 19.5 / 24 = 0.8125 -> 0.81
    assert c.value == 0.81
    assert "21.0 GiB free" in c.why and "1.5 GiB margin" in c.why
    assert chosen({}, [H200], LLAMA_8B)["gpu_memory_utilization"].value == 0.9   # never above vLLM's own 0.9


def test_tensor_parallelism_takes_the_least_free_card():
    busy = dd.GpuMemory(1, free=10 * GiB, total=24 * GiB)
    assert chosen({"tensor_parallel_size": 2}, [DESKTOP, busy], LLAMA_8B)["gpu_memory_utilization"].value == 0.35
    assert chosen({}, [DESKTOP, busy], LLAMA_8B)["gpu_memory_utilization"].value == 0.81   # one card used


def test_the_kv_cache_is_what_the_sequences_need_not_the_whole_card():
    """The H200 lease's KV cache took 128 GiB for a tiny model: sized, it takes what 1024 sequences
    of its context need."""
    c = chosen({}, [H200], TINY)["kv_cache_memory_bytes"]
    assert c.value == TINY.kv_bytes_per_token * 2048 * 1024   # vLLM's server default on a 140 GiB card
    assert c.value < 1 * GiB
    # A big model's need is capped by what the share leaves after the weights, slots and margin.
    big = chosen({}, [DESKTOP], LLAMA_8B)
    share = big["gpu_memory_utilization"].value * DESKTOP.total
    assert big["kv_cache_memory_bytes"].value < share - LLAMA_8B.weights_bytes
    assert "sequences of 131072 tokens" in big["kv_cache_memory_bytes"].why
    # max_num_seqs and max_model_len, when given, are what it sizes for
    small = chosen({"max_num_seqs": 4, "max_model_len": 8192}, [H200], LLAMA_8B)["kv_cache_memory_bytes"]
    assert small.value == LLAMA_8B.kv_bytes_per_token * 8192 * 4
    # on the 24 GiB card an 8B model leaves under 1 GiB for the cache: said, with the sums
    tight = chosen({"max_num_seqs": 4, "max_model_len": 8192}, [DESKTOP], LLAMA_8B)["kv_cache_memory_bytes"]
    assert tight.value < 1 * GiB and "need 4.00 GiB" in tight.why


def test_slots_and_host_entries_from_the_adapters_bytes():
    c = chosen({}, [DESKTOP], LLAMA_8B, host=32 * GiB, rank=16)
    slot = LLAMA_8B.adapter_bytes_per_rank * 16      # 80 MiB for rank 16 on an 8B model
    assert 70 << 20 < slot < 90 << 20
    assert c["max_loras"].value == dd.MAX_SLOTS       # 5 % of 19 GiB holds 12: capped at 8
    assert c["max_cpu_loras"].value == min(dd.MAX_HOST, (32 * GiB // 8) // slot)   # 51
    wide = chosen({}, [DESKTOP], LLAMA_8B, host=32 * GiB, rank=256)
    assert wide["max_loras"].value < c["max_loras"].value   # rank 256 pads every slot 16-fold
    assert wide["max_cpu_loras"].value >= 2 * wide["max_loras"].value


def test_a_users_values_are_never_changed():
    given = {"gpu_memory_utilization": 0.5, "max_loras": 3, "max_cpu_loras": 7, "kv_cache_memory_bytes": 1 << 30}
    assert chosen(given, [DESKTOP], LLAMA_8B) == {}
    assert set(chosen({"max_loras": 3}, [DESKTOP], LLAMA_8B)) == {"gpu_memory_utilization", "max_cpu_loras",
                                                                  "kv_cache_memory_bytes"}


def test_a_full_card_is_said_before_vllm_fails():
    taken = dd.GpuMemory(0, free=1 * GiB, total=24 * GiB)
    with pytest.raises(EngineUnavailable) as caught:
        dd.choose({}, [taken], 8 * GiB, LLAMA_8B, 16)
    assert "1.0 GiB free of 24.0 GiB" in caught.value.message and "--gpu-memory-utilization" in caught.value.hint
    assert dd.choose({"gpu_memory_utilization": 0.03}, [taken], 8 * GiB, TINY, 16)   # the user's share: theirs


def test_no_gpu_reading_leaves_vllms_defaults():
    assert dd.choose({}, [], 8 * GiB, LLAMA_8B, 16) == []


def test_the_cuda_start_fills_the_settings_from_the_readings(demo, monkeypatch):
    """What ``Engine.start`` does on CUDA before vLLM's args: the tiny model folder's real config and
    weights, the card as NVML would read it (the one test double: no GPU here)."""
    monkeypatch.setattr(dd, "gpu_memory", lambda: [H200])
    settings = EngineSettings(model=str(demo / "model"), device="cuda", max_lora_rank=16)
    sized, kv, choices = client._sized_for_cuda(settings, None)
    names = {c.name for c in choices}
    assert names == {"gpu_memory_utilization", "max_loras", "max_cpu_loras", "kv_cache_memory_bytes"}
    assert sized.max_loras == next(c.value for c in choices if c.name == "max_loras") >= 2
    assert sized.max_cpu_loras >= 2 * sized.max_loras
    # 2 layers x 4 KV heads x 64 x K and V x 2 bytes = 2 KiB a token; 1024 sequences of 1024 tokens
    assert kv == 2048 * 1024 * 1024   # 2 GiB where vLLM took 128 GiB on the H200 lease
    facts = dd.model_facts(str(demo / "model"))
    assert facts.weights_bytes and facts.kv_bytes_per_token and facts.adapter_bytes_per_rank
    # the user's flags win
    mine = dataclasses.replace(settings, max_loras=5, max_cpu_loras=6, engine_args={"gpu_memory_utilization": 0.4})
    sized, kv, choices = client._sized_for_cuda(mine, 123 << 20)
    assert (sized.max_loras, sized.max_cpu_loras, kv) == (5, 6, 123 << 20)
    assert {c.name for c in choices} == set()
