"""Mixture-of-experts bases: what loractl serves on them, and where.

vLLM wraps a fused-MoE layer in ``FusedMoEWithLoRA`` whenever LoRA is on; its kernels are Triton's,
which the CPU does not have: with LoRA on, the first request on a MoE base killed the engine on
the CPU (``triton.language has no attribute float32``, vLLM 0.32's CPU wheel; vLLM's own server
dies the same way). On the CPU loractl therefore restricts vLLM's LoRA layers to the attention and
dense projections (vLLM's ``lora_target_modules``), so the experts run on vLLM's CPU MoE path.

Adapters that train the experts (PEFT's ``target_parameters`` on ``mlp.experts.*``, or per-expert
modules such as Mixtral's ``block_sparse_moe.experts.0.w1``) are refused by name on every device
for now: on the CPU no kernel runs them, and on a GPU loractl does not check their expert shapes
and counts yet (issue 59); served half-applied they would answer as another model.

Invariants:
- A user's ``--lora-target-modules`` is never replaced.
- An adapter is served whole or refused: never with its expert deltas dropped.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path

# The config keys transformers' MoE configs name their routed experts by.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# vLLM's module suffixes for attention and dense MLPs (packed and unpacked spellings); "experts" is
# the fused-MoE layer, left out on the CPU.
DENSE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                      "down_proj"]
_EXPERT_MODULE = re.compile(r"(^|\.)experts(\.|$)")


def expert_count(config: dict) -> int:
    """The routed experts per MoE layer a model config declares (0 for a dense model)."""
    text = config.get("text_config") or config
    for key in _EXPERT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def folder_expert_count(folder: str | Path) -> int:
    try:
        return expert_count(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return 0


def expert_targets(modules: Iterable[str], config: dict) -> list[str]:
    """The adapter's module names (and ``target_parameters``) that train experts."""
    found = [m for m in modules if _EXPERT_MODULE.search(m)]
    found += [str(p) for p in config.get("target_parameters") or () if _EXPERT_MODULE.search(str(p))]
    return sorted(set(found))
