"""Preflight of adapters that train a mixture-of-experts base's experts (issue 59, item 3).

On the CPU every expert adapter is refused (no kernel runs it). On a GPU vLLM 0.32 takes one form
per architecture, and preflight checks that form's expert counts and shapes before the engine
sees the adapter: per-expert modules for most MoE models (Qwen3-MoE, Mixtral), PEFT's fused
``target_parameters`` form for those it loads as 3D experts (gpt-oss, Qwen3.5-MoE, ...).

The base is the random Qwen3-MoE of ``moe_factory`` (4 experts, 2 layers) and its fused adapter
is made by ``peft``; transformers 5 has no per-expert modules for PEFT to target, so the
per-expert adapters are written here in PEFT's key layout. What a GPU then serves is checked by
``bench/bases_check.py`` when one is lent; these tests check what is refused and what passes.
"""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

import pytest

import moe_factory
from conftest import sub_home
from loractl.errors import InvalidAdapter
from loractld.models.basemodel import describe
from loractld.models.moe import FUSED, PER_EXPERT, expert_base
from loractld.store.validate import validate_adapter
from moe_factory import RANK, per_expert_adapter


@pytest.fixture(scope="module")
def root(home, demo) -> Path:
    root = sub_home(home, "moe-experts")
    moe_factory.build(root, demo / "model")
    return root


def base(root: Path, device: str, **changes):
    described = describe(str(root / "moe-model"), str(root / "moe-model"), device=device)
    if changes:
        described.moe = dataclasses.replace(described.moe, **changes)
    return described


def check(adapter: Path, described):
    return validate_adapter(adapter, max_lora_rank=64, base_shapes=described.shapes, model_names=described.names,
                            experts=described.moe)


def fused_adapter_without_gate_up(root: Path) -> Path:
    from safetensors.torch import load_file, save_file

    folder = root / "a-experts-down-only"
    shutil.copytree(root / "a-experts", folder, dirs_exist_ok=True)
    tensors = load_file(folder / "adapter_model.safetensors")
    save_file({k: v for k, v in tensors.items() if ".base_layer." not in k}, folder / "adapter_model.safetensors")
    return folder


def refusal(adapter: Path, described) -> str:
    with pytest.raises(InvalidAdapter) as caught:
        check(adapter, described)
    return str(caught.value)


def test_the_form_follows_vllms_architectures_and_the_device():
    config = {"architectures": ["GptOssForCausalLM"], "num_local_experts": 32, "hidden_size": 2880,
              "intermediate_size": 2880}
    assert expert_base(config, "cuda").form == FUSED
    assert expert_base({**config, "architectures": ["MixtralForCausalLM"]}, "cuda").form == PER_EXPERT
    assert expert_base(config, "cpu").form == ""
    assert expert_base({"architectures": ["LlamaForCausalLM"], "hidden_size": 8}, "cuda") is None
    qwen = expert_base({"architectures": ["Qwen3MoeForCausalLM"], "num_experts": 128, "hidden_size": 2048,
                        "intermediate_size": 6144, "moe_intermediate_size": 768}, "cuda")
    assert (qwen.experts, qwen.hidden, qwen.intermediate) == (128, 2048, 768)   # an expert's width, not the dense MLP's


def test_on_the_cpu_every_expert_adapter_is_refused_and_an_attention_one_passes(root):
    cpu = base(root, "cpu")
    assert "no CPU kernel runs expert LoRA" in refusal(root / "a-experts", cpu)
    assert "no CPU kernel runs expert LoRA" in refusal(per_expert_adapter(root, "a-per-expert"), cpu)
    assert check(root / "a-attn", cpu).target_modules == ["k_proj", "o_proj", "q_proj", "v_proj"]


def test_on_a_gpu_a_per_expert_architecture_takes_per_expert_adapters_whole(root):
    gpu = base(root, "cuda")
    assert gpu.moe.form == PER_EXPERT and gpu.moe.architecture == "Qwen3MoeForCausalLM"
    facts = check(per_expert_adapter(root, "a-per-expert"), gpu)
    assert facts.target_modules == ["down_proj", "gate_proj", "up_proj"] and facts.rank == RANK
    message = refusal(root / "a-experts", gpu)   # PEFT's fused form, which vLLM's Qwen3-MoE does not take
    assert "vLLM serves expert LoRA as per-expert modules" in message and "fused" in message


def test_a_per_expert_adapter_missing_experts_or_sized_for_another_base_is_refused(root):
    gpu = base(root, "cuda")
    assert "trains down_proj on 3 of its 4 experts" in refusal(
        per_expert_adapter(root, "a-three-experts", experts=range(3)), gpu)
    assert "is expert 4, but this base has 4 a layer" in refusal(
        per_expert_adapter(root, "a-five-experts", experts=range(5)), gpu)
    assert "does not fit the base model's" in refusal(per_expert_adapter(root, "a-wide", in_width=96), gpu)
    assert "trains its experts' gate_proj, up_proj but not down_proj" in refusal(
        per_expert_adapter(root, "a-no-down", projections=("gate_proj", "up_proj")), gpu)


def test_on_a_3d_architecture_the_fused_form_is_checked_for_counts_and_widths(root):
    fused = base(root, "cuda", architecture="GptOssForCausalLM", form=FUSED)
    assert check(root / "a-experts", fused).target_modules == ["experts"]   # PEFT's own adapter passes
    assert "vLLM serves expert LoRA as PEFT's target_parameters" in refusal(
        per_expert_adapter(root, "a-per-expert"), fused)
    assert "has only its experts' down projection" in refusal(fused_adapter_without_gate_up(root), fused)
    eight = base(root, "cuda", architecture="GptOssForCausalLM", form=FUSED, experts=8)
    assert "holds 32 rank rows, not rank x experts = 64" in refusal(root / "a-experts", eight)
    narrow = base(root, "cuda", architecture="GptOssForCausalLM", form=FUSED, intermediate=32)
    assert "but this base's experts map 128 -> 64" in refusal(root / "a-experts", narrow)


def test_the_3d_architectures_are_those_vllm_loads_with_3d_experts():
    """``VLLM_3D_EXPERT_ARCHITECTURES`` against the installed vLLM's sources: each model class that
    sets ``is_3d_moe_weight = True`` (or inherits it in its file), by the architectures its
    registry maps to it. Read, not imported: most of those modules need torchvision."""
    import ast
    import importlib.util

    from loractld.models.moe import VLLM_3D_EXPERT_ARCHITECTURES

    models = Path(importlib.util.find_spec("vllm.model_executor.models").submodule_search_locations[0])
    three_d: set[tuple[str, str]] = set()
    for source in models.glob("*.py"):
        text = source.read_text()
        if "is_3d_moe_weight" not in text:
            continue
        classes = {node.name: node for node in ast.parse(text).body if isinstance(node, ast.ClassDef)}

        def sets_it(node: ast.ClassDef) -> bool:
            for statement in node.body:
                target = statement.target if isinstance(statement, ast.AnnAssign) else (
                    statement.targets[0] if isinstance(statement, ast.Assign) else None)
                if isinstance(target, ast.Name) and target.id == "is_3d_moe_weight":
                    return isinstance(statement.value, ast.Constant) and statement.value.value is True
            return any(sets_it(classes[b.id]) for b in node.bases if isinstance(b, ast.Name) and b.id in classes)

        three_d |= {(source.stem, name) for name, node in classes.items() if sets_it(node)}
    registry = (models / "registry.py").read_text()
    found = set()
    for node in ast.walk(ast.parse(registry)):
        if isinstance(node, ast.Dict):
            for key, value in zip(node.keys, node.values):
                if (isinstance(key, ast.Constant) and isinstance(value, ast.Tuple) and len(value.elts) == 2
                        and all(isinstance(e, ast.Constant) for e in value.elts)
                        and (value.elts[0].value, value.elts[1].value) in three_d):
                    found.add(key.value)
    assert found == VLLM_3D_EXPERT_ARCHITECTURES


def test_the_gpu_checks_reference_for_a_per_expert_adapter_tells_it_from_the_base(root):
    """bench/bases_check.py compares a GPU's answer for the per-expert adapter with the base
    merged with it by hand: that reference must differ from the base's own answer."""
    folder = per_expert_adapter(root, "a-per-expert")
    reference = moe_factory.merged(root / "moe-model", folder, root / "moe-merged")
    assert moe_factory.hf_greedy(reference, "hello world", 12) != moe_factory.hf_greedy(root / "moe-model",
                                                                                      "hello world", 12)


def test_a_layers_experts_with_different_ranks_are_refused(root):
    """vLLM packs one rank per projection of a layer's experts; PEFT's rank_pattern can give one
    expert another."""
    import json

    import torch
    from safetensors.torch import load_file, save_file

    folder = per_expert_adapter(root, "a-mixed-ranks")
    tensors = load_file(folder / "adapter_model.safetensors")
    key = "base_model.model.model.layers.0.mlp.experts.1.gate_proj"
    tensors[f"{key}.lora_A.weight"] = torch.randn(4, moe_factory.HIDDEN) * 0.1
    tensors[f"{key}.lora_B.weight"] = torch.randn(moe_factory.INTERMEDIATE, 4) * 0.1
    save_file(tensors, folder / "adapter_model.safetensors")
    config = json.loads((folder / "adapter_config.json").read_text())
    config["rank_pattern"] = {"model.layers.0.mlp.experts.1.gate_proj": 4}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    assert "model.layers.0.mlp's experts have different ranks for gate_proj (4, 8)" in refusal(folder, base(root, "cuda"))
