"""Train the demo LoRA adapters on the demo model: a small, deterministic supervised fine-tune.

The datasets live in ``demo_data/<name>.jsonl`` (``{"prompt", "answer"}`` per line). Each
example is rendered with the model's own chat template (no system message, as ``loractl run``
sends it), and the loss covers only the answer and its end-of-turn token, so the adapter learns
what to say, not to echo prompts.

LoRA is written here in a few lines rather than through PEFT, so the daemon does not depend on
PEFT; the output is a standard PEFT folder (``adapter_config.json`` +
``adapter_model.safetensors``), and the tests load it with PEFT as the independent reference.

Invariant: the result is a function of (model, dataset, hyper-parameters, seed); on one machine
two runs give the same weights. Across CPUs, float rounding may differ in the last bits.
"""

from __future__ import annotations

import json
import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

DATA_DIR = Path(__file__).with_name("demo_data")  # models/demo_data, beside this module
ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# Part of every adapter's cache key: a change to how training computes (not only to its data or
# settings) must retrain the cached adapters. 2: the loss projects answer positions only.
TRAINER_VERSION = 2


@dataclass(frozen=True)
class TrainSpec:
    name: str            # the dataset's file stem, and the adapter's name in the store
    steps: int = 40
    batch_size: int = 8
    rank: int = 8
    alpha: int = 16
    learning_rate: float = 2e-3
    seed: int = 0


def load_examples(name: str) -> list[dict[str, str]]:
    lines = (DATA_DIR / f"{name}.jsonl").read_text().splitlines()
    return [json.loads(line) for line in lines if line.strip()]


def dataset_digest(spec: TrainSpec) -> str:
    import hashlib

    digest = hashlib.sha256((DATA_DIR / f"{spec.name}.jsonl").read_bytes())
    digest.update(f"{TRAINER_VERSION}:{spec!r}".encode())
    return digest.hexdigest()[:16]


def _encode(tokenizer, example: dict[str, str]) -> tuple[list[int], list[int]]:
    """Token ids of one rendered conversation, and labels (-100 outside the answer)."""
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]}],
                                           add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template([{"role": "user", "content": example["prompt"]},
                                          {"role": "assistant", "content": example["answer"]}], tokenize=False)
    if not full.startswith(prompt):
        raise ValueError("the chat template renders the prompt differently inside a conversation")
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    answer_ids = tokenizer.encode(full[len(prompt):].rstrip("\n"), add_special_tokens=False)
    return prompt_ids + answer_ids, [-100] * len(prompt_ids) + answer_ids


def _answer_loss(model, ids, mask, labels):
    """The causal LM loss over the answer tokens only, as ``model(..., labels=labels).loss``
    computes it, but with the vocabulary projection applied to those positions alone: about a
    third of the tokens, and the projection onto 49k words is a fifth of the model's work."""
    from torch.nn import functional

    hidden = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    targets = labels[:, 1:]
    scored = targets != -100
    logits = model.lm_head(hidden[:, :-1][scored])
    return functional.cross_entropy(logits.float(), targets[scored])


def train(model_dir: Path, spec: TrainSpec, out_dir: Path, *, base_model: str, log=print, progress=None) -> None:
    """Fine-tune a LoRA on the attention projections of ``model_dir``; write a PEFT folder.
    ``progress(steps_done, loss)`` hears every step."""
    import torch
    from safetensors.torch import save_file
    from torch import nn
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    scale = spec.alpha / spec.rank
    lora: dict[str, tuple[nn.Parameter, nn.Parameter]] = {}

    def attach(name: str, linear: nn.Linear) -> None:
        # Initialised as PEFT does: A Kaiming-uniform, B zero, so training starts at the base model.
        a = nn.Parameter(torch.empty(spec.rank, linear.in_features))
        nn.init.kaiming_uniform_(a, a=math.sqrt(5))
        b = nn.Parameter(torch.zeros(linear.out_features, spec.rank))
        lora[name] = (a, b)
        linear.register_forward_hook(lambda _m, inputs, output: output + (inputs[0] @ a.T @ b.T) * scale)

    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and name.rsplit(".", 1)[-1] in ATTENTION:
            attach(name, module)
    params = [p for pair in lora.values() for p in pair]
    optimizer = torch.optim.AdamW(params, lr=spec.learning_rate, weight_decay=0.0)

    examples = [_encode(tokenizer, e) for e in load_examples(spec.name)]
    order = random.Random(spec.seed)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    began = time.monotonic()
    model.train()
    for step in range(spec.steps):
        batch = order.sample(examples, min(spec.batch_size, len(examples)))
        width = max(len(ids) for ids, _ in batch)
        ids = torch.tensor([i + [pad] * (width - len(i)) for i, _ in batch])
        labels = torch.tensor([lab + [-100] * (width - len(lab)) for _, lab in batch])
        mask = torch.tensor([[1] * len(i) + [0] * (width - len(i)) for i, _ in batch])
        loss = _answer_loss(model, ids, mask, labels)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if progress is not None:
            progress(step + 1, loss.item())
        if step % 10 == 0 or step == spec.steps - 1:
            log(f"train {spec.name}: step {step + 1}/{spec.steps} loss {loss.item():.3f} "
                f"({time.monotonic() - began:.0f} s)")

    tensors = {}
    for name, (a, b) in lora.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.detach().contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.detach().contiguous()
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out_dir / "adapter_model.safetensors", metadata={"format": "pt"})
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base_model,
        "r": spec.rank, "lora_alpha": spec.alpha, "lora_dropout": 0.0, "target_modules": list(ATTENTION),
        "bias": "none", "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False,
    }
    (out_dir / "adapter_config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out_dir / "README.md").write_text(
        f"# {spec.name} (loractl demo adapter)\n\nTrained by loractld from `demo_data/{spec.name}.jsonl` "
        f"({len(examples)} examples): {spec.steps} steps of {spec.batch_size}, rank {spec.rank}, alpha "
        f"{spec.alpha}, learning rate {spec.learning_rate}, seed {spec.seed}, on {base_model}.\n")
