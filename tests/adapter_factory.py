"""Builds good and deliberately broken adapter folders for the validation tests."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from loractld.models.tiny import DemoAdapter, build_adapter


def good(demo: Path, dest: Path, name: str = "fresh/v1", rank: int = 8) -> Path:
    build_adapter(demo / "model", DemoAdapter(name, rank=rank, alpha=rank * 2), dest)
    return dest


def edit_config(folder: Path, **changes) -> Path:
    config = json.loads((folder / "adapter_config.json").read_text())
    config.update(changes)
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


def replace_tensors(folder: Path, mutate) -> Path:
    """Rewrite the weights with ``mutate(dict_of_tensors)`` applied."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(folder / "adapter_model.safetensors")
    mutate(tensors)
    save_file(tensors, folder / "adapter_model.safetensors")
    return folder


def broken(kind: str, demo: Path, dest: Path) -> Path:
    """An adapter folder broken in one specific way."""
    import torch

    folder = good(demo, dest)
    if kind == "no_config":
        (folder / "adapter_config.json").unlink()
    elif kind == "bad_json":
        (folder / "adapter_config.json").write_text("{not json")
    elif kind == "not_lora":
        edit_config(folder, peft_type="IA3")
    elif kind == "pickle_only":
        (folder / "adapter_model.safetensors").rename(folder / "adapter_model.bin")
    elif kind == "rank_too_big":
        shutil.rmtree(folder)
        good(demo, folder, rank=32)
    elif kind == "unknown_module":
        def add(t):
            a = t["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
            b = t["base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight"]
            t["base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight"] = a.clone()
            t["base_model.model.model.layers.7.self_attn.q_proj.lora_B.weight"] = b.clone()
        replace_tensors(folder, add)
    elif kind == "wrong_shape":
        def widen(t):
            key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
            t[key] = torch.zeros(t[key].shape[0], t[key].shape[1] * 2)
        replace_tensors(folder, widen)
    elif kind == "other_base_model":
        edit_config(folder, base_model_name_or_path="meta-llama/Llama-3.1-8B")
    elif kind == "truncated":
        data = (folder / "adapter_model.safetensors").read_bytes()
        (folder / "adapter_model.safetensors").write_bytes(data[: len(data) - 1000])
    elif kind == "garbage":
        (folder / "adapter_model.safetensors").write_bytes(b"\x00" * 64)
    else:
        raise ValueError(kind)
    return folder
