"""The engine's defaults on a GPU, sized for the card and the machine, each said aloud.

vLLM's own defaults are a server's: 0.9 of the card's *total* memory, and a KV cache of all that
is left after the weights (on the H200 lease: 128 GiB of KV cache for a 135M-parameter model).
On a workstation the card also drives a display or a notebook, so a fixed share either fails
vLLM's start check (free memory below the share) or starves the rest. loractld therefore fills
what the user left out from what it reads at start:

- ``gpu_memory_utilization``: the share of the card that is *free* now, less a margin for the
  display and other processes (the larger of 1.5 GiB and 5 % of the card), at most vLLM's 0.9;
  with tensor parallelism, the least free of the cards used.
- ``kv_cache_memory_bytes``: what ``max_num_seqs`` sequences of the whole context need, and no
  more than the share leaves after the weights, the adapter slots and a working margin.
- ``max_loras`` (device slots) and ``max_cpu_loras`` (host entries): from the bytes one adapter at
  ``max_lora_rank`` takes on this model, within a byte budget of device and host memory.

Invariants:
- A value the user gave is never changed; only the missing ones are chosen.
- The GPU is read through NVML (``nvidia-ml-py``, which vLLM brings), never through the CUDA
  runtime: nothing in the daemon's process may initialize CUDA before vLLM forks (``device``).
- Each choice carries its reason; the engine logs them and ``status`` shows them.
- :func:`choose` is pure (its readings are arguments), so it is tested without a GPU.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loractl.errors import EngineUnavailable

_log = logging.getLogger("loractld.defaults")

GiB = 1 << 30
MiB = 1 << 20
MARGIN_BYTES = int(1.5 * GiB)   # the display, a notebook's kernel, a browser's GPU process
MARGIN_SHARE = 0.05
MAX_SHARE = 0.9                 # vLLM's own default share
MIN_SHARE = 0.05                # below this the card is taken: say so instead of failing in vLLM
WORKING_SHARE = 0.10            # of the share: activations, CUDA graphs, the sampler's buffers
SLOT_BUDGET_SHARE = 0.05        # of the share, for adapter slots
MIN_SLOTS, MAX_SLOTS = 2, 8
HOST_BUDGET_SHARE = 1 / 8       # of the host RAM available now, for the host tier
MIN_HOST, MAX_HOST = 4, 64
# vLLM's server defaults for max_num_seqs (arg_utils: 1024 on cards of 70 GiB and more, else 256).
BIG_CARD = 70 * GiB
LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GpuMemory:
    index: int
    free: int
    total: int
    name: str = ""


@dataclass(frozen=True)
class Choice:
    name: str       # vLLM's field name
    value: Any
    why: str


@dataclass(frozen=True)
class ModelFacts:
    """What sizing needs of the base model; None where unknown."""
    weights_bytes: int | None = None        # the weight files, as stored (a quantized model's packed size)
    kv_bytes_per_token: int | None = None   # all layers, K and V, at the KV cache's element size
    context: int | None = None              # the model's own context length
    adapter_bytes_per_rank: int | None = None   # one adapter's A and B over the usual target modules, per rank


def choose(given: dict[str, Any], gpus: list[GpuMemory], host_available: int, model: ModelFacts,
           max_lora_rank: int) -> list[Choice]:
    """The values to fill in, for the fields missing from ``given`` (vLLM field name -> value)."""
    if not gpus:
        return []
    choices: list[Choice] = []
    tp = int(given.get("tensor_parallel_size") or 1) * int(given.get("pipeline_parallel_size") or 1)
    used = gpus[:max(1, tp)]
    card = min(used, key=lambda g: g.free)
    where = f"GPU {card.index}" + (f" ({card.name})" if card.name else "")
    share = given.get("gpu_memory_utilization")
    if share is None:
        margin = max(MARGIN_BYTES, int(MARGIN_SHARE * card.total))
        share = min(MAX_SHARE, (card.free - margin) / card.total)
        share = int(share * 100) / 100
        if share < MIN_SHARE:
            raise EngineUnavailable(
                f"{where} has {card.free / GiB:.1f} GiB free of {card.total / GiB:.1f} GiB: too little for the engine "
                f"after a {margin / GiB:.1f} GiB margin for other processes",
                "Free GPU memory (nvidia-smi shows who holds it), or pass --gpu-memory-utilization to take a share anyway.")
        choices.append(Choice("gpu_memory_utilization", share,
                              f"{share:.2f} of {where}'s {card.total / GiB:.1f} GiB: {card.free / GiB:.1f} GiB free at "
                              f"start less a {margin / GiB:.1f} GiB margin for the display and other processes"))
    budget = int(float(share) * card.total)
    per_gpu_weights = (model.weights_bytes or 0) // max(1, tp)
    slot_bytes = (model.adapter_bytes_per_rank or 0) * max_lora_rank // max(1, tp)

    slots = given.get("max_loras")
    if slots is None:
        if slot_bytes:
            fit = int(SLOT_BUDGET_SHARE * budget) // slot_bytes
            slots = max(MIN_SLOTS, min(MAX_SLOTS, fit))
            why = (f"{slots} slots: one adapter at rank {max_lora_rank} takes {slot_bytes / MiB:.1f} MiB, "
                   f"{int(SLOT_BUDGET_SHARE * 100)} % of the share holds {fit} (kept within {MIN_SLOTS}-{MAX_SLOTS})")
        else:
            slots, why = MIN_SLOTS, f"{MIN_SLOTS} slots: the model's adapter size is unknown"
        choices.append(Choice("max_loras", slots, why))

    host = given.get("max_cpu_loras")
    if host is None:
        entry = (model.adapter_bytes_per_rank or 0) * max_lora_rank
        if entry and host_available:
            fit = int(HOST_BUDGET_SHARE * host_available) // entry
            host = max(MIN_HOST, int(slots) * 2, min(MAX_HOST, fit))
            why = (f"{host} host entries: one adapter at rank {max_lora_rank} takes {entry / MiB:.1f} MiB, an eighth of "
                   f"the {host_available / GiB:.1f} GiB of host RAM available holds {fit} (at most {MAX_HOST}, "
                   f"at least twice the slots)")
        else:
            host = max(MIN_HOST, int(slots) * 2)
            why = f"{host} host entries: twice the slots (the adapter size or host RAM is unknown)"
        choices.append(Choice("max_cpu_loras", host, why))

    if given.get("kv_cache_memory_bytes") is None and model.kv_bytes_per_token:
        seqs = int(given.get("max_num_seqs") or (1024 if card.total >= BIG_CARD else 256))
        context = int(given.get("max_model_len") or model.context or 0)
        if context:
            per_gpu_token = model.kv_bytes_per_token // max(1, tp)
            need = per_gpu_token * context * seqs
            room = budget - per_gpu_weights - int(slots) * slot_bytes - int(WORKING_SHARE * budget)
            if room > 0:
                kv = max(min(need, room), min(room, per_gpu_token * context))
                choices.append(Choice(
                    "kv_cache_memory_bytes", kv,
                    f"KV cache {kv / GiB:.2f} GiB: {seqs} sequences of {context} tokens need {need / GiB:.2f} GiB; "
                    f"the share leaves {room / GiB:.2f} GiB after the weights, the slots and a "
                    f"{int(WORKING_SHARE * 100)} % working margin"))
    return choices


# -- readings ------------------------------------------------------------------------------
def gpu_memory() -> list[GpuMemory]:
    """Free and total memory of the visible GPUs, in CUDA's order, through NVML ([] if unreadable)."""
    try:
        import pynvml
    except ImportError:
        return []
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: vLLM's start reports it
        return []
    try:
        count = pynvml.nvmlDeviceGetCount()
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        indices = list(range(count))
        if visible is not None:
            indices = [int(v) for v in visible.split(",") if v.strip().isdigit() and int(v) < count]
        out = []
        for cuda_index, physical in enumerate(indices):
            handle = pynvml.nvmlDeviceGetHandleByIndex(physical)
            info = pynvml.nvmlDeviceGetMemoryInfo(handle)
            name = pynvml.nvmlDeviceGetName(handle)
            out.append(GpuMemory(cuda_index, int(info.free), int(info.total),
                                 name.decode() if isinstance(name, bytes) else str(name)))
        return out
    except Exception:  # noqa: BLE001 - unreadable: vLLM's own defaults apply
        _log.warning("could not read the GPUs' memory through NVML; vLLM's defaults apply", exc_info=True)
        return []
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


def model_facts(folder: str, kv_cache_dtype: str | None = None, dtype: str = "auto") -> ModelFacts:
    """:class:`ModelFacts` of a local model folder (a Hub id not downloaded yet: all unknown).
    The KV cache's element is the model's dtype on CUDA: 2 bytes under ``auto`` (vLLM loads a
    float32 checkpoint in 16 bits there), 4 for ``float32``, 1 for an fp8 cache."""
    from loractld.models.defaults import context_length, kv_bytes_per_token

    path = Path(folder)
    config_file = path / "config.json"
    if not config_file.is_file():
        return ModelFacts()
    try:
        config = json.loads(config_file.read_text())
    except ValueError:
        return ModelFacts()
    text = config.get("text_config") or config
    element = "float32" if dtype in ("float32", "float") else "bfloat16"
    if kv_cache_dtype and kv_cache_dtype.startswith("fp8"):
        per_token = kv_bytes_per_token(config, "bfloat16")
        per_token = per_token // 2 if per_token else None
    else:
        per_token = kv_bytes_per_token(config, element)
    weights = sum(f.stat().st_size for f in path.glob("*.safetensors")) or None
    return ModelFacts(weights_bytes=weights, kv_bytes_per_token=per_token, context=context_length(config),
                      adapter_bytes_per_rank=_adapter_bytes_per_rank(text))


def _adapter_bytes_per_rank(config: dict) -> int | None:
    """A and B of q/k/v/o and the MLP's three projections, every layer, 2 bytes an element, per rank."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        heads = int(config["num_attention_heads"])
        kv_heads = int(config.get("num_key_value_heads") or heads)
        head_dim = int(config.get("head_dim") or hidden // heads)
        inter = int(config.get("intermediate_size") or config.get("moe_intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    q, kv = heads * head_dim, kv_heads * head_dim
    per_layer = (hidden + q) + 2 * (hidden + kv) + (q + hidden) + 2 * (hidden + inter) + (inter + hidden)
    return per_layer * layers * 2
