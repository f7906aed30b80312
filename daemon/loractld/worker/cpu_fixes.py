"""Fixes for three vLLM CPU-backend bugs, installed inside the worker process.

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
3. Prompt logprobs with LoRA in a step of several requests: vLLM computes one request's
   prompt logits from its rows of the step, and its CPU logits op indexes them with the
   step's one-adapter-per-request ``sampler_indices``; vLLM's ops then die (einsum shapes)
   and loractl's gave prompt rows another request's ``lm_head`` delta, or none (issue 46).
   ``with_prompt_rows`` tells ``add_lora_logits`` which step tokens those rows are.
4. A mixture-of-experts base with LoRA on: vLLM then always picks Triton's MoE experts, which the
   CPU has not (the engine died at the first request); ``select_backend_without_expert_lora``
   lets it pick the CPU's own, as LoRA stays off the experts on the CPU (``models.moe``).

The worker runs in a process vLLM spawns, so the fixes are installed by loractl's
``vllm.general_plugins`` entry point (``vllm_plugin``), only when ``LORACTL_VLLM_CPU_FIXES=1``
is set (loractld's engine sets it before it starts vLLM on the CPU).

Invariant: installing is idempotent; a row with an adapter gets that adapter's product (the
same sums the original ops compute, up to float rounding), a row without one gets none; a
logits row gets the adapter of the request it belongs to (``add_lora_logits``).
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
    if indices.shape[0] != x.shape[0] and groups:
        # Several adapters, and no index per row: which row is whose is unknown. Guessing gave
        # rows other requests' deltas (issue 46); vLLM's own op fails here too (einsum shapes).
        raise ValueError(f"LoRA indices for {indices.shape[0]} rows given for {x.shape[0]} rows of a mixed batch")
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


# -- prompt logprobs: the logits of one request's prompt rows (issue 46) ----------------------
# While vLLM computes one request's prompt logits, the step tokens those rows are (a slice of
# the step's token rows); None otherwise, when the logits rows are the step's sampled rows.
# The engine core computes logits from one thread.
_prompt_rows: slice | None = None


def _rows_in(step_hidden, rows) -> slice | None:
    """Which rows of ``step_hidden`` the view ``rows`` is; None when it is not a row slice of it."""
    if (rows.dim() != 2 or step_hidden.dim() != 2 or rows.stride() != step_hidden.stride()
            or rows.untyped_storage().data_ptr() != step_hidden.untyped_storage().data_ptr()):
        return None
    start, within = divmod(rows.storage_offset() - step_hidden.storage_offset(), step_hidden.stride(0))
    if within or start < 0 or start + rows.shape[0] > step_hidden.shape[0]:
        return None
    return slice(start, start + rows.shape[0])


def with_prompt_rows(get_prompt_logprobs_dict: Callable) -> Callable:
    """Wrap the runner's ``_get_prompt_logprobs_dict`` so each request's prompt logits know
    their step tokens (``_prompt_rows``) while the model computes them.

    vLLM calls ``model.compute_logits(hidden_states[offset:offset + n])`` once per request that
    asks prompt logprobs, and its CPU LoRA logits op then indexes those ``n`` rows with the
    step's per-request ``sampler_indices``: with two adapters in the step, prompt rows got
    another request's ``lm_head`` delta or none (loractl's ops), or the engine died (vLLM's).
    """
    import functools

    if getattr(get_prompt_logprobs_dict, "loractl_prompt_rows", False):
        return get_prompt_logprobs_dict

    @functools.wraps(get_prompt_logprobs_dict)
    def wrapped(self, hidden_states, *args, **kwargs):
        model = self.model
        compute_logits = model.compute_logits

        def prompt_logits(rows, *more, **named):
            global _prompt_rows
            _prompt_rows = _rows_in(hidden_states, rows)
            try:
                return compute_logits(rows, *more, **named)
            finally:
                _prompt_rows = None

        model.compute_logits = prompt_logits   # this call only: the instance attribute goes below
        try:
            return get_prompt_logprobs_dict(self, hidden_states, *args, **kwargs)
        finally:
            del model.compute_logits

    wrapped.loractl_prompt_rows = True
    return wrapped


def add_lora_logits(self, y, x, lora_a_stacked, lora_b_stacked, scale, *, buffer=None, **kwargs):
    """vLLM's ``PunicaWrapperCPU.add_lora_logits`` (``y += (x @ A) * scale @ B``), each row with
    its own adapter.

    Invariant: logits row ``t`` gets the delta of the adapter of the request the row belongs
    to: the step's sampled rows take ``sampler_indices`` (one per sampled row); one request's
    prompt rows (``_prompt_rows``) take the step tokens' ``token_lora_indices``. A row count
    that matches neither with several adapters in the step is refused by ``_per_slot``.
    """
    import torch

    rows = _prompt_rows
    indices = self.sampler_indices if rows is None else self.token_lora_indices[rows]
    y = y.view(-1, y.shape[-1])
    x = x.view(-1, x.shape[-1])
    if buffer is None:   # float32, as vLLM's (and its Triton op's) buffer
        buffer = torch.zeros((x.size(0), lora_b_stacked.size(-1)), dtype=torch.float32, device=x.device)
    bgmv_shrink(x, lora_a_stacked, buffer, indices, scale)
    bgmv_expand(buffer, lora_b_stacked, y, indices, add_inputs=True)


def install_prompt_logits() -> list[str]:
    """Give prompt logprobs' logits rows their own adapters (``add_lora_logits``,
    ``with_prompt_rows``) at the seam's targets; return the patched names."""
    patched = []
    for module, name in vllm_seam.targets("cpu_logits"):
        if getattr(module, name) is not add_lora_logits:
            setattr(module, name, add_lora_logits)
            patched.append(f"{module.__name__}.{name}")
    for runner, name in vllm_seam.targets("cpu_prompt_logprobs"):
        current = getattr(runner, name)
        if not getattr(current, "loractl_prompt_rows", False):
            setattr(runner, name, with_prompt_rows(current))
            patched.append(f"{runner.__name__}.{name}")
    return patched


# -- a mixture-of-experts base with LoRA on -------------------------------------------------
def select_backend_without_expert_lora(select: Callable) -> Callable:
    """Wrap vLLM's unquantized MoE backend choice so that LoRA being on does not force Triton's
    experts: on the CPU no Triton runs (the first request died with ``triton.language has no
    attribute float32``), and loractld keeps LoRA off the experts there (``models.moe``: the
    engine's ``lora_target_modules`` leave the fused-MoE layer out), so the CPU's own MoE
    kernel is the right one."""
    import dataclasses

    def select_unquantized_moe_backend(moe_config, *args, **kwargs):
        if getattr(moe_config, "is_lora_enabled", False):
            moe_config = dataclasses.replace(moe_config, is_lora_enabled=False)
        return select(moe_config, *args, **kwargs)

    select_unquantized_moe_backend.loractl_cpu_moe = True
    return select_unquantized_moe_backend


def install_moe_backend() -> list[str]:
    """The MoE backend choice without expert LoRA, at the seam's targets (a vLLM without this
    path, other than the 0.32 CPU wheel, is left alone)."""
    patched = []
    try:
        found = vllm_seam.targets("cpu_moe_backend")
    except (ImportError, AttributeError):
        return patched
    for module, name in found:
        current = getattr(module, name)
        if not getattr(current, "loractl_cpu_moe", False):
            setattr(module, name, select_backend_without_expert_lora(current))
            patched.append(f"{module.__name__}.{name}")
    return patched


def install() -> None:
    """Install the fixes in this process."""
    amx = init_amx()
    patched = install_lora_ops() + install_prompt_logits() + install_moe_backend()
    _log.info("loractl CPU fixes installed (amx=%s, patched %d ops)", amx, len(patched))
