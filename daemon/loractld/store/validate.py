"""Adapter validation: everything checked before an adapter is installed or loaded.

Each check refuses with one :class:`InvalidAdapter` line and a hint, and reads only what it
needs: JSON files, safetensors *headers*, and (``store.semantics``) the tensor data once as raw
bits. Weights are never unpickled (``.bin`` is refused).

Invariant: an adapter that passes ``validate_adapter`` against a base model's shapes has only
LoRA A/B tensors for modules the base model has and its config targets as PEFT reads it, with
shapes that fit them, a rank within the daemon's limit, well-formed, complete safetensors
files, only finite weights, and scalings that half precision holds (``store.semantics``).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidAdapter
from loractld.store import normalize, semantics
# The store's other modules and the tests take the file names from here.
from loractld.store.peft import CONFIG_FILE, EMBEDDING_KEY, LORA_KEY, WEIGHTS_FILE, Ranks  # noqa: F401
from loractld.models.moe import ExpertBase
from loractld.models.quantized import float_name
# The store's checks and the tests take these from here; they read any weights file, the base model's too.
from loractld.models.weights import (MAX_HEADER_BYTES, TensorInfo, base_model_shapes,  # noqa: F401
                                     read_safetensors_header)

MAX_CONFIG_BYTES = 1 << 20
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30


# Raised whenever what validation accepts changes: facts kept by an earlier run
# (``store.known``) are then validated again.
VALIDATION_VERSION = 1


@dataclass
class AdapterFacts:
    """What validation learned about an adapter. Not its parsed config: nothing read it, and the
    resolver keeps the facts of every adapter (10,000 configs were 17.7 MiB of the daemon)."""

    rank: int
    alpha: float
    target_modules: list[str]
    base_model: str | None


def model_names_match(adapter_base: str, model_names: set[str]) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the running model.

    Compares whole ids and last path components, case-insensitively, so that
    ``meta-llama/Llama-3.1-8B`` matches a local folder ``/models/Llama-3.1-8B``; an adapter
    trained with QLoRA on a pre-quantized upload (``unsloth/llama-3-8b-bnb-4bit``) also names
    its float model (``models.quantized.float_name``).
    """
    def forms(name: str) -> set[str]:
        name = name.strip().rstrip("/").lower()
        return {name, name.rsplit("/", 1)[-1]} - {""}

    wanted = forms(adapter_base) | forms(float_name(adapter_base))
    return any(wanted & forms(n) for n in model_names)


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        bin_only = (folder / "adapter_model.bin").exists()
        raise InvalidAdapter(
            f"not a PEFT LoRA adapter: {CONFIG_FILE} is missing in {folder}",
            "Only PEFT adapters are supported: a folder with adapter_config.json and adapter_model.safetensors."
            if not bin_only else "This looks like a PEFT adapter without its config; pull the complete adapter.",
        )
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidAdapter(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes",
                             "That is not an adapter config; check the source.")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{CONFIG_FILE} is not valid JSON: {e}", "Fix or re-pull the adapter.") from e
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{CONFIG_FILE} is not a JSON object", "Fix or re-pull the adapter.")
    return config


def validate_adapter(
    folder: Path,
    *,
    max_lora_rank: int,
    base_shapes: dict[str, tuple[int, ...]] | None = None,
    model_names: set[str] | None = None,
    force: bool = False,
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
    experts: ExpertBase | None = None,
) -> AdapterFacts:
    """Check an adapter folder; return its facts or raise :class:`InvalidAdapter`.

    ``base_shapes`` (weight name -> shape) enables the module and shape checks;
    ``model_names`` enables the base-model check, which ``force`` skips; ``experts`` (a
    mixture-of-experts base, None for a dense one) checks the adapter's expert modules
    against it and the device (``models.moe.check_expert_adapter``).
    """
    config = read_config(folder)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}",
                             "vLLM serves LoRA adapters only (peft_type LORA); IA3, LoHa, LoKr, prefix "
                             "tuning and other PEFT methods cannot be served.")
    _refuse_unservable_features(config)
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").exists():
            raise InvalidAdapter(
                "the adapter's weights are only in pickle format (adapter_model.bin), which loractl never loads",
                "Convert them to safetensors (PEFT's save_pretrained(safe_serialization=True)) and pull again.",
            )
        raise InvalidAdapter(f"{WEIGHTS_FILE} is missing", "Pull the complete adapter.")
    if weights.stat().st_size > max_weights_bytes:
        raise InvalidAdapter(
            f"{WEIGHTS_FILE} is {weights.stat().st_size} bytes, over the cap of {max_weights_bytes}",
            "Raise the daemon's --max-adapter-size if this adapter is really that large.",
        )
    ranks = Ranks.of(config)
    ranks.check_limit(max_lora_rank)
    base = config.get("base_model_name_or_path") or None
    if base and model_names and not force and not model_names_match(str(base), model_names):
        raise InvalidAdapter(
            f"the adapter was trained for {base!r}, but the daemon runs {sorted(model_names)[0]!r}",
            "Pull an adapter for this model, or add --force if you know the architectures match.",
        )
    tensors = read_safetensors_header(weights)
    _refuse_unnormalized_keys(list(tensors))
    fused_experts: set[str] = set()
    if experts is not None:
        fused_experts = _check_experts(tensors, config, experts, ranks, base_shapes)
    modules = _check_tensors(tensors, ranks, base_shapes, checked=fused_experts)
    semantics.Targets.of(config).check(tensors, base_shapes)
    semantics.check_scalings(config, ranks)
    semantics.check_values(weights)
    alpha = config.get("lora_alpha", ranks.r)
    return AdapterFacts(rank=ranks.largest, alpha=float(alpha) if isinstance(alpha, (int, float)) else float(ranks.r),
                        target_modules=sorted(modules), base_model=base)


def _check_experts(tensors: dict[str, TensorInfo], config: dict, experts: ExpertBase, ranks: Ranks,
                   base_shapes: dict | None) -> set[str]:
    """The adapter's expert modules against the base (``models.moe``); returns the fused ones,
    whose shapes that check covers (they have no weight of their name in the base)."""
    from loractld.models.moe import FUSED, check_expert_adapter

    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        match = LORA_KEY.match(name)
        if match and len(info.shape) == 2:
            pairs.setdefault(match["module"], {})[match["ab"]] = info.shape
    checked = check_expert_adapter({m: ab for m, ab in pairs.items() if set(ab) == {"A", "B"}}, config, experts,
                                   ranks.of_module, base_shapes)
    return checked if experts.form == FUSED else set()


def _refuse_unnormalized_keys(keys: list[str]) -> None:
    """A folder used in place (``--lora /path``, placed by hand) is never rewritten; a pull
    normalises these spellings first (``store.normalize``), so this fires for those only."""
    respelled = normalize.needs_normalizing(keys)
    if respelled:
        raise InvalidAdapter(f"the tensor keys are not in PEFT's standard layout, which vLLM needs (a pull "
                             f"{' and '.join(respelled)})",
                             "Pull it into the store (loractl pull FOLDER --name NAME): the pull rewrites the keys.")


_RETRAIN = "Retrain without it, or merge the adapter into the base model (PEFT's merge_and_unload) and serve that model."
# Config switches that change what the adapter computes and that vLLM cannot serve: (key, what it is).
_UNSERVABLE = (
    ("use_dora", "DoRA (use_dora): vLLM has no weight-decomposed LoRA"),
    ("lora_bias", "LoRA bias (lora_bias): vLLM adds no bias to LoRA's output"),
    ("trainable_token_indices", "trainable tokens (trainable_token_indices): vLLM cannot change embedding rows"),
    ("layer_replication", "layer replication (layer_replication)"),
    ("alora_invocation_tokens", "Activated LoRA (alora_invocation_tokens)"),
    ("use_qalora", "QALoRA (use_qalora)"),
    ("use_bdlora", "block-diagonal LoRA (use_bdlora)"),
)


def _refuse_unservable_features(config: dict) -> None:
    for key, feature in _UNSERVABLE:
        if config.get(key):
            raise InvalidAdapter(f"the adapter uses {feature}", _RETRAIN)
    bias = config.get("bias", "none")
    if bias not in (None, "none"):
        raise InvalidAdapter(f"the adapter trains the base model's biases (bias={bias!r}): vLLM serves LoRA deltas "
                             "only", _RETRAIN)
    saved = config.get("modules_to_save")
    if saved:
        raise InvalidAdapter(f"the adapter replaces whole modules (modules_to_save: {', '.join(map(str, saved))}): "
                             "vLLM serves LoRA deltas only", _RETRAIN)


_NOT_LORA = (
    (re.compile(r"\.lora_magnitude_vector(\.[^.]+)?(\.weight)?$"), "a DoRA magnitude: the adapter uses DoRA (use_dora)"),
    (re.compile(r"\.lora_[AB](\.[^.]+)?\.bias$"), "a LoRA bias: the adapter uses LoRA bias (lora_bias)"),
    (re.compile(r"trainable_tokens_"), "a trainable-tokens delta: the adapter uses trainable tokens"),
    (re.compile(r"\.(modules_to_save\.[^.]+\.|original_module\.)?(weight|bias)$"),
     "a whole module's weights (modules_to_save or a resized embedding): vLLM serves LoRA deltas only"),
)
# PEFT saves the embedding layers' own weights beside a LoRA on them (save_embedding_layers);
# vLLM ignores them, which is right only while they are the base model's.
_BASE_EMBEDDING = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+\.)?(?P<name>embed_tokens|lm_head)\.base_layer\.weight$")


def _check_tensors(tensors: dict[str, TensorInfo], ranks: Ranks, base_shapes: dict | None,
                   checked: set[str] = frozenset()) -> set[str]:
    """Every LoRA pair's ranks, and its shape against the base's weight of the same name (but
    for ``checked``: fused expert modules, whose shapes ``models.moe`` checked); returns the
    modules' short names."""
    if not tensors:
        raise InvalidAdapter(f"{WEIGHTS_FILE} holds no tensors", "Pull the complete adapter.")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        embedding = _BASE_EMBEDDING.match(name)
        if embedding:
            _check_base_embedding(name, info, f"{embedding['module'] or ''}{embedding['name']}", base_shapes)
            continue
        match = LORA_KEY.match(name) or EMBEDDING_KEY.match(name)
        if not match:
            what = next((what for pattern, what in _NOT_LORA if pattern.search(name)), None)
            if what is not None:
                raise InvalidAdapter(f"tensor {name!r} is {what}", _RETRAIN)
            if base_shapes is not None:
                raise InvalidAdapter(f"tensor {name!r} is not a LoRA weight",
                                     "The adapter holds weights loractl does not know; it cannot be served.")
            continue
        if len(info.shape) != 2:
            raise InvalidAdapter(f"tensor {name!r} has shape {list(info.shape)}, expected 2 dimensions",
                                 "The adapter is malformed.")
        pairs.setdefault(match["module"], {})[match["ab"]] = info.shape
    short_names = set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not its pair",
                                 "The adapter is incomplete: pull it again.")
        if module in checked:   # rank x experts rows, checked by models.moe
            short_names.add("experts")
            continue
        (a_rank, a_in), (b_out, b_rank) = ab["A"], ab["B"]
        rank = ranks.of_module(module)
        if a_rank != rank or b_rank != rank:
            source = "its rank_pattern" if rank != ranks.r else f"r={rank}"
            raise InvalidAdapter(f"module {module!r} has rank {a_rank}/{b_rank}, but the config ({source}) says {rank}",
                                 "The adapter's config does not match its weights.")
        short_names.add(module.rsplit(".", 1)[-1])
        if base_shapes is None:
            continue
        base = base_shapes.get(f"{module}.weight")
        if base is None:
            raise InvalidAdapter(
                f"the base model has no module {module!r} (targeted by the adapter)",
                "This adapter was trained for a different architecture; pull one for this model.",
            )
        # An embedding's LoRA maps token ids in and hidden states out: its A spans the vocabulary.
        want = (base[1], base[0]) if _is_embedding(module) else (base[0], base[1]) if len(base) == 2 else None
        if want is None or (b_out, a_in) != want:
            raise InvalidAdapter(
                f"module {module!r}: the adapter's shape {b_out}x{a_in} does not fit the base model's "
                f"{'x'.join(map(str, base))}",
                "This adapter was trained for a different model size; pull one for this model.",
            )
    return short_names


def _is_embedding(module: str) -> bool:
    return module.rsplit(".", 1)[-1] == "embed_tokens"


def _check_base_embedding(name: str, info: TensorInfo, module: str, base_shapes: dict | None) -> None:
    base = base_shapes.get(f"{module}.weight") if base_shapes is not None else None
    if base is not None and tuple(info.shape) != tuple(base):
        raise InvalidAdapter(
            f"the adapter's {module} has shape {'x'.join(map(str, info.shape))}, the model's "
            f"{'x'.join(map(str, base))}: it was trained with added tokens (a resized vocabulary)",
            "vLLM serves an adapter on the model's own vocabulary only; retrain without new tokens.")
