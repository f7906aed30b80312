"""KV blocks carry nothing from one request to the next: the engine's fresh blocks are zeroed
before a step writes them (``scrubbed_steps``, wrapped around the worker's ``execute_model``).

Why: a block freed by one request keeps its values until the next request writes over them,
and attention reads whole blocks. A NaN or inf left there by an adapter gone wrong reached a
later request of another client (issue 37, finding 2; reproduced with the engine alone: 1 of 12
base-model requests after a NaN adapter's answered token 0; none with the scrub).

Invariant: only blocks given fresh in this step are touched (never a prefix-cache hit, whose
contents are computed and may be shared), and only for models with one KV cache group.
The scheduler-output and KV-cache names read here are listed in ``vllm_seam`` and checked at
the engine's start, so a default below never hides a rename upstream.
"""

from __future__ import annotations

import functools
from typing import Any


def _fresh_blocks(scheduler_output: Any, block_size: int) -> list[int] | None:
    """The KV blocks this step gives requests fresh (not prefix-cache hits, whose contents are
    computed and shared): a new request's blocks past its cached tokens, a running request's
    appended blocks, a resumed request's blocks past its computed tokens. None when a request
    has several KV cache groups (hybrid models): not handled, so nothing is touched."""
    fresh: list[int] = []
    for request in getattr(scheduler_output, "scheduled_new_reqs", ()):
        if len(request.block_ids) != 1:
            return None
        fresh += request.block_ids[0][request.num_computed_tokens // block_size:]
    cached = getattr(scheduler_output, "scheduled_cached_reqs", None)
    if cached is not None:
        for req_id, blocks, computed in zip(cached.req_ids, cached.new_block_ids, cached.num_computed_tokens):
            if not blocks:
                continue
            if len(blocks) != 1:
                return None
            skip = computed // block_size if req_id in cached.resumed_req_ids else 0
            fresh += blocks[0][skip:]
    return fresh


def scrub_fresh_blocks(worker: Any, scheduler_output: Any) -> None:
    """Zero the KV blocks a step gives requests fresh, before the step writes them. A block
    freed by one request keeps its values until the next writes over them, and attention reads
    whole blocks: a NaN or inf left by an adapter gone wrong reached a later request of another
    client (issue 37, finding 2: 0 x NaN is NaN). Zeroed, a block carries nothing between
    requests. The cost is one index_fill per KV cache tensor in a step that allocates blocks."""
    caches = getattr(getattr(worker, "model_runner", None), "kv_caches", None)
    cache_config = getattr(worker, "cache_config", None)
    num_blocks = getattr(cache_config, "num_gpu_blocks", None)
    if not caches or not num_blocks:
        return
    fresh = _fresh_blocks(scheduler_output, int(cache_config.block_size))
    if not fresh:
        return
    import torch

    index = None
    done: set[int] = set()
    for kv in caches:
        if not isinstance(kv, torch.Tensor) or kv.data_ptr() in done or num_blocks not in kv.shape:
            continue
        if index is None or index.device != kv.device:
            index = torch.tensor(sorted(set(fresh)), dtype=torch.long, device=kv.device)
        kv.index_fill_(kv.shape.index(num_blocks), index, 0)
        done.add(kv.data_ptr())


def scrubbed_steps(execute_model):
    """``execute_model`` that scrubs the step's fresh blocks first (installed by ``worker_ext``)."""
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        if scheduler_output is not None:
            scrub_fresh_blocks(self, scheduler_output)
        return execute_model(self, scheduler_output, *args, **kwargs)

    wrapper._loractl_scrubbed = True  # type: ignore[attr-defined]
    return wrapper
