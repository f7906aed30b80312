"""Which device the engine runs on, decided without initializing CUDA in the daemon's process.

vLLM starts its engine core as a child process, forked unless CUDA is already initialized in
the parent (``vllm/utils/system_utils.py:_maybe_force_spawn`` checks
``torch.cuda.is_initialized()``). A plain ``torch.cuda.is_available()`` calls
``cudaGetDeviceCount``, which initializes the CUDA driver and registers torch's fork poison
without making ``is_initialized()`` true: vLLM then forks, and the child's first CUDA call raises
"Cannot re-initialize CUDA in forked subprocess". vLLM's own import avoids that by setting
``PYTORCH_NVML_BASED_CUDA_CHECK=1`` (``vllm/env_override.py``, read in 0.26 and 0.32), which
makes torch count devices through NVML instead.

Invariants:
- ``keep_cuda_uninitialized`` runs first thing in every daemon entry point (``loractld``,
  ``python -m loractld.selfcheck``), before anything imports torch, so no library the daemon
  uses before the engine starts (transformers' availability checks, the tiny model's build)
  can initialize CUDA through ``is_available()`` either.
- ``resolve_device("auto")`` asks vLLM's own platform detection, which counts GPUs through
  NVML (``vllm/platforms/__init__.py:cuda_platform_plugin``): the engine runs on what vLLM
  itself will pick, and the daemon's process never touches the CUDA runtime.
  ``tests/test_cuda_start.py`` checks both with a ``torch`` whose CUDA entry points record
  their callers.
"""

from __future__ import annotations

import os
from typing import Any

from loractl.errors import EngineUnavailable, InvalidRequest

NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"


def keep_cuda_uninitialized() -> None:
    """Make every ``torch.cuda.is_available()`` in this process (and its children) an NVML
    count, as ``import vllm`` does, so that nothing initializes CUDA before vLLM forks."""
    os.environ[NVML_CHECK] = "1"


def resolve_device(requested: str) -> str:
    """``cpu`` or ``cuda``: what was asked, or for ``auto`` what vLLM's platform detection finds."""
    if requested in ("cpu", "cuda"):
        return requested
    if requested != "auto":
        raise InvalidRequest(f"unknown device {requested!r}", "Use --device auto, cuda or cpu.")
    keep_cuda_uninitialized()
    from vllm.platforms import current_platform

    if current_platform.is_cuda():
        return "cuda"
    if current_platform.is_cpu():
        return "cpu"
    raise EngineUnavailable(
        f"vLLM found a {getattr(current_platform, 'device_name', 'non-CUDA')} device, which loractl does not run on",
        "loractl runs vLLM on NVIDIA GPUs (CUDA) or on the CPU: start with --device cpu.")


def settled_dtype(config: Any) -> str | None:
    """The dtype vLLM loaded the weights in (``model_config.dtype``, a torch dtype), as text."""
    dtype = getattr(getattr(config, "model_config", None), "dtype", None)
    return str(dtype).removeprefix("torch.") if dtype is not None else None


def kv_cache_bytes(config: Any) -> int | None:
    """The KV cache vLLM allocated, from the blocks its engine core reported at start
    (``cache_config.num_gpu_blocks``, set in the front end by 0.26 and 0.32 alike): blocks x
    block size x layers x K and V x KV heads x head size x element size. None if unknown."""
    try:
        cache, model, parallel = config.cache_config, config.model_config, config.parallel_config
        blocks = int(cache.num_gpu_blocks or 0)
        if blocks <= 0:
            return None
        import torch

        kv_dtype = model.dtype if cache.cache_dtype in (None, "auto") else getattr(torch, str(cache.cache_dtype), None)
        element = torch.empty((), dtype=kv_dtype).element_size() if isinstance(kv_dtype, torch.dtype) else 1
        per_token = model.get_num_layers(parallel) * 2 * model.get_num_kv_heads(parallel) * model.get_head_size()
        return blocks * int(cache.block_size) * per_token * element
    except (AttributeError, TypeError, ValueError):
        return None
