"""Fixes for two vLLM CPU-backend bugs, installed inside the worker process.

1. Mixed batches are wrong: the torch LoRA ops index the stacked adapter weights with the
   per-token slot index, and ``-1`` ("this token uses no adapter") wraps to the *last* slot,
   so a base-model request batched with LoRA requests is served with that slot's adapter
   (upstream vllm-project/vllm PRs #48421 and #49656). loractl's ops below replace the three
   gathering ops (``bgmv_*``) and their prefill wrappers (``sgmv_*``): rows with index -1 get
   no LoRA delta, and every adapter's rows go through one matrix product (``_per_slot``),
   several times cheaper than the per-token gather it replaces; the index expansion and
   grouping, the same for every layer of a step, are computed once per step (``_Memo``).
2. bfloat16 dies with SIGILL in the AMX attention path because nothing asked the kernel for
   AMX tile permission; ``torch.cpu._init_amx()`` asks.

The worker runs in a process vLLM spawns, so the fixes are installed by loractl's
``vllm.general_plugins`` entry point (``vllm_plugin``), only when ``LORACTL_VLLM_CPU_FIXES=1``
is set (loractld's engine sets it before it starts vLLM on the CPU).

Invariant: installing is idempotent; a row with an adapter gets that adapter's product (the
same sums the original ops compute, up to float rounding), a row without one gets none.
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from loractld.worker import vllm_seam

ENV_FLAG = "LORACTL_VLLM_CPU_FIXES"
# Under "vllm." so the message shows in the engine process, where vLLM configures logging.
_log = logging.getLogger("vllm.plugins.loractl_cpu_fixes")


class _Memo:
    """The last answer for the last small index tensors, reused while they are equal.

    vLLM calls the LoRA ops for every layer and projection of a step with the same indices:
    recomputing their expansion and grouping each time was ~15% of a loaded step. Reuse is
    decided by content (``torch.equal`` on a copy), never by tensor identity, so a stale
    answer cannot be returned; the engine core calls these ops from one thread.
    """

    def __init__(self, compute) -> None:
        self.compute = compute
        self.key: tuple = ()
        self.value = None

    def __call__(self, *tensors):
        import torch

        key = self.key
        if len(key) == len(tensors) and all(k.shape == t.shape and torch.equal(k, t) for k, t in zip(key, tensors)):
            return self.value
        self.value = self.compute(*tensors)
        self.key = tuple(t.clone() for t in tensors)
        return self.value


def _slot_rows(indices):
    """(slot, row indices) for every adapter slot in ``indices``; one entry with ``None`` rows
    when every row uses the same slot; rows with -1 (no adapter) in no entry."""
    import torch

    low, high = int(indices.min()), int(indices.max())
    if low == high:
        return [(low, None)] if low >= 0 else []
    return [(slot, (indices == slot).nonzero(as_tuple=True)[0]) for slot in torch.unique(indices).tolist() if slot >= 0]


def _expand_indices(lora_indices, seq_lens):
    import torch

    return torch.repeat_interleave(lora_indices, seq_lens)


_groups = _Memo(_slot_rows)
_exploded = _Memo(_expand_indices)


def _per_slot(inputs, weights, indices, dtype):
    """``inputs[t] @ weights[indices[t]].T`` for every row ``t``; rows whose index is -1 (no
    adapter) get zeros.

    One matrix product per adapter in the batch instead of vLLM's per-token gather
    (``weights[indices]`` copies a rank x hidden matrix for every token, then an einsum): the
    same sums with a fraction of the memory traffic. In the profile of a loaded daemon the
    gathered ops were about half of every engine step.
    """
    w = weights.squeeze(1) if weights.dim() == 4 else weights   # [slots, out, in]
    x = inputs.to(dtype)
    groups = _groups(indices)
    if len(groups) == 1 and groups[0][1] is None:  # the common step: one adapter for every row
        return x @ w[groups[0][0]].to(dtype).t()
    out = x.new_zeros((x.shape[0], w.shape[1]))
    for slot, rows in groups:
        out.index_copy_(0, rows, x.index_select(0, rows) @ w[slot].to(dtype).t())
    return out


def sgmv_shrink(inputs, lora_a_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, scaling):
    bgmv_shrink(inputs, lora_a_weights, output_tensor, _exploded(lora_indices_tensor, seq_len_tensor), scaling)


def sgmv_expand(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                batches, max_seq_length, token_nums, add_inputs=False):
    bgmv_expand(inputs, lora_b_weights, output_tensor, _exploded(lora_indices_tensor, seq_len_tensor), add_inputs)


def sgmv_expand_slice(inputs, lora_b_weights, output_tensor, b_seq_start_loc, seq_len_tensor, lora_indices_tensor,
                      batches, max_seq_length, token_nums, slice_offset, slice_size, add_inputs=False):
    bgmv_expand_slice(inputs, lora_b_weights, output_tensor, _exploded(lora_indices_tensor, seq_len_tensor),
                      slice_offset, slice_size, add_inputs)


def bgmv_shrink(inputs, lora_b_weights, output_tensor, lora_indices_tensor, scaling: float = 1.0):
    # vLLM's parameter names (the seam's), as its callers may pass them: this one holds lora_a.
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs: bool = True):
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    limit = 1 if outputs.shape[0] == 1 and output_tensor.shape[0] != 1 else output_tensor.shape[0]
    # LoRA adapter and model may add different amounts of padding to the output (as upstream).
    common = min(outputs.shape[1], output_tensor.shape[1])
    if add_inputs:
        output_tensor[:, :common] += outputs[:limit, :common]
    else:
        output_tensor[:, :common] = outputs[:limit, :common]


def bgmv_expand_slice(inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset: int,
                      slice_size: int, add_inputs: bool = True):
    outputs = _per_slot(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset: slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset: slice_offset + slice_size] = outputs


REPLACEMENTS: dict[str, Callable] = {f.__name__: f for f in (bgmv_shrink, bgmv_expand, bgmv_expand_slice, sgmv_shrink,
                                                              sgmv_expand, sgmv_expand_slice)}


def install_lora_ops() -> list[str]:
    """Put loractl's ops everywhere vLLM bound its torch LoRA ops (the seam's ``cpu_ops``: the
    ops' module, the package that re-exports them, and the CPU punica wrapper, which bound them
    at import time); return the patched names."""
    patched = []
    for module, name in vllm_seam.targets("cpu_ops"):
        if getattr(module, name) is not REPLACEMENTS[name]:
            setattr(module, name, REPLACEMENTS[name])
            patched.append(f"{module.__name__}.{name}")
    return patched


def init_amx() -> bool:
    """Ask the kernel for AMX tile permission (no-op where AMX is absent)."""
    import torch

    init = getattr(torch.cpu, "_init_amx", None)
    return bool(init()) if init is not None else False


def install() -> None:
    """Install both fixes in this process."""
    amx = init_amx()
    patched = install_lora_ops()
    _log.info("loractl CPU fixes installed (amx=%s, patched %d ops)", amx, len(patched))
