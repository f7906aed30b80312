"""A tiny mixture-of-experts base built at test time, with adapters made by ``peft`` (issue 59).

A random Qwen3-MoE from transformers' own config class (4 experts, 2 per token, 2 layers), its
weights drawn large enough that an adapter changes the greedy tokens, and two adapters on it:
``a-attn`` on the attention projections, ``a-experts`` on the experts (PEFT's
``target_parameters`` on ``mlp.experts.*``). ``per_expert_adapter`` writes the other expert form
(``mlp.experts.N.gate_proj``, PEFT's layout on transformers < 5, which has no per-expert modules
for PEFT to target now) and ``merged`` the base with such an adapter merged in by hand, the
reference for it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

EXPERTS, LAYERS, HIDDEN, INTERMEDIATE, RANK, ALPHA = 4, 2, 128, 64, 8, 16


def build(root: Path, tokenizer_source: Path) -> Path:
    """Write ``root/moe-model``, ``root/a-attn`` and ``root/a-experts``; return the model folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=HIDDEN, intermediate_size=256,
                            moe_intermediate_size=INTERMEDIATE, num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=EXPERTS, num_experts_per_tok=2, max_position_embeddings=1024,
                            bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                            tie_word_embeddings=False, norm_topk_prob=True)
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.float32)
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.05)
    folder = root / "moe-model"
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    for name, kwargs in (("attn", {"target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]}),
                         ("experts", {"target_modules": [],
                                      "target_parameters": ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]})):
        fresh = Qwen3MoeForCausalLM.from_pretrained(folder, dtype=torch.float32)
        get_peft_model(fresh, LoraConfig(r=RANK, lora_alpha=ALPHA, init_lora_weights=False, **kwargs)).save_pretrained(
            root / f"a-{name}")
    return folder


def hf_greedy(folder: Path, prompt: str, tokens: int, adapter: Path | None = None) -> list[int]:
    """HF (+ PEFT) in float32: the greedy tokens after ``prompt``."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder)(prompt, return_tensors="pt").input_ids
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    out = model.generate(ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
    return out[0, ids.shape[1]:].tolist()


def per_expert_adapter(root: Path, name: str, *, experts=range(EXPERTS), in_width: int = HIDDEN,
                       std: float = 0.2, projections=("gate_proj", "up_proj", "down_proj")) -> Path:
    """An adapter on every expert's gate, up and down projection, in PEFT's key layout."""
    import torch
    from safetensors.torch import save_file

    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(1)
    tensors = {}
    for layer in range(LAYERS):
        for expert in experts:
            for proj, (width_in, width_out) in (("gate_proj", (in_width, INTERMEDIATE)),
                                                ("up_proj", (in_width, INTERMEDIATE)),
                                                ("down_proj", (INTERMEDIATE, HIDDEN))):
                if proj not in projections:
                    continue
                key = f"base_model.model.model.layers.{layer}.mlp.experts.{expert}.{proj}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(RANK, width_in, generator=generator) * std
                tensors[f"{key}.lora_B.weight"] = torch.randn(width_out, RANK, generator=generator) * std
    save_file(tensors, folder / "adapter_model.safetensors")
    (folder / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": RANK, "lora_alpha": ALPHA, "base_model_name_or_path": str(root / "moe-model"),
        "target_modules": ["gate_proj", "up_proj", "down_proj"]}))
    return folder


def merged(model: Path, adapter: Path, out: Path) -> Path:
    """``model`` with the per-expert ``adapter`` merged into its weights (W + alpha/r B A)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(model, out, dirs_exist_ok=True)
    weights = load_file(model / "model.safetensors")
    lora = load_file(adapter / "adapter_model.safetensors")
    scale = json.loads((adapter / "adapter_config.json").read_text())["lora_alpha"] / RANK
    for key, a in lora.items():
        if ".lora_A." in key:
            b = lora[key.replace(".lora_A.", ".lora_B.")]
            target = key.removeprefix("base_model.model.").replace(".lora_A.weight", ".weight")
            weights[target] = weights[target] + scale * (b @ a)
    save_file(weights, out / "model.safetensors", metadata={"format": "pt"})
    return out
