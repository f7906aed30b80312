"""A tiny mixture-of-experts base built at test time, with adapters made by ``peft`` (issue 59).

A random Qwen3-MoE from transformers' own config class (4 experts, 2 per token, 2 layers), its
weights drawn large enough that an adapter changes the greedy tokens, and two adapters on it:
``a-attn`` on the attention projections, ``a-experts`` on the experts (PEFT's
``target_parameters`` on ``mlp.experts.*``).
"""

from __future__ import annotations

from pathlib import Path


def build(root: Path, tokenizer_source: Path) -> Path:
    """Write ``root/moe-model``, ``root/a-attn`` and ``root/a-experts``; return the model folder."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoTokenizer, Qwen3MoeConfig, Qwen3MoeForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = Qwen3MoeConfig(vocab_size=len(tokenizer), hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                            num_experts=4, num_experts_per_tok=2, max_position_embeddings=1024,
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
        get_peft_model(fresh, LoraConfig(r=8, lora_alpha=16, init_lora_weights=False, **kwargs)).save_pretrained(
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
