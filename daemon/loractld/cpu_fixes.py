"""Fixes for two vLLM CPU-backend bugs, installed inside the worker process.

1. Mixed batches are wrong: the torch LoRA ops index the stacked adapter weights with the
   per-token slot index, and ``-1`` ("this token uses no adapter") wraps to the *last* slot,
   so a base-model request batched with LoRA requests is served with that slot's adapter
   (upstream vllm-project/vllm PRs #48421 and #49656). The masked ops below zero the input
   rows of such tokens and clamp their index to a valid slot, so they get no LoRA delta;
   rows with a real index go through the original op untouched.
2. bfloat16 dies with SIGILL in the AMX attention path because nothing asked the kernel for
   AMX tile permission; ``torch.cpu._init_amx()`` asks.

The worker runs in a process vLLM spawns, so the fixes are installed by loractl's
``vllm.general_plugins`` entry point (``vllm_plugin``), only when ``LORACTL_VLLM_CPU_FIXES=1``
is set (loractld's engine sets it before it starts vLLM on the CPU).

Invariant: installing is idempotent, and a batch in which every token has an adapter (or
none has) computes exactly what the original ops compute.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

ENV_FLAG = "LORACTL_VLLM_CPU_FIXES"
_PATCHED_NAMES = ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")
# Under "vllm." so the message shows in the engine process, where vLLM configures logging.
_log = logging.getLogger("vllm.plugins.loractl_cpu_fixes")


def _masked(original: Callable) -> Callable:
    """Wrap a ``bgmv_*`` op (inputs, weights, output, indices, ...) so index -1 adds nothing."""

    def op(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs):
        no_lora = lora_indices_tensor < 0
        if bool(no_lora.any()):
            keep = (~no_lora).unsqueeze(1).to(inputs.dtype)
            inputs = inputs * keep
            lora_indices_tensor = lora_indices_tensor.clamp(min=0)
        return original(inputs, lora_weights, output_tensor, lora_indices_tensor, *args, **kwargs)

    op.__name__ = original.__name__
    op.__doc__ = original.__doc__
    op.__wrapped__ = original  # type: ignore[attr-defined]
    op._loractl_masked = True  # type: ignore[attr-defined]
    return op


def install_masked_lora_ops() -> list[str]:
    """Replace the torch LoRA ops everywhere vLLM bound them; return the patched modules."""
    import importlib

    patched = []
    for module_name in (
        "vllm.lora.ops.torch_ops.lora_ops",  # sgmv_* call these through the module globals
        "vllm.lora.ops.torch_ops",
        "vllm.lora.punica_wrapper.punica_cpu",  # bound them at import time
    ):
        module = importlib.import_module(module_name)
        for name in _PATCHED_NAMES:
            current = getattr(module, name, None)
            if current is not None and not getattr(current, "_loractl_masked", False):
                setattr(module, name, _masked(current))
                patched.append(f"{module_name}.{name}")
    return patched


def init_amx() -> bool:
    """Ask the kernel for AMX tile permission (no-op where AMX is absent)."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init()) if init is not None else False


def install() -> None:
    """Install both fixes in this process."""
    amx = init_amx()
    patched = install_masked_lora_ops()
    _log.info("loractl CPU fixes installed (amx=%s, patched %d ops)", amx, len(patched))
