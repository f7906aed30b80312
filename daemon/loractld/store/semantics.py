"""What an adapter computes, checked against what PEFT computes and what the engine can hold.

``store.validate`` checks an adapter's form (files, headers, shapes, ranks); this module checks
its meaning, the part where a well-formed adapter can still be served wrong or poison the engine:

- ``Targets``: the modules PEFT applies it to (``target_modules``, ``exclude_modules``,
  ``target_parameters``, ``layers_to_transform``): a tensor for any other module is refused (PEFT
  never applies it; vLLM would), a ``target_modules`` pattern matching nothing is refused as PEFT
  refuses it, and a malformed pattern is :class:`InvalidAdapter`, never an internal error.
- ``check_scalings`` and ``check_values``: only finite weights, and scalings that float16 holds.
  One adapter's NaN or overflow was seen to change other requests' tokens (issue 37, finding 2).
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidAdapter
from loractld.models.weights import TensorInfo, read_safetensors_header
from loractld.store.peft import CONFIG_FILE, EMBEDDING_KEY, LORA_KEY, Ranks, compiled_pattern

# The largest scaling an adapter may have: float16's largest finite value. A scaling that alone
# overflows half precision (lora_alpha 1e38) turns every output it touches into inf or NaN.
MAX_SCALING = 65504.0
_VALUE_CHUNK = 16 << 20  # bytes of tensor data looked at per step (bounds the temporary arrays)
# The bits that make a value not finite, per safetensors dtype: (unsigned view, the mask all of whose bits
# are set in an inf or NaN, and only then).
# The largest weight accepted, float16's largest value: LoRA weights are small (well under 1 in
# a trained adapter); one that float16 cannot hold overflows an engine in half precision, and
# F64 weights beyond float32's range (1e300) become inf in a float32 engine.
MAX_WEIGHT = 65504.0
_FLOAT_VIEWS = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}   # BF16 is read through float32
_NONFINITE_BITS = {
    "F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
    "BF16": ("<u2", 0x7F80), "F8_E5M2": ("u1", 0x7C), "F8_E4M3": ("u1", 0x7F),   # E4M3: S.1111.111 is NaN
}


_LINEAR_EXCLUDED = ("lm_head", "embed_tokens")  # PEFT's all-linear leaves out the output layer; embeddings are not linear


@dataclass(frozen=True)
class Targets:
    """Which modules PEFT applies the adapter to (``peft.tuners.tuners_utils.check_target_module_exists``):
    ``target_modules`` (a regex matched in full, a list matched as names or dotted suffixes, or
    ``all-linear``), ``target_parameters``, ``exclude_modules``, ``layers_to_transform`` with
    ``layers_pattern``. A tensor for a module outside them is one PEFT never applies and vLLM
    would: refused, so the adapter is served as PEFT serves it (issue 37, finding 3)."""

    targets: object
    parameters: tuple
    exclude: object
    layers: object
    layers_pattern: tuple

    @classmethod
    def of(cls, config: dict) -> Targets:
        targets, exclude = config.get("target_modules"), config.get("exclude_modules")
        for field_name, value in (("target_modules", targets), ("exclude_modules", exclude)):
            if isinstance(value, str) and value != "all-linear":
                compiled_pattern(field_name, value)
            elif value is not None and not isinstance(value, (str, list)):
                raise InvalidAdapter(f"{CONFIG_FILE}: {field_name} is {value!r}, not a pattern or a list",
                                     "Fix the adapter's config.")
        pattern = config.get("layers_pattern") or ()
        pattern = (pattern,) if isinstance(pattern, str) else tuple(pattern)
        for p in pattern:
            compiled_pattern("layers_pattern", rf".*\.{p}\.(\d+)\.", p)
        layers = config.get("layers_to_transform")
        return cls(targets, tuple(config.get("target_parameters") or ()), exclude, layers, pattern)

    @staticmethod
    def _listed(key: str, names) -> bool:
        if isinstance(names, str):
            return re.fullmatch(names, key) is not None
        return any(key == n or key.endswith(f".{n}") for n in names or ())

    def _owns_parameter(self, key: str) -> bool:
        """PEFT saves a ``target_parameters`` LoRA under the module that owns the parameter, one
        ``.base_layer`` deeper for each further parameter of the same module
        (``mlp.experts.base_layer`` for gate_up_proj beside ``mlp.experts`` for down_proj)."""
        owner = re.sub(r"(\.base_layer)+$", "", key)
        return any(owner == o or owner.endswith(f".{o}") for o in (p.rpartition(".")[0] for p in self.parameters) if o)

    def applies_to(self, key: str) -> bool:
        if self.exclude and self._listed(key, self.exclude):
            return False
        if self.targets == "all-linear":
            found = key.rsplit(".", 1)[-1] not in _LINEAR_EXCLUDED
        else:
            found = bool(self.targets) and self._listed(key, self.targets)
        found = found or any(f"{key}.weight".endswith(p) for p in self.parameters) or self._owns_parameter(key)
        if not found or self.layers is None or self.layers == []:
            return found
        patterns = [rf".*\.{p}\.(\d+)\." for p in self.layers_pattern] or [r".*\.[^.]*\.(\d+)\."]
        index = next((m for m in (re.match(p, key) for p in patterns) if m is not None), None)
        if index is None:
            return False
        layers = self.layers if isinstance(self.layers, list) else [self.layers]
        return int(index.group(1)) in layers

    def check(self, tensors: dict[str, TensorInfo], base_shapes: dict | None) -> None:
        if base_shapes is not None and isinstance(self.targets, str) and self.targets != "all-linear":
            modules = {k.removesuffix(".weight") for k in base_shapes if k.endswith(".weight")}
            if not any(self.applies_to(m) for m in modules):
                raise InvalidAdapter(f"target_modules {self.targets!r} matches no module of the base model "
                                     "(PEFT refuses it: NoMatchingPeftModuleError)",
                                     "Fix the config's target_modules; the model's modules are named like "
                                     f"{sorted(modules)[0]!r}.")
        for name in tensors:
            match = LORA_KEY.match(name) or EMBEDDING_KEY.match(name)
            if match and not self.applies_to(match["module"]):
                raise InvalidAdapter(
                    f"tensor {name!r} is for module {match['module']!r}, which the config's target_modules"
                    f"{'/layers_to_transform' if self.layers not in (None, []) else ''} leave out: PEFT would not "
                    "apply it, vLLM would", "Fix the config's target_modules, or save the adapter again with PEFT.")


def _largest(numpy, bits, dtype: str) -> float:
    """The largest magnitude in a chunk of raw bits (finite values only; F8 cannot exceed MAX_WEIGHT)."""
    if dtype == "BF16":
        return float(numpy.abs((bits.astype(numpy.uint32) << 16).view(numpy.float32)).max())
    if dtype in _FLOAT_VIEWS:
        return float(numpy.abs(bits.view(_FLOAT_VIEWS[dtype])).max())
    return 0.0


def check_scalings(config: dict, ranks: Ranks) -> None:
    """Refuse a ``lora_alpha`` (or ``alpha_pattern`` value) that is not a finite number, and a
    scaling (alpha / r, or alpha / sqrt(r) with rsLoRA) beyond what float16 holds."""
    alphas = {"lora_alpha": config.get("lora_alpha", ranks.r)}
    pattern = config.get("alpha_pattern") or {}
    if not isinstance(pattern, dict):
        raise InvalidAdapter(f"{CONFIG_FILE} has an invalid alpha_pattern ({pattern!r})", "Fix or re-pull the adapter.")
    alphas.update({f"alpha_pattern[{k!r}]": v for k, v in pattern.items()})
    rsl = bool(config.get("use_rslora"))
    for where, alpha in alphas.items():
        if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or not _finite(alpha):
            shown = repr(alpha) if len(repr(alpha)) <= 40 else f"{repr(alpha)[:20]}... ({len(repr(alpha))} characters)"
            raise InvalidAdapter(f"{CONFIG_FILE}: {where} is {shown}, not a finite number",
                                 "Fix the adapter's config (lora_alpha is usually r or 2r).")
        for rank in {ranks.r, *ranks.pattern.values()}:
            scaling = abs(alpha) / (math.sqrt(rank) if rsl else rank)
            if scaling > MAX_SCALING:
                raise InvalidAdapter(
                    f"{CONFIG_FILE}: {where} = {alpha:g} at rank {rank} scales the adapter's output by {scaling:.3g}, "
                    f"beyond what half precision holds ({MAX_SCALING:g}): its outputs would overflow to inf/NaN",
                    "Fix the adapter's config (lora_alpha is usually r or 2r).")


def _finite(number: int | float) -> bool:
    try:
        return math.isfinite(number)
    except OverflowError:  # an integer too large for a float (10**400 is valid JSON)
        return False


def check_values(weights: Path) -> None:
    """Refuse a weights file holding a NaN or an infinity (a diverged float16 run saves such
    checkpoints): the tensor data is read once, as raw bits (no float conversion, numpy only),
    a bounded chunk at a time. Integer tensors have no such values and are skipped."""
    import mmap

    import numpy

    tensors = read_safetensors_header(weights)
    with open(weights, "rb") as f:
        (header_len,) = struct.unpack("<Q", f.read(8))
        base = 8 + header_len
        if f.seek(0, 2) <= base:
            return
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            header = json.loads(data[8:base])
            for name, info in tensors.items():
                if info.dtype not in _NONFINITE_BITS:
                    raise InvalidAdapter(f"tensor {name!r} is {info.dtype}: LoRA weights are floating point",
                                         "Save the adapter's weights in float32, bfloat16 or float16.")
                view, mask = _NONFINITE_BITS[info.dtype]
                start, end = (base + o for o in header[name]["data_offsets"])
                width = numpy.dtype(view).itemsize
                bad, largest = 0, 0.0
                for at in range(start, end, _VALUE_CHUNK):
                    chunk = numpy.frombuffer(data, dtype=view, count=(min(end, at + _VALUE_CHUNK) - at) // width,
                                             offset=at)
                    bad += int(numpy.count_nonzero((chunk & mask) == mask))
                    if not bad and chunk.size:
                        largest = max(largest, _largest(numpy, chunk, info.dtype))
                    del chunk  # the mmap cannot close while a view of it lives
                if bad:
                    raise InvalidAdapter(
                        f"tensor {name!r} holds {bad} value(s) that are not finite (NaN or inf)",
                        "The training run diverged (a float16 overflow, often): retrain, or use an earlier "
                        "checkpoint. Served, such an adapter was seen to change other requests' answers.")
                if largest > MAX_WEIGHT:
                    raise InvalidAdapter(
                        f"tensor {name!r} holds a weight of magnitude {largest:.3g}, beyond what half precision "
                        f"holds ({MAX_WEIGHT:g}): its outputs would overflow to inf/NaN",
                        "The adapter's weights are far outside a trained LoRA's range: retrain, or use an earlier "
                        "checkpoint.")
