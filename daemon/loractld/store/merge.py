"""Weighted merges of LoRA adapters: one new PEFT folder whose delta is the weighted sum of its
sources' deltas (``loractl merge``), pure file-to-file work (numpy; no torch, no engine).

For each module ``m``, source ``i`` adds ``w_i * s_i(m) * B_i A_i`` to the base weight, where
``s_i(m)`` is PEFT's scaling: ``alpha/r`` (``alpha/sqrt(r)`` with ``use_rslora``), with ``r`` and
``alpha`` read per module through ``rank_pattern``/``alpha_pattern`` as PEFT reads them.

Method ``cat`` (exact; PEFT's ``add_weighted_adapter(..., combination_type="cat")``): the ranks
are concatenated, ``A = [A_1; A_2; ...]`` and ``B = [w_1 s_1 B_1, w_2 s_2 B_2, ...]``, so that
``B A = sum_i w_i s_i B_i A_i`` exactly; the new adapter has ``r = lora_alpha = R`` (scaling 1,
no rsLoRA, no patterns) where ``R`` is the largest rank sum over its modules. A module that
only some sources have gets their blocks and zero rows/columns after them (PEFT pads the same
way), so each module's rank is ``R``.

Method ``svd`` (approximate, only when asked for, with a rank): each module's summed delta is
computed in float64 and truncated to its ``svd_rank`` leading singular values (PEFT's ``svd``
combination); the relative Frobenius error over all modules, ``||D - D_R|| / ||D||``, is
measured and reported.

Invariants:
- What cannot be merged exactly is refused by name (``InvalidAdapter``), and nothing is written:
  another base model, DoRA and the other LoRA variants, trained biases, whole modules saved,
  a rank sum above ``max_lora_rank`` (the refusal says which sources would fit, and the
  ``--svd-rank`` flag), scalings that are not finite.
- The output is a pure function of the sources' bytes, their order and the weights: the
  safetensors file has its tensors in sorted order with a fixed header, the config is sorted
  JSON with no timestamps or versions, so merging again gives the same bytes (the same digest).
- The weights are written in float32: sources in float16/bfloat16 widen exactly, and the
  scaled ``B`` blocks are not rounded to half precision.
"""

from __future__ import annotations

import json
import math
import re
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from loractl.errors import Cancelled, InvalidAdapter, InvalidRequest
from loractld.models.weights import read_safetensors_header
from loractld.store.peft import CONFIG_FILE, EMBEDDING_KEY, LORA_KEY, WEIGHTS_FILE, Ranks, next_supported_rank
from loractld.store.validate import model_names_match, read_config
from loractld.worker import hooks

METHODS = ("cat", "svd")
PREFIX = "base_model.model."
# Config switches that change what an adapter computes beyond B A: (key, what it is). A merge of
# their deltas as plain LoRA would be another adapter than the sum.
_VARIANTS = (
    ("use_dora", "DoRA (use_dora)"),
    ("lora_bias", "LoRA bias (lora_bias)"),
    ("trainable_token_indices", "trainable tokens (trainable_token_indices)"),
    ("layer_replication", "layer replication (layer_replication)"),
    ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
    ("modules_to_save", "whole modules saved (modules_to_save)"),
)
_NOT_EXACT = "Merge only plain LoRA adapters: a merge of this one's delta as plain LoRA would not be exact."
# The embedding layers' own weights PEFT saves beside a LoRA on them (save_embedding_layers): the
# base model's, which the engine ignores; they are left out of the merge.
_BASE_LAYER = re.compile(r"\.base_layer\.weight$")


@dataclass
class MergeReport:
    """What a merge made: its sources (folders) and weights as given, the method, the new rank,
    and for ``svd`` the measured relative Frobenius error of the truncation (0 for ``cat``)."""

    sources: list[str]
    weights: list[float]
    method: str
    rank: int
    relative_error: float = 0.0
    modules: int = 0
    notes: list[str] = field(default_factory=list)


@dataclass
class _Source:
    label: str
    config: dict
    ranks: Ranks
    pairs: dict[str, dict[str, object]]     # module -> {"A": array, "B": array, "embedding": bool}


def merge_adapters(sources: list[tuple[Path, float]], dest: Path, *, max_lora_rank: int, method: str = "cat",
                   svd_rank: int | None = None, labels: list[str] | None = None,
                   stopped: Callable[[], bool] | None = None) -> MergeReport:
    """Write into ``dest`` (an existing, empty folder) the merge of ``sources`` ((folder, weight)
    pairs, in order); ``labels`` name the sources in refusals (their store names), else their folders.
    ``stopped`` is asked between sources and between modules: True raises :class:`Cancelled`
    (its caller left), ``dest`` written no further."""
    import numpy as np

    def check() -> None:
        hooks.reached("merge-step")
        if stopped is not None and stopped():
            raise Cancelled("the merge was cancelled: nothing was installed", "Run it again.")

    labels = labels or [str(p) for p, _ in sources]
    weights = [float(w) for _, w in sources]
    _check_request(sources, weights, method, svd_rank, max_lora_rank)
    loaded = []
    for (path, _), label in zip(sources, labels):
        check()
        loaded.append(_load(path, label))
    base = _common_base(loaded)
    fan_in_fan_out = {bool(s.config.get("fan_in_fan_out")) for s in loaded}
    if len(fan_in_fan_out) > 1:
        raise InvalidAdapter("the sources disagree on fan_in_fan_out (their weights are laid out differently)",
                             "Merge adapters made for the same model.")
    modules = sorted(set().union(*(s.pairs for s in loaded)))
    for module in modules:
        _check_shapes(module, loaded)
    scales = [{m: _scaling(s, m) for m in s.pairs} for s in loaded]
    sums = {m: sum(s.ranks.of_module(m) for s in loaded if m in s.pairs) for m in modules}
    rank = max(sums.values())
    report = MergeReport(sources=labels, weights=weights, method=method, rank=rank, modules=len(modules))
    tensors: dict[str, object] = {}
    if method == "cat":
        if rank > max_lora_rank:
            raise _too_big(loaded, sums, rank, max_lora_rank)
        for module in modules:
            check()
            a, b = _concatenated(np, module, loaded, weights, scales, rank)
            tensors.update(_keys(module, loaded, a, b))
    else:
        rank = report.rank = svd_rank
        residual = total = 0.0
        for module in modules:
            check()
            a, b, lost, whole = _truncated(np, module, loaded, weights, scales, svd_rank)
            residual, total = residual + lost, total + whole
            tensors.update(_keys(module, loaded, a, b))
        report.relative_error = math.sqrt(residual / total) if total > 0 else 0.0
    check()
    config = _config(loaded, base, rank, modules, fan_in_fan_out.pop())
    dest.mkdir(parents=True, exist_ok=True)
    (dest / CONFIG_FILE).write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    write_safetensors(dest / WEIGHTS_FILE, tensors)
    return report


def _check_request(sources, weights, method, svd_rank, max_lora_rank) -> None:
    if not sources:
        raise InvalidRequest("nothing to merge", "Name two or more adapters: loractl merge NEW A=0.5 B=0.5.")
    bad = [w for w in weights if not math.isfinite(w)]
    if bad:
        raise InvalidRequest(f"merge weight {bad[0]!r} is not a finite number", "Give weights such as A=0.7 B=0.3.")
    if method not in METHODS:
        raise InvalidRequest(f"unknown merge method {method!r}", f"Use one of: {', '.join(METHODS)}.")
    if method == "svd":
        if svd_rank is None or svd_rank < 1:
            raise InvalidRequest("the svd merge needs a rank (--svd-rank R)", "Give --svd-rank R, R >= 1.")
        if svd_rank > max_lora_rank:
            raise InvalidRequest(f"--svd-rank {svd_rank} is above the daemon's max LoRA rank {max_lora_rank}",
                                 f"Use --svd-rank {max_lora_rank} or less.")
    elif svd_rank is not None:
        raise InvalidRequest("--svd-rank goes with the svd method only", "Drop --svd-rank for an exact merge.")


def _load(folder: Path, label: str) -> _Source:
    config = read_config(folder)
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise InvalidAdapter(f"{label} is not a LoRA adapter (peft_type {config.get('peft_type')!r})",
                             "Only LoRA adapters can be merged.")
    for key, what in _VARIANTS:
        if config.get(key):
            raise InvalidAdapter(f"{label} uses {what}: it cannot be merged exactly", _NOT_EXACT)
    if config.get("bias", "none") not in (None, "none"):
        raise InvalidAdapter(f"{label} trains the base model's biases (bias={config['bias']!r}): it cannot be "
                             "merged exactly", _NOT_EXACT)
    if config.get("target_parameters"):
        raise InvalidAdapter(f"{label} puts LoRA on parameters (target_parameters): it cannot be merged exactly",
                             _NOT_EXACT)
    ranks = Ranks.of(config)
    arrays = read_tensors(folder / WEIGHTS_FILE)
    pairs: dict[str, dict[str, object]] = {}
    for key, array in arrays.items():
        if _BASE_LAYER.search(key):
            continue
        match = LORA_KEY.match(key) or EMBEDDING_KEY.match(key)
        if match is None or array.ndim != 2:
            raise InvalidAdapter(f"{label}: tensor {key!r} is not a LoRA weight", _NOT_EXACT)
        pair = pairs.setdefault(match["module"], {"embedding": EMBEDDING_KEY.match(key) is not None})
        pair[match["ab"]] = array
    for module, pair in sorted(pairs.items()):
        if "A" not in pair or "B" not in pair:
            raise InvalidAdapter(f"{label}: module {module!r} has one LoRA factor without the other",
                                 "The adapter is incomplete: pull it again.")
        if pair["A"].shape[0] != ranks.of_module(module) or pair["B"].shape[1] != ranks.of_module(module):
            raise InvalidAdapter(f"{label}: module {module!r} has rank {pair['A'].shape[0]}, its config says "
                                 f"{ranks.of_module(module)}", "The adapter's config does not match its weights.")
    if not pairs:
        raise InvalidAdapter(f"{label} holds no LoRA weights", "Pull the complete adapter.")
    return _Source(label, config, ranks, pairs)


def _common_base(loaded: list[_Source]) -> str | None:
    named = [(s.label, str(s.config["base_model_name_or_path"])) for s in loaded
             if s.config.get("base_model_name_or_path")]
    for label, base in named[1:]:
        if not model_names_match(base, {named[0][1]}):
            raise InvalidAdapter(f"{named[0][0]} was trained for {named[0][1]!r} and {label} for {base!r}: "
                                 "adapters of different base models cannot be merged",
                                 "Merge adapters made for the same base model.")
    return named[0][1] if named else None


def _check_shapes(module: str, loaded: list[_Source]) -> None:
    shapes = {(s.label, s.pairs[module]["B"].shape[0], s.pairs[module]["A"].shape[1], s.pairs[module]["embedding"])
              for s in loaded if module in s.pairs}
    if len({shape[1:] for shape in shapes}) > 1:
        seen = ", ".join(f"{label}: {out}x{inp}" for label, out, inp, _ in sorted(shapes))
        raise InvalidAdapter(f"module {module!r} has different shapes in the sources ({seen})",
                             "Merge adapters made for the same model.")


def _pattern_value(pattern: dict, module: str, default):
    """PEFT's ``get_pattern_key``: the first key matching a dotted suffix of the module's name."""
    for key, value in pattern.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _scaling(source: _Source, module: str) -> float:
    rank = source.ranks.of_module(module)
    alpha = _pattern_value(source.config.get("alpha_pattern") or {}, module, source.config.get("lora_alpha", 8))
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or not math.isfinite(alpha):
        raise InvalidAdapter(f"{source.label}: lora_alpha {alpha!r} for {module!r} is not a number",
                             "Fix the adapter's config.")
    return alpha / (math.sqrt(rank) if source.config.get("use_rslora") else rank)


def _too_big(loaded: list[_Source], sums: dict[str, int], rank: int, max_lora_rank: int) -> InvalidAdapter:
    widest = max(sums, key=lambda m: sums[m])
    each = ", ".join(f"{s.label} {s.ranks.of_module(widest) if widest in s.pairs else 0}" for s in loaded)
    fits, used = [], 0
    for s in loaded:  # the sources, in order, whose ranks fit together
        width = max(s.ranks.largest, 0)
        if used + width <= max_lora_rank:
            fits.append(s.label)
            used += width
    subset = f"merge {' and '.join(fits)} only, " if 1 < len(fits) < len(loaded) else ""
    return InvalidAdapter(
        f"the merged rank would be {rank} ({each} on {widest!r}), above the daemon's max LoRA rank {max_lora_rank}",
        f"An exact merge concatenates the ranks: {subset}or approximate it with --svd-rank {max_lora_rank} "
        f"(show reports its error), or restart the daemon with --max-lora-rank {next_supported_rank(rank)}.")


def _concatenated(np, module, loaded, weights, scales, rank):
    a_blocks, b_blocks = [], []
    for source, weight, scale in zip(loaded, weights, scales):
        if module in source.pairs:
            a_blocks.append(source.pairs[module]["A"].astype(np.float64))
            b_blocks.append(source.pairs[module]["B"].astype(np.float64) * (weight * scale[module]))
    a, b = np.concatenate(a_blocks, axis=0), np.concatenate(b_blocks, axis=1)
    pad = rank - a.shape[0]
    a = np.concatenate([a, np.zeros((pad, a.shape[1]))], axis=0)
    b = np.concatenate([b, np.zeros((b.shape[0], pad))], axis=1)
    return a.astype(np.float32), b.astype(np.float32)


def _truncated(np, module, loaded, weights, scales, rank):
    b_all = np.concatenate([source.pairs[module]["B"].astype(np.float64) * (weight * scale[module])
                            for source, weight, scale in zip(loaded, weights, scales) if module in source.pairs], axis=1)
    a_all = np.concatenate([source.pairs[module]["A"].astype(np.float64)
                            for source in loaded if module in source.pairs], axis=0)
    delta = b_all @ a_all   # sum_i w_i s_i B_i A_i
    # delta's rank is at most the rank sum R: its SVD from two thin QRs and the SVD of an R x R
    # core (exact) instead of a full SVD of delta (d^3 per module: 36 s for three rank-8
    # adapters of a 135M model, issue 60, item 12; this is milliseconds).
    qb, rb = np.linalg.qr(b_all)
    qa, ra = np.linalg.qr(a_all.T)
    core_u, s, core_vt = np.linalg.svd(rb @ ra.T)
    u, vt = qb @ core_u, core_vt @ qa.T
    kept = min(rank, s.shape[0])
    b = np.zeros((delta.shape[0], rank))
    a = np.zeros((rank, delta.shape[1]))
    b[:, :kept] = u[:, :kept] * s[:kept]
    a[:kept] = vt[:kept]
    # What the truncation leaves out, measured on the float32 factors that are written.
    b32, a32 = b.astype(np.float32), a.astype(np.float32)
    lost = float(np.sum((delta - b32.astype(np.float64) @ a32.astype(np.float64)) ** 2))
    return a32, b32, lost, float(np.sum(delta ** 2))


def _keys(module: str, loaded: list[_Source], a, b) -> dict[str, object]:
    embedding = next(s.pairs[module]["embedding"] for s in loaded if module in s.pairs)
    if embedding:
        return {f"{PREFIX}{module}.lora_embedding_A": a, f"{PREFIX}{module}.lora_embedding_B": b}
    return {f"{PREFIX}{module}.lora_A.weight": a, f"{PREFIX}{module}.lora_B.weight": b}


def _config(loaded: list[_Source], base: str | None, rank: int, modules: list[str], fan_in_fan_out: bool) -> dict:
    """The merged adapter's config: plain LoRA, scaling 1, aimed at exactly the modules it has
    (full module paths: a source's ``layers_to_transform`` or ``exclude_modules`` stays honoured)."""
    task_types = {s.config.get("task_type") for s in loaded}
    return {
        "peft_type": "LORA", "task_type": task_types.pop() if len(task_types) == 1 else None,
        "base_model_name_or_path": base, "r": rank, "lora_alpha": rank, "use_rslora": False,
        "rank_pattern": {}, "alpha_pattern": {}, "target_modules": modules, "bias": "none",
        "lora_dropout": 0.0, "fan_in_fan_out": fan_in_fan_out, "init_lora_weights": True,
        "modules_to_save": None, "inference_mode": True,
    }


# -- safetensors, read and written with numpy ---------------------------------------------------
_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2"}


def read_tensors(path: Path) -> dict[str, object]:
    """Every tensor of a safetensors file as a numpy array, floats as float32 or float64 (bfloat16
    is widened exactly: its bits are float32's upper half). The header is checked first."""
    import numpy as np

    infos = read_safetensors_header(path)
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        data = f.read()
    arrays = {}
    for name, info in infos.items():
        start, end = header[name]["data_offsets"]
        raw = data[start:end]
        if info.dtype == "BF16":
            array = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        elif info.dtype in _NUMPY:
            array = np.frombuffer(raw, dtype=_NUMPY[info.dtype])
        else:
            raise InvalidAdapter(f"{path.name}: tensor {name!r} is {info.dtype}, not a float",
                                 "Only float LoRA weights can be merged.")
        arrays[name] = array.reshape(info.shape)
    return arrays


def write_safetensors(path: Path, tensors: dict[str, object]) -> None:
    """Float32 tensors in sorted key order behind a fixed header: the same tensors, the same bytes."""
    import numpy as np

    header, chunks, offset = {"__metadata__": {"format": "pt"}}, [], 0
    for name in sorted(tensors):
        raw = np.ascontiguousarray(tensors[name], dtype="<f4").tobytes()
        header[name] = {"dtype": "F32", "shape": list(tensors[name].shape), "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    encoded = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(encoded)))
        f.write(encoded)
        for chunk in chunks:
            f.write(chunk)
