"""Adapters made by PEFT itself on the tiny model, as users hold them (issue 21).

Each case is a PEFT config (and, for export mistakes, a way of saving) applied with
``get_peft_model`` to the tiny model, with every adapter weight set from a fixed seed (PEFT
initialises lora_B to zero: an adapter that does nothing would pass any comparison). The
case says what loractl must do with it: serve it token-identical to PEFT, or refuse it at
pull naming its feature.

``build(case, model_dir, dest)`` writes the adapter folder as the user has it, and returns
the folder PEFT itself loads for the reference (the same one, except for export mistakes,
where it is PEFT's own ``save_pretrained`` of the same weights).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@dataclass(frozen=True)
class Case:
    name: str
    config: Callable[[], object]              # () -> a PEFT config
    refused: str = ""                         # a needle of the refusal; "" = served exactly
    save: str = "pretrained"                  # pretrained | raw_state_dict | no_prefix | double_prefix
    dtype: str = ""                           # save the weights in this dtype (bfloat16, float16)
    normalized: str = ""                      # a needle of what `show` says was normalised
    # Saved the wrong way after PEFT made it: these config keys overwritten in the user's copy,
    # and (nonfinite) one weight set to NaN / inf, as a diverged float16 run leaves it.
    config_edit: tuple = ()
    nonfinite: str = ""


def _lora(**kw):
    from peft import LoraConfig

    return LoraConfig(**{"r": 4, "lora_alpha": 8, "target_modules": ALL, "task_type": "CAUSAL_LM", **kw})


def _ia3():
    from peft import IA3Config

    return IA3Config(target_modules=["k_proj", "v_proj", "down_proj"], feedforward_modules=["down_proj"],
                     task_type="CAUSAL_LM")


def _loha():
    from peft import LoHaConfig

    return LoHaConfig(r=4, alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


CASES = [
    Case("default-keys", _lora, save="raw_state_dict", normalized=".default."),
    Case("no-prefix", _lora, save="no_prefix", normalized="base_model.model."),
    Case("double-prefix", _lora, save="double_prefix", normalized="base_model.model."),
    Case("rank-pattern", lambda: _lora(rank_pattern={"down_proj": 2, "q_proj": 8},
                                       alpha_pattern={"v_proj": 32, "down_proj": 3})),
    Case("rslora", lambda: _lora(use_rslora=True, r=8, lora_alpha=4)),
    Case("all-linear", lambda: _lora(target_modules="all-linear")),
    Case("regex-targets", lambda: _lora(target_modules=r".*\.(q_proj|up_proj)")),
    Case("layers-to-transform", lambda: _lora(layers_to_transform=[1])),
    Case("exclude-modules", lambda: _lora(target_modules="all-linear", exclude_modules=["down_proj", "k_proj"])),
    # LoRA on a parameter (PEFT's ParamWrapper, made for MoE experts): on a Linear's weight the
    # same delta, saved under the same keys as LoRA on the module.
    Case("target-parameters", lambda: _lora(target_modules=[], target_parameters=["mlp.down_proj.weight"])),
    Case("bfloat16", _lora, dtype="bfloat16"),
    Case("float16", _lora, dtype="float16"),
    Case("dora", lambda: _lora(use_dora=True), refused="DoRA (use_dora)"),
    Case("lora-bias", lambda: _lora(lora_bias=True), refused="LoRA bias (lora_bias)"),
    Case("modules-to-save", lambda: _lora(modules_to_save=["lm_head"]), refused="modules_to_save"),
    # vLLM 0.32 serves LoRA on Llama's embed_tokens and lm_head (its embedding_modules), exactly.
    Case("embeddings", lambda: _lora(target_modules=["embed_tokens"])),
    Case("lm-head", lambda: _lora(target_modules=["lm_head"])),
    Case("trainable-tokens", lambda: _lora(trainable_token_indices=[5, 9]), refused="trainable tokens"),
    Case("rank-pattern-too-big", lambda: _lora(rank_pattern={"o_proj": 32}), refused="--max-lora-rank 32"),
    # issue 37, findings 2 and 3: what PEFT would not apply, or what would poison the engine
    Case("targets-fewer-than-tensors", lambda: _lora(), config_edit=(("target_modules", ["q_proj"]),),
         refused="which the config's target_modules leave out"),
    Case("regex-matching-nothing", lambda: _lora(), config_edit=(("target_modules", r".*\.nothing_proj"),),
         refused="matches no module of the base model"),
    Case("invalid-rank-pattern", lambda: _lora(), config_edit=(("rank_pattern", {"q_proj(": 4}),),
         refused="invalid pattern"),
    Case("nan-weight", lambda: _lora(), nonfinite="nan", refused="not finite (NaN or inf)"),
    Case("inf-weight-fp16", lambda: _lora(), dtype="float16", nonfinite="inf", refused="not finite (NaN or inf)"),
    Case("alpha-overflow", lambda: _lora(), config_edit=(("lora_alpha", 1e38),),
         refused="beyond what half precision holds"),
    Case("ia3", _ia3, refused="peft_type is 'IA3'"),
    Case("loha", _loha, refused="peft_type is 'LOHA'"),
]


def build(case: Case, model_dir: Path, dest: Path, scale: float = 0.08) -> Path:
    """Write ``case``'s adapter to ``dest`` as its user has it; return the folder PEFT loads.
    ``scale``: the weights' standard deviation (smaller on a deep model, so its output stays
    text rather than the noise of a large random perturbation)."""
    import torch
    from peft import get_peft_model
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model = get_peft_model(base, case.config())
    generator = torch.Generator().manual_seed(int.from_bytes(case.name.encode()[:6], "big"))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad:  # the adapter's own weights, whatever the method calls them
                std = 1.0 if "magnitude" in name else scale
                offset = 1.0 if "magnitude" in name else 0.0
                param.copy_(offset + std * torch.randn(param.shape, generator=generator))
    dest.mkdir(parents=True, exist_ok=True)
    reference = dest.parent / f"{dest.name}.peft"
    model.save_pretrained(reference)
    if case.save == "pretrained" and not case.dtype and not case.nonfinite:
        _copy(reference, dest)
        return _edited(case, dest) or dest
    _copy(reference, dest)
    _edited(case, dest)
    from safetensors.torch import load_file

    if case.save == "raw_state_dict":  # what saving model.state_dict() in a notebook gives
        tensors = {k: v for k, v in model.state_dict().items() if "lora_" in k}
    else:
        tensors = load_file(reference / "adapter_model.safetensors")
    if case.save == "no_prefix":
        tensors = {k.removeprefix("base_model.model."): v for k, v in tensors.items()}
    elif case.save == "double_prefix":
        tensors = {"base_model.model." + k: v for k, v in tensors.items()}
    if case.dtype:
        tensors = {k: v.to(getattr(torch, case.dtype)) for k, v in tensors.items()}
        save_file({k: v.contiguous() for k, v in tensors.items()}, reference / "adapter_model.safetensors")
    if case.nonfinite:
        key = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[0] = float(case.nonfinite)
    save_file({k: v.contiguous() for k, v in tensors.items()}, dest / "adapter_model.safetensors")
    return reference


def _edited(case: Case, dest: Path) -> None:
    if case.config_edit:
        config = json.loads((dest / "adapter_config.json").read_text())
        config.update(dict(case.config_edit))
        (dest / "adapter_config.json").write_text(json.dumps(config))


def _copy(source: Path, dest: Path) -> Path:
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        (dest / name).write_bytes((source / name).read_bytes())
    config = json.loads((dest / "adapter_config.json").read_text())
    assert config.get("peft_type"), config
    return dest


def case(name: str) -> Case:
    return next(c for c in CASES if c.name == name)
