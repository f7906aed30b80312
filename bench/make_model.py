"""A random-weight model with a real architecture's shapes, for honest timings offline.

    python bench/make_model.py --shape llama3-8b --out /models/llama3-8b-random [--dtype bfloat16]

Random weights cost the same compute as trained ones. The tokenizer is loractl's embedded
demo tokenizer (512 tokens; the extra embedding rows are simply never produced by it).
"""

from __future__ import annotations

import argparse
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "daemon"))

SHAPES = {
    "llama3-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    "llama3-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=8192, vocab_size=128256, rope_theta=500000.0, max_position_embeddings=8192),
    # SmolLM2-135M's shapes (the embedded demo model): a CPU run's stand-in for a real small model.
    "smollm2-135m": dict(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                         intermediate_size=1536, vocab_size=49152, max_position_embeddings=8192),
    "tiny": dict(hidden_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                 intermediate_size=512, vocab_size=512, max_position_embeddings=1024),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama3-8b")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    p.add_argument("--quantize", choices=("awq", "gptq"), default=None,
                   help="write the model as a 4-bit AWQ or GPTQ checkpoint (tests/quantized_factory.py, the "
                        "format's documented layout), its dequantized float32 twin in --float-out")
    p.add_argument("--float-out", type=Path, default=None, help="with --quantize: where the float twin goes")
    p.add_argument("--experts", type=int, default=0,
                   help="a Qwen3-MoE of the shape instead (issue 59): this many experts a layer, 2 a token, each "
                        "a quarter of the shape's MLP wide (Qwen3-30B-A3B's proportions, fewer experts)")
    args = p.parse_args()
    if args.quantize:
        quantize(args)
        return

    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from loractld.models.tiny import build_tokenizer

    tok_dir = Path(tempfile.mkdtemp())
    build_tokenizer(tok_dir)
    tok = AutoTokenizer.from_pretrained(tok_dir)
    tokens = dict(tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                  pad_token_id=tok.pad_token_id, torch_dtype=args.dtype)
    if args.experts:
        from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

        shape = SHAPES[args.shape]
        config = Qwen3MoeConfig(**shape, **tokens, num_experts=args.experts, num_experts_per_tok=2,
                                moe_intermediate_size=shape["intermediate_size"] // 4,
                                head_dim=shape["hidden_size"] // shape["num_attention_heads"], norm_topk_prob=True)
        architecture = Qwen3MoeForCausalLM
    else:
        config, architecture = LlamaConfig(**SHAPES[args.shape], **tokens), LlamaForCausalLM
    torch.manual_seed(0)
    with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
        model = architecture(config).to(getattr(torch, args.dtype))
    args.out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(args.out, safe_serialization=True)
    tok.save_pretrained(args.out)
    shutil.rmtree(tok_dir)
    print(args.out)


def quantize(args) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    import quantized_factory

    from loractld.models.tiny import build_tokenizer

    tok_dir = Path(tempfile.mkdtemp())
    build_tokenizer(tok_dir)
    shape = {k: v for k, v in SHAPES[args.shape].items() if k != "vocab_size"}
    twin = args.float_out or args.out.with_name(args.out.name + "-float")
    quantized_factory.build(args.out, twin, tok_dir, fmt=args.quantize, shape=shape, std=None)
    shutil.rmtree(tok_dir)
    print(args.out, twin)


if __name__ == "__main__":
    main()
