"""Quantized bases: a quantized checkpoint's layers as the float shapes adapters are checked
against, and its quantization named as the model's config declares it.

An adapter for a quantized base is trained on the float model (or with QLoRA on the same one):
its ``lora_A``/``lora_B`` fit the float layer, ``out x in``. A quantized checkpoint stores that
layer packed under other names, so the shapes the store's validation reads
(``models.weights.base_model_shapes``) would have no ``X.weight`` and every adapter would be
refused as targeting a module the base lacks. The packed layouts, as each format documents them
and vLLM's loaders read them (``vllm/model_executor/layers/quantization``):

- AWQ (``quant_method: awq``): ``X.qweight`` is ``in x out*bits/32`` int32, ``X.qzeros`` and
  ``X.scales`` per group of input rows;
- GPTQ (``gptq``): ``X.qweight`` is ``in*bits/32 x out`` int32, ``X.g_idx`` per input row;
- compressed-tensors pack-quantized (``compressed-tensors``, W4A16/W8A16): ``X.weight_packed``
  is ``out x in*bits/32`` int32, beside ``X.weight_shape`` and ``X.weight_scale``;
- FP8 and compressed-tensors' int8/float formats keep ``X.weight`` in its float shape (another
  dtype), so nothing needs translating.

Invariant: a shape is only added where the checkpoint has no ``X.weight`` of its own, and only
for a format named in the config; an unknown format adds nothing (the checks then refuse what
they cannot place, by name, as before).
"""

from __future__ import annotations

import math
import re
from typing import Any

_PACKED = {   # format -> (the packed tensor's suffix, which of its dimensions is packed)
    "awq": (".qweight", 1),
    "gptq": (".qweight", 0),
    "compressed-tensors": (".weight_packed", 1),
}


def quantization_config(config: dict[str, Any]) -> dict[str, Any] | None:
    """The ``quantization_config`` a model's ``config.json`` declares (a multimodal model's
    text part too), or None for a float model."""
    for part in (config, config.get("text_config") or {}):
        found = part.get("quantization_config") if isinstance(part, dict) else None
        if isinstance(found, dict):
            return found
    return None


def method(qc: dict[str, Any] | None) -> str:
    return str((qc or {}).get("quant_method") or "").lower()


def bits(qc: dict[str, Any]) -> int:
    """The weights' bits: AWQ's ``bits`` (``w_bit`` in older files), GPTQ's ``bits``,
    compressed-tensors' first config group's ``weights.num_bits``; 4 when none says."""
    for key in ("bits", "w_bit"):
        if isinstance(qc.get(key), int):
            return qc[key]
    found = _first_group_weights(qc).get("num_bits")
    return found if isinstance(found, int) else 4


def _first_group_weights(qc: dict[str, Any]) -> dict[str, Any]:
    """compressed-tensors' first config group's ``weights`` arguments ({} for other formats)."""
    for group in (qc.get("config_groups") or {}).values():
        weights = (group or {}).get("weights") if isinstance(group, dict) else None
        if isinstance(weights, dict):
            return weights
    return {}


def describe(qc: dict[str, Any] | None) -> str:
    """One line for the log and ``loractl status``: ``awq, 4-bit, groups of 128``; "" for none."""
    name = method(qc)
    if not name:
        return ""
    parts = [name]
    if name in _PACKED:
        parts.append(f"{bits(qc)}-bit")
    group = qc.get("group_size", _first_group_weights(qc).get("group_size")) if qc else None
    if isinstance(group, int) and group > 0:
        parts.append(f"groups of {group}")
    return ", ".join(parts)


def float_shapes(shapes: dict[str, tuple[int, ...]], qc: dict[str, Any] | None) -> dict[str, tuple[int, ...]]:
    """``shapes`` (a checkpoint's tensor name -> shape) with ``X.weight`` added, ``out x in``, for
    each layer ``X`` the quantization format packs."""
    packed = _PACKED.get(method(qc))
    if packed is None:
        return shapes
    suffix, packed_dim = packed
    factor = 32 // bits(qc or {})
    out = dict(shapes)
    for name, shape in shapes.items():
        if not name.endswith(suffix) or len(shape) != 2:
            continue
        module = name[: -len(suffix)]
        if f"{module}.weight" in shapes:
            continue
        rows, cols = shape
        if packed_dim == 0:
            rows *= factor
        else:
            cols *= factor
        # AWQ and GPTQ store in x out; compressed-tensors out x in.
        out[f"{module}.weight"] = (rows, cols) if suffix == ".weight_packed" else (cols, rows)
    return out


# The words a quantized upload's name adds to its float model's (TheBloke's "-GPTQ", Qwen's
# "-GPTQ-Int4", hugging-quants' "-AWQ-INT4", RedHatAI's "-quantized.w4a16", "-FP8-dynamic", ...).
_QUANT_WORDS = {"awq", "gptq", "gguf", "fp8", "int4", "int8", "w4a16", "w8a8", "w8a16", "w4a8", "nvfp4", "mxfp4",
                "bnb", "4bit", "8bit", "quantized", "dynamic", "marlin", "gemm", "gemv", "exl2", "compressed"}
_SEPARATOR = re.compile(r"[-_.]")


def float_name(name: str) -> str:
    """The float model a quantized upload's name points to: its trailing quantization words
    dropped (``Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4`` -> ``Qwen/Qwen2.5-7B-Instruct``), so that an
    adapter trained on the float model matches; ``name`` itself when it has none."""
    head, slash, last = name.rstrip("/").rpartition("/")
    cut = len(last)
    for match in reversed(list(_SEPARATOR.finditer(last))):
        if last[match.end():cut].lower() not in _QUANT_WORDS:
            break
        cut = match.start()
    if cut == len(last) or last[:cut].lower() in _QUANT_WORDS:   # nothing to drop, or nothing but such words
        return name
    return f"{head}{slash}{last[:cut]}"


# A quantized layer's tensors other than its float view: packed weights, zeros, scales, orders.
_AUXILIARY = (".qweight", ".qzeros", ".scales", ".g_idx", ".weight_packed", ".weight_scale", ".weight_zero_point",
              ".weight_shape", ".weight_g_idx", ".input_scale")


def parameter_count(shapes: dict[str, tuple[int, ...]]) -> int:
    """The model's parameters as its float model counts them: a packed layer by its float
    ``X.weight`` (``float_shapes``), not by its packed words, scales and zeros."""
    return sum(math.prod(shape) for name, shape in shapes.items() if not name.endswith(_AUXILIARY))


# Formats whose kernels vLLM's CPU wheel lacks, as run here: the engine dies in its start with an
# error naming an op, so they are refused before it, in one line.
_NOT_ON_CPU = {
    "fp8": "vLLM 0.32's CPU wheel has no FP8 kernels (its _C::static_scaled_fp8_quant is not built for the CPU)",
}


def cpu_refusal(name: str) -> str | None:
    """Why a base quantized as ``name`` (a checkpoint's ``quant_method`` or ``--quantization``)
    cannot run on the CPU, or None."""
    return _NOT_ON_CPU.get((name or "").lower())
