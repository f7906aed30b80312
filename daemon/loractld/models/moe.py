"""Mixture-of-experts bases: what loractl serves on them, and where.

vLLM wraps a fused-MoE layer in ``FusedMoEWithLoRA`` whenever LoRA is on; its kernels are Triton's,
which the CPU does not have: with LoRA on, the first request on a MoE base killed the engine on
the CPU (``triton.language has no attribute float32``, vLLM 0.32's CPU wheel; vLLM's own server
dies the same way). On the CPU loractl therefore restricts vLLM's LoRA layers to the attention and
dense projections (vLLM's ``lora_target_modules``), so the experts run on vLLM's CPU MoE path.

Adapters that train the experts come in two forms, and vLLM 0.32 takes one per architecture
(``vllm/lora/model_manager.py``, ``is_3d_moe_weight``):

- **per-expert** modules, ``mlp.experts.N.gate_proj`` / ``up_proj`` / ``down_proj`` (or Mixtral's
  ``w1``/``w3``/``w2``), as PEFT writes them on transformers < 5: every MoE model but those below;
- **fused**: PEFT's ``target_parameters`` on ``mlp.experts.gate_up_proj`` and ``down_proj``, saved as
  ``mlp.experts.base_layer.lora_*`` (gate and up) and ``mlp.experts.lora_*`` (down), rank x experts
  rows: the models vLLM loads with 3D expert weights (``VLLM_3D_EXPERT_ARCHITECTURES``).

On the CPU every expert adapter is refused by name (no kernel runs it). On a GPU one is served
when its form is the one vLLM takes for the architecture and ``check_expert_adapter`` finds its
expert counts and shapes right; otherwise it is refused by name before the engine sees it.

Invariants:
- A user's ``--lora-target-modules`` is never replaced.
- An adapter is served whole or refused: never with its expert deltas dropped, and never with
  only some of a layer's experts (vLLM packs a layer's experts together).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidAdapter

# The config keys transformers' MoE configs name their routed experts by.
_EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_num_experts")
# vLLM's module suffixes for attention and dense MLPs (packed and unpacked spellings); "experts" is
# the fused-MoE layer, left out on the CPU.
DENSE_LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "qkv_proj", "o_proj", "gate_proj", "up_proj", "gate_up_proj",
                      "down_proj"]
_EXPERT_MODULE = re.compile(r"(^|\.)experts(\.|$)")
_PER_EXPERT = re.compile(r"^(?P<layer>.+)\.experts\.(?P<expert>\d+)\.(?P<proj>[^.]+)$")
_FUSED = re.compile(r"^(?P<layer>.+)\.experts(?P<gate_up>\.base_layer)?$")
# The gated projections of one expert, in vLLM's spelling and Mixtral's.
_EXPERT_PROJECTIONS = {"gate_proj", "up_proj", "down_proj", "w1", "w2", "w3"}

# vLLM 0.32's architectures whose experts it loads as 3D weights (``is_3d_moe_weight = True``):
# their expert LoRA is PEFT's fused ``target_parameters`` form (tests/test_vllm_seam.py reads
# vLLM's sources for this list).
VLLM_3D_EXPERT_ARCHITECTURES = frozenset({
    "GptOssForCausalLM", "InternS1ProForConditionalGeneration", "Qwen3_5MoeForConditionalGeneration",
    "Qwen3OmniMoeForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"})
PER_EXPERT, FUSED = "per-expert", "fused"


@dataclass(frozen=True)
class ExpertBase:
    """A mixture-of-experts base as expert adapters are checked against it.

    ``form`` is the expert LoRA vLLM serves for it on this device: ``PER_EXPERT``, ``FUSED``, or
    "" where none runs (the CPU). ``hidden`` and ``intermediate`` are one expert's input and
    hidden widths (0 when the config does not say)."""

    experts: int
    architecture: str
    form: str
    hidden: int = 0
    intermediate: int = 0


def expert_base(config: dict, device: str) -> ExpertBase | None:
    """The base's experts as its config declares them, on ``device`` (None for a dense model)."""
    experts = expert_count(config)
    if not experts:
        return None
    text = config.get("text_config") or config
    architecture = next(iter(config.get("architectures") or ()), "")
    form = "" if device != "cuda" else FUSED if architecture in VLLM_3D_EXPERT_ARCHITECTURES else PER_EXPERT
    hidden = text.get("hidden_size")
    intermediate = text.get("moe_intermediate_size") or text.get("intermediate_size")
    return ExpertBase(experts, architecture, form, hidden if isinstance(hidden, int) else 0,
                      intermediate if isinstance(intermediate, int) else 0)


def expert_count(config: dict) -> int:
    """The routed experts per MoE layer a model config declares (0 for a dense model)."""
    text = config.get("text_config") or config
    for key in _EXPERT_KEYS:
        value = text.get(key)
        if isinstance(value, int) and value > 1:
            return value
    return 0


def folder_expert_count(folder: str | Path) -> int:
    try:
        return expert_count(json.loads((Path(folder) / "config.json").read_text()))
    except (OSError, ValueError):
        return 0


def expert_targets(modules: Iterable[str], config: dict) -> list[str]:
    """The adapter's module names (and ``target_parameters``) that train experts."""
    found = [m for m in modules if _EXPERT_MODULE.search(m)]
    found += [str(p) for p in config.get("target_parameters") or () if _EXPERT_MODULE.search(str(p))]
    return sorted(set(found))


def check_expert_adapter(pairs: dict[str, dict[str, tuple[int, ...]]], config: dict, base: ExpertBase,
                         rank_of: Callable[[str], int], base_shapes: dict | None = None) -> set[str]:
    """Refuse an adapter whose expert modules this device, vLLM's form for the architecture, or
    the base's expert counts and shapes do not fit; return the expert modules it checked.

    ``pairs``: module -> {"A": shape, "B": shape} from the adapter's tensors. Per-expert shapes
    are left to the caller's check against the base's per-expert weights; fused ones, which
    have no weight of the same name in the base, are checked here against its widths."""
    trained = expert_targets(pairs, config)
    if not trained:
        return set()
    what = (f"the adapter trains the experts of this mixture-of-experts base ({base.experts} experts a layer; "
            f"{trained[0]}{f' and {len(trained) - 1} more' if len(trained) > 1 else ''})")
    if not base.form:
        raise InvalidAdapter(f"{what}: no CPU kernel runs expert LoRA (vLLM's fused-MoE LoRA is Triton's, on a GPU)",
                             "Serve it on a GPU, or use an adapter trained on the attention projections "
                             "(PEFT target_modules q_proj, k_proj, v_proj, o_proj).")
    fused = {m: _FUSED.match(m) for m in pairs if _FUSED.match(m)}
    per_expert = {m: _PER_EXPERT.match(m) for m in pairs if _PER_EXPERT.match(m)}
    form = FUSED if fused else PER_EXPERT if per_expert else ""
    if form != base.form:
        wanted = ("PEFT's target_parameters on mlp.experts.gate_up_proj and down_proj" if base.form == FUSED
                  else "per-expert modules (mlp.experts.N.gate_proj, up_proj, down_proj)")
        raise InvalidAdapter(f"{what}: for {base.architecture or 'this architecture'} vLLM serves expert LoRA as "
                             f"{wanted} only, and this adapter's are {form or 'in neither form'}",
                             "Use an adapter trained in that form, or one without expert modules.")
    if fused:
        _check_fused(pairs, fused, base, rank_of, what)
    else:
        _check_per_expert(pairs, per_expert, base, what, base_shapes)
    return set(fused) | set(per_expert)


def _check_fused(pairs, fused, base: ExpertBase, rank_of, what: str) -> None:
    layers: dict[str, dict[str, str]] = {}
    for module, match in fused.items():
        layers.setdefault(match["layer"], {})["gate_up" if match["gate_up"] else "down"] = module
    for layer, found in sorted(layers.items()):
        if set(found) != {"gate_up", "down"}:
            raise InvalidAdapter(f"{what}: {layer} has only its experts' {next(iter(found)).replace('_', '/')} "
                                 "projection; vLLM serves PEFT's fused form only with both gate_up_proj and down_proj",
                                 "Train it with target_parameters on both mlp.experts.gate_up_proj and down_proj.")
        for part, module in found.items():
            (a_rows, a_in), (b_out, b_cols) = pairs[module]["A"], pairs[module]["B"]
            rows = rank_of(module) * base.experts
            width_in, width_out = ((base.hidden, 2 * base.intermediate) if part == "gate_up"
                                   else (base.intermediate, base.hidden))
            if a_rows != rows or b_cols != rows:
                raise InvalidAdapter(f"{what}: {module} holds {a_rows} rank rows, not rank x experts = {rows}: "
                                     "it was trained for a base with another number of experts",
                                     "Pull an adapter trained on this base.")
            if (width_in and a_in != width_in) or (base.intermediate and b_out != width_out):
                raise InvalidAdapter(f"{what}: {module} maps {a_in} -> {b_out}, but this base's experts map "
                                     f"{width_in} -> {width_out}", "Pull an adapter trained on this base.")


def _check_per_expert(pairs, per_expert, base: ExpertBase, what: str, base_shapes: dict | None) -> None:
    """vLLM packs a layer's experts into one LoRA (``PackedLoRALayerWeights.pack_moe``): every
    expert, each projection the base's experts have, one rank per projection."""
    layers: dict[str, dict[str, dict[int, int]]] = {}
    for module, match in per_expert.items():
        if match["proj"] not in _EXPERT_PROJECTIONS:
            raise InvalidAdapter(f"{what}: {module} is not an expert projection vLLM serves LoRA on",
                                 "Use an adapter trained on the experts' gate, up and down projections.")
        expert = int(match["expert"])
        if expert >= base.experts:
            raise InvalidAdapter(f"{what}: {module} is expert {expert}, but this base has {base.experts} a layer",
                                 "Pull an adapter trained on this base.")
        layers.setdefault(match["layer"], {}).setdefault(match["proj"], {})[expert] = pairs[module]["A"][0]
    for layer, projections in sorted(layers.items()):
        has = {p for p in _EXPERT_PROJECTIONS if f"{layer}.experts.0.{p}.weight" in (base_shapes or {})}
        missing = sorted((has or set(projections)) - set(projections))
        if missing:
            raise InvalidAdapter(f"{what}: {layer} trains its experts' {', '.join(sorted(projections))} but not "
                                 f"{', '.join(missing)}; vLLM packs every projection of a layer's experts together",
                                 "Train the adapter on all of the experts' projections (gate_proj, up_proj, down_proj).")
        for proj, ranks in sorted(projections.items()):
            if len(ranks) != base.experts:
                raise InvalidAdapter(f"{what}: {layer} trains {proj} on {len(ranks)} of its {base.experts} experts; "
                                     "vLLM packs a layer's experts together, and would serve the rest as another model",
                                     "Train the adapter on every expert of each layer it targets.")
            if len(set(ranks.values())) > 1:
                raise InvalidAdapter(f"{what}: {layer}'s experts have different ranks for {proj} "
                                     f"({', '.join(map(str, sorted(set(ranks.values()))))}), which vLLM cannot pack",
                                     "Train the experts of a layer with one rank (no rank_pattern between them).")
