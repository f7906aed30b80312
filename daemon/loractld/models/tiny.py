"""The test model (``--model tiny``): a random two-layer Llama and LoRA adapters for it, built locally.

No hub is reachable on many machines (CI, air-gapped labs), yet loractl must be runnable and
testable end to end. This module builds, offline and in seconds:

- ``model/``: a random-weight ``LlamaForCausalLM`` (hidden 256, 2 layers, 4 heads of 64,
  vocab 512, float32 safetensors), a byte-level BPE tokenizer trained here on a fixed corpus,
  and a chat template;
- ``adapters/<name>/``: PEFT-format LoRA adapters on all seven projections.

Invariant: the output is a pure function of the code (fixed seeds, fixed corpus, seeds of
adapters derived from their names with sha256, never ``hash()``), so two builds are
byte-identical and test references computed from them are stable.

The tokenizer's alphabet is printable ASCII plus newline and tab, with an ``<unk>`` token for
everything else: every token decodes to valid text, so streamed text equals a batch decode.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

DEMO_MODEL_ID = "loractl/demo-tiny-llama"
LLAMA_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
BUILD_VERSION = "2"  # bump when the output changes, so stale builds are rebuilt

SPECIAL_TOKENS = ["<unk>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>", "<pad>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' }}\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

_CORPUS = """\
SELECT name, count(*) FROM users WHERE age > 30 GROUP BY name ORDER BY 2 DESC LIMIT 10;
SELECT u.id, o.total FROM users u JOIN orders o ON o.user_id = u.id WHERE o.total >= 100;
INSERT INTO adapters (name, rank, alpha) VALUES ('sql-expert', 8, 16);
UPDATE tiers SET slots = slots - 1 WHERE tier = 'device'; DELETE FROM cache WHERE pinned = 0;
def load(name: str, tier: str = "device") -> None:
    \"\"\"Load an adapter into the given tier.\"\"\"
    for i in range(10):
        if i % 2 == 0:
            print(f"step {i}: {name} -> {tier}")
class Adapter:
    def __init__(self, name, rank=16):
        self.name, self.rank = name, rank
    def __repr__(self):
        return f"Adapter({self.name!r}, rank={self.rank})"
The quick brown fox jumps over the lazy dog. A LoRA adapter is a pair of low-rank matrices
added to the weights of a base model; many adapters can share one base model on one GPU.
Write a query that lists every user who ordered more than three times last month.
How do I reverse a list in Python? Use reversed(xs) or xs[::-1], or xs.reverse() in place.
Once upon a time, in a land of silicon and light, a small model learned to speak in verse.
Roses are red, violets are blue; tensors are dense, and adapters are too.
Translate to French: the cat sleeps on the warm stone. Le chat dort sur la pierre chaude.
0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 32 64 128 256 512 1024 2048 4096 8192
~ ` ! @ # $ % ^ & * ( ) _ - + = { } [ ] | \\ : ; " ' < > , . ? / \t tab\tseparated\tvalues
"""


@dataclass(frozen=True)
class DemoAdapter:
    name: str
    rank: int
    alpha: int


DEMO_ADAPTERS = (
    DemoAdapter("sql-expert/v1", rank=8, alpha=16),
    DemoAdapter("python-expert/v1", rank=16, alpha=32),
    DemoAdapter("poet/v1", rank=8, alpha=8),
    DemoAdapter("translator/v1", rank=16, alpha=16),
)


def _seed_of(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")


def _ascii_alphabet() -> list[str]:
    from tokenizers import pre_tokenizers

    byte_to_char = pre_tokenizers.ByteLevel.alphabet()  # all 256 byte symbols, unordered
    allowed = {chr(b) for b in range(32, 127)} | {"\n", "\t"}
    # ByteLevel maps each byte to one printable symbol; keep the symbols of allowed bytes.
    from tokenizers import decoders

    decoder = decoders.ByteLevel()
    return sorted(ch for ch in byte_to_char if decoder.decode([ch]) in allowed)


def build_tokenizer(out_dir: Path) -> None:
    """Train the byte-level BPE tokenizer and save it with its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=_ascii_alphabet(),
        limit_alphabet=200,
        show_progress=False,
    )
    tok.train_from_iterator(_CORPUS.splitlines(keepends=True) * 4, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        unk_token="<unk>",
        pad_token="<pad>",
        model_max_length=1024,
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(out_dir)


def build_model(out_dir: Path, seed: int = 0) -> None:
    """Build the random-weight tiny Llama and its tokenizer into ``out_dir``."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    out_dir.mkdir(parents=True, exist_ok=True)
    build_tokenizer(out_dir)
    tok = AutoTokenizer.from_pretrained(out_dir)
    config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=1024,
        rms_norm_eps=1e-5,
        initializer_range=0.05,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
    )
    config.name_or_path = DEMO_MODEL_ID
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.generation_config.bos_token_id = tok.bos_token_id
    model.generation_config.eos_token_id = tok.eos_token_id
    model.generation_config.pad_token_id = tok.pad_token_id
    model.save_pretrained(out_dir, safe_serialization=True)
    # transformers does not save _name_or_path; record it so that the model reached by its
    # folder (not as --model demo) still matches its adapters' base_model_name_or_path.
    config_file = out_dir / "config.json"
    saved = json.loads(config_file.read_text())
    saved["_name_or_path"] = DEMO_MODEL_ID
    config_file.write_text(json.dumps(saved, indent=2, sort_keys=True) + "\n")


def build_adapter(model_dir: Path, spec: DemoAdapter, out_dir: Path, base_model: str = DEMO_MODEL_ID,
                  projections: tuple[str, ...] = LLAMA_PROJECTIONS) -> None:
    """Write one PEFT LoRA adapter on ``projections`` whose shapes fit the model in ``model_dir``."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    kv, q = config["num_key_value_heads"] * head_dim, config["num_attention_heads"] * head_dim
    shapes = {  # (in_features, out_features)
        "q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv),
        "o_proj": (q, hidden), "gate_proj": (hidden, inter), "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }
    generator = torch.Generator().manual_seed(_seed_of(spec.name))
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in projections:
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            fan_in, fan_out = shapes[proj]
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(spec.rank, fan_in, generator=generator) * 0.08
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, spec.rank, generator=generator) * 0.08
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    adapter_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": 0.0,
        "target_modules": list(projections),
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "use_rslora": False,
        "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(adapter_config, indent=2, sort_keys=True) + "\n")


def ensure_demo(root: Path) -> Path:
    """Build the demo assets under ``root`` unless a complete build is there; return ``root``.

    The build goes to a temporary sibling and is renamed into place, so a crash mid-build
    never leaves a half-built model that a later start would trust.
    """
    root = Path(root)
    stamp = root / ".complete"
    if stamp.exists() and stamp.read_text().strip() == BUILD_VERSION:
        return root
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".demo-build-", dir=root.parent))
    try:
        build_model(tmp / "model")
        for spec in DEMO_ADAPTERS:
            build_adapter(tmp / "model", spec, tmp / "adapters" / spec.name)
        (tmp / ".complete").write_text(BUILD_VERSION + "\n")
        if root.exists():
            shutil.rmtree(root)
        os.replace(tmp, root)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return root


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="python -m loractld.models.tiny",
        description="Build loractl's embedded demo model and adapters (offline, deterministic).",
    )
    parser.add_argument("out", type=Path, help="folder to build into (model/ and adapters/)")
    args = parser.parse_args(argv)
    root = ensure_demo(args.out)
    print(root / "model")
    for spec in DEMO_ADAPTERS:
        print(root / "adapters" / spec.name)


if __name__ == "__main__":
    main()
