"""Engine defaults on the CPU, derived from the model and the machine rather than fixed.

On CUDA vLLM sizes the KV cache from free device memory and picks the dtype itself; on the CPU
it needs an explicit KV-cache size, and loractld picks the dtype. A fixed default only fits the
models it was chosen for (a fixed 256 MiB KV cache cut a 128k-context model to ~1k tokens; a
fixed float32 doubles an 8B model's 16 GB), so both come from the model's config:

- dtype: float32 (exact against float32 references, and no AMX-bf16 path to trip over) unless
  the float32 weights would take more than half of the memory available now, or the base is
  quantized, by its checkpoint or by ``--quantization`` (vLLM's CPU kernels for AWQ, GPTQ,
  compressed-tensors and FP8 take float16 or bfloat16 activations only: float32 is refused at
  start); then bfloat16.
- KV cache: enough for one sequence of the model's full context, capped at 4 GiB and at an
  eighth of the memory available, and never below 256 MiB. vLLM then fits the context to it
  (``--max-model-len`` auto) and ``status`` shows the value in force.

Anything unreadable (a Hub id not downloaded yet, an unusual config) falls back to float32 and
256 MiB, the previous fixed defaults.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from loractld.models import quantized

_log = logging.getLogger("loractld.defaults")

MIN_KV_BYTES = 256 << 20
MAX_KV_BYTES = 4 << 30
# vLLM keeps part of the cache out of the context it fits (a block, of up to 128 tokens on the
# CPU); without this margin an 8192-token model got 8064.
KV_MARGIN_TOKENS = 256
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass(frozen=True)
class CpuDefaults:
    dtype: str
    kv_cache_bytes: int
    reason: str


def available_memory() -> int:
    """MemAvailable from /proc/meminfo, in bytes (0 where unknown)."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _text_config(config: dict) -> dict:
    return config.get("text_config") or config


def kv_bytes_per_token(config: dict, dtype: str) -> int | None:
    c = _text_config(config)
    try:
        layers = int(c["num_hidden_layers"])
        heads = int(c["num_attention_heads"])
        kv_heads = int(c.get("num_key_value_heads") or heads)
        head_dim = int(c.get("head_dim") or int(c["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    return 2 * layers * kv_heads * head_dim * _DTYPE_BYTES.get(dtype, 4)


def context_length(config: dict) -> int | None:
    c = _text_config(config)
    value = c.get("max_position_embeddings") or c.get("max_sequence_length") or c.get("seq_length")
    return int(value) if isinstance(value, int) and value > 0 else None


def choose(config: dict | None, parameters: int | None, available: int, dtype: str = "auto",
           kv_cache_bytes: int | None = None, quantization_flag: str | None = None) -> CpuDefaults:
    """The CPU engine's dtype and KV-cache size; explicit values (not 'auto'/None) are kept.
    ``quantization_flag``: vLLM's ``--quantization``, which quantizes a float base at load."""
    reasons = []
    quantization = quantized.describe(quantized.quantization_config(config or {})) or (quantization_flag or "")
    if dtype == "auto":
        dtype = "float32"
        if quantization:
            dtype = "bfloat16"
            reasons.append(f"bfloat16: a quantized base ({quantization}) runs on vLLM's CPU kernels with "
                           "bfloat16 or float16 activations")
        elif parameters and available and parameters * 4 > available // 2:
            dtype = "bfloat16"
            reasons.append(f"bfloat16: float32 weights ({parameters * 4 / 2**30:.1f} GiB) would take more than "
                           f"half of the {available / 2**30:.1f} GiB available")
    if kv_cache_bytes is None:
        per_token = kv_bytes_per_token(config or {}, dtype)
        ctx = context_length(config or {})
        if per_token and ctx:
            cap = min(MAX_KV_BYTES, available // 8) if available else MAX_KV_BYTES
            need = per_token * (ctx + KV_MARGIN_TOKENS)
            kv_cache_bytes = max(MIN_KV_BYTES, min(need, cap))
            reasons.append(f"KV cache {kv_cache_bytes / 2**20:.0f} MiB: {ctx} tokens of context need "
                           f"{need / 2**20:.0f} MiB, capped at {cap / 2**20:.0f} MiB")
        else:
            kv_cache_bytes = MIN_KV_BYTES
            reasons.append("KV cache 256 MiB: the model's config does not say its context or attention shape")
    return CpuDefaults(dtype=dtype, kv_cache_bytes=kv_cache_bytes, reason="; ".join(reasons))


def for_model(model: str, dtype: str, kv_cache_bytes: int | None, quantization_flag: str | None = None) -> CpuDefaults:
    """``choose`` for a local model folder (a Hub id not on disk gets the fallbacks)."""
    folder = Path(model)
    config = None
    parameters = None
    if (folder / "config.json").is_file():
        try:
            config = json.loads((folder / "config.json").read_text())
        except ValueError:
            config = None
        from loractld.models.weights import base_model_shapes

        try:
            parameters = quantized.parameter_count(base_model_shapes(folder)) or None
        except Exception:  # unreadable weights are vLLM's to report
            parameters = None
    method = quantized.method(quantized.quantization_config(config or {})) or (quantization_flag or "")
    refusal = quantized.cpu_refusal(method)
    if refusal:
        from loractld.models.gguf import ModelRefused

        raise ModelRefused(f"{method} quantization cannot run on the CPU: {refusal}",
                           "Serve an AWQ, GPTQ or compressed-tensors W4A16 base on the CPU, or this one on a GPU.")
    result = choose(config, parameters, available_memory(), dtype, kv_cache_bytes, quantization_flag)
    if result.reason:
        _log.info("CPU defaults: %s", result.reason)
    return result

