"""A tiny quantized base built at test time, and its float32 reference (issue 59).

No AWQ quantizer installs on a CPU-only machine (AutoAWQ needs CUDA and is archived), so the
checkpoint is written in AWQ's documented GEMM layout, as AutoAWQ's ``WQLinear_GEMM.from_linear``
packs it and vLLM's ``awq`` loader reads it:

- ``X.qweight``: ``in x out/8`` int32, eight 4-bit values per word, the word's i-th nibble
  (bits ``4i..4i+3``) holding column ``8c + ORDER[i]``;
- ``X.qzeros``: ``in/g x out/8`` int32, packed the same way;
- ``X.scales``: ``in/g x out`` float16;
- the weight is ``W[o, i] = (q[i, o] - z[i // g, o]) * s[i // g, o]``.

GPTQ (``fmt="gptq"``) is written as AutoGPTQ's v1 checkpoints are, symmetric 4-bit (the
``uint4b8`` type vLLM's CPU kernel takes): ``X.qweight`` ``in/8 x out`` int32, eight input rows
per word in order (nibble i holds row ``8r + i``); ``X.scales`` ``in/g x out`` float16;
``X.qzeros`` ``in/g x out/8`` holding 7 (v1 stores the zero point 8 less one); ``X.g_idx`` the
group of each input row; the weight is ``(q - 8) * s``.

compressed-tensors W4A16 (``fmt="compressed-tensors"``) is written by the ``compressed_tensors``
library itself (vLLM's own dependency, the format's reference implementation): its
``calculate_qparams`` and ``PackedQuantizationCompressor`` quantize and pack each layer
(``X.weight_packed`` ``out x in/8``, ``X.weight_scale``, ``X.weight_shape``), and its
``decompress`` gives the reference's weights.

The reference folder holds exactly those dequantized weights in float32 (and the float16-rounded
embeddings and norms), so HF + PEFT on it is the model the quantized checkpoint means.
"""

from __future__ import annotations

import json
from pathlib import Path

ORDER = [0, 2, 4, 6, 1, 3, 5, 7]   # AutoAWQ's interleave within a 32-bit word
BITS = 4
GROUP = 32
CONFIGS = {"awq": {"quant_method": "awq", "bits": BITS, "group_size": GROUP, "zero_point": True, "version": "gemm"},
           "gptq": {"quant_method": "gptq", "bits": BITS, "group_size": GROUP, "sym": True, "desc_act": False,
                    "checkpoint_format": "gptq"}}
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _pack(values, order=ORDER):
    """``rows x cols`` ints in [0, 16) -> ``rows x cols/8`` int32, nibble i holding column
    ``8c + order[i]`` (AWQ's interleave by default)."""
    import numpy as np
    import torch

    v = values.to(torch.int64)
    rows, cols = v.shape
    words = torch.zeros((rows, cols // 8), dtype=torch.int64)
    for i, column in enumerate(order):
        words |= v[:, column::8] << (BITS * i)
    return torch.from_numpy(words.numpy().astype(np.uint32).view(np.int32))


def unpack(words, order=ORDER):
    """The inverse of ``_pack``: what a reader of the format gets back (checked by the test)."""
    import torch

    w = words.to(torch.int64) & 0xFFFFFFFF
    rows, packed = w.shape
    out = torch.zeros((rows, packed * 8), dtype=torch.int64)
    for i, column in enumerate(order):
        out[:, column::8] = (w >> (BITS * i)) & 0xF
    return out


def quantize_gptq(weight):
    """A float ``out x in`` weight -> ({GPTQ's tensors}, the dequantized float32 weight)."""
    import torch

    w = weight.detach().to(torch.float32).t().contiguous()          # in x out
    rows, cols = w.shape
    groups = w.reshape(rows // GROUP, GROUP, cols)
    scales = (groups.abs().amax(dim=1).clamp(min=1e-5) * 2 / 15).to(torch.float16)
    s = scales.to(torch.float32)
    q = torch.clamp(torch.round(groups / s[:, None, :]) + 8, 0, 15)
    dequantized = ((q - 8) * s[:, None, :]).reshape(rows, cols).t().contiguous()
    packed = _pack(q.reshape(rows, cols).t().contiguous(), range(8)).t().contiguous()   # rows in order
    zeros = _pack(torch.full((rows // GROUP, cols), 7), range(8))
    g_idx = torch.arange(rows, dtype=torch.int32) // GROUP
    return {"qweight": packed, "qzeros": zeros, "scales": scales, "g_idx": g_idx}, dequantized


def quantize_compressed_tensors(weight):
    """A float ``out x in`` weight -> ({compressed-tensors' tensors}, its decompressed float32
    weight), by the library's own compressor: symmetric 4-bit, groups of GROUP."""
    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    scheme = compressed_tensors_scheme()
    w = weight.detach().to(torch.float32)
    grouped = w.reshape(w.shape[0], w.shape[1] // GROUP, GROUP)
    scale, _ = calculate_qparams(grouped.amin(dim=-1), grouped.amax(dim=-1), scheme.weights)
    packed = PackedQuantizationCompressor.compress({"weight": w, "weight_scale": scale.to(torch.float16)}, scheme)
    dequantized = PackedQuantizationCompressor.decompress(dict(packed), scheme)["weight"]
    return dict(packed), dequantized.to(torch.float32)


def compressed_tensors_scheme():
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme

    return QuantizationScheme(targets=["Linear"], weights=QuantizationArgs(
        num_bits=BITS, type="int", strategy="group", group_size=GROUP, symmetric=True))


def compressed_tensors_config() -> dict:
    from compressed_tensors.quantization import QuantizationConfig

    config = QuantizationConfig(config_groups={"group_0": compressed_tensors_scheme()}, format="pack-quantized",
                                ignore=["lm_head"], quantization_status="compressed")
    return {**config.model_dump(mode="json", exclude_none=True), "quant_method": "compressed-tensors"}


def quantize(weight):
    """A float ``out x in`` weight -> (qweight, qzeros, scales, the dequantized float32 weight):
    asymmetric 4-bit, one scale and zero per group of GROUP input rows and output column."""
    import torch

    w = weight.detach().to(torch.float32).t().contiguous()          # in x out, as AWQ stores it
    rows, cols = w.shape
    groups = w.reshape(rows // GROUP, GROUP, cols)
    low, high = groups.amin(dim=1), groups.amax(dim=1)                 # (in/g) x out
    scales = ((high - low).clamp(min=1e-5) / 15).to(torch.float16)
    s = scales.to(torch.float32)
    zeros = torch.round(-low / s).clamp(0, 15)
    q = torch.clamp(torch.round(groups / s[:, None, :]) + zeros[:, None, :], 0, 15)
    dequantized = ((q - zeros[:, None, :]) * s[:, None, :]).reshape(rows, cols).t().contiguous()
    return _pack(q.reshape(rows, cols)), _pack(zeros), scales, dequantized


TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=1024)


def build(folder: Path, reference: Path, tokenizer_source: Path, seed: int = 0, fmt: str = "awq",
          shape: dict | None = None, std: float | None = 0.05) -> None:
    """Write a random Llama (``shape``: LlamaConfig's sizes, default ``TINY``) as an AWQ (or
    GPTQ) checkpoint in ``folder`` and its dequantized float32 twin in ``reference`` (both with
    the tokenizer from ``tokenizer_source``). ``std``: every weight drawn from N(0, std), large
    enough that an adapter changes the greedy tokens; None keeps transformers' own init."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    sizes = {**(shape or TINY), "vocab_size": len(tokenizer)}
    config = LlamaConfig(**sizes, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32)
    if std is not None:
        for p in model.parameters():
            torch.nn.init.normal_(p, std=std)
    quantized: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for name, p in model.state_dict().items():
            module, _, leaf = name.rpartition(".")
            if leaf == "weight" and module.rsplit(".", 1)[-1] in LINEARS:
                if fmt == "gptq":
                    tensors, dequantized = quantize_gptq(p)
                elif fmt == "compressed-tensors":
                    tensors, dequantized = quantize_compressed_tensors(p)
                else:
                    qweight, qzeros, scales, dequantized = quantize(p)
                    tensors = {"qweight": qweight, "qzeros": qzeros, "scales": scales}
                quantized |= {f"{module}.{key}": value for key, value in tensors.items()}
                p.copy_(dequantized)
            else:
                half = p.to(torch.float16)
                quantized[name] = half.contiguous()
                p.copy_(half.to(torch.float32))
    reference.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(reference)
    tokenizer.save_pretrained(reference)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(quantized, str(folder / "model.safetensors"), metadata={"format": "pt"})
    tokenizer.save_pretrained(folder)
    declared = json.loads((reference / "config.json").read_text())
    declared |= {"torch_dtype": "float16", "dtype": "float16",
                 "quantization_config": compressed_tensors_config() if fmt == "compressed-tensors"
                 else CONFIGS[fmt]}
    (folder / "config.json").write_text(json.dumps(declared, indent=2))
    generation = reference / "generation_config.json"
    if generation.exists():
        (folder / "generation_config.json").write_text(generation.read_text())


TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def build_adapter(reference: Path, out: Path, seed: int = 1) -> None:
    """A LoRA adapter made by ``peft`` on the float twin (all seven projections, rank 8, strong
    enough to move the greedy tokens); its ``base_model_name_or_path`` names the float model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    torch.manual_seed(seed)
    get_peft_model(fresh, LoraConfig(r=8, lora_alpha=64, init_lora_weights=False, target_modules=TARGETS)
                   ).save_pretrained(out)


async def served(client, prompts: list[str], tokens: int, lora: str | None = None):
    """(prompt ids, greedy ids, their logprobs) for each prompt, from a daemon's ``Client``."""
    out = []
    for prompt in prompts:
        ids, logprobs, prompt_ids = [], [], []
        async for chunk in client.generate(prompt=prompt, lora=lora, max_tokens=tokens, min_tokens=tokens,
                                           temperature=0.0, logprobs=0):
            prompt_ids += chunk.prompt_token_ids
            ids += chunk.token_ids
            logprobs += [t.logprob for t in chunk.logprobs]
        out.append((prompt_ids, ids, logprobs))
    return out


def hf_logprobs(reference: Path, adapter: Path | None, runs) -> list[list[float]]:
    """HF (+ PEFT) in float32 on the dequantized weights: each served token's logprob."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference, dtype=torch.float32)
    if adapter is not None:
        model = PeftModel.from_pretrained(model, adapter)
    found = []
    with torch.no_grad():
        for prompt_ids, ids, _ in runs:
            logits = model(torch.tensor([prompt_ids + ids])).logits[0]
            table = torch.log_softmax(logits.float(), dim=-1)
            found.append([table[len(prompt_ids) - 1 + i, t].item() for i, t in enumerate(ids)])
    return found


def gap(a, b) -> float:
    """The largest difference between two tables of logprobs of the same tokens."""
    return max(abs(x - y) for row_a, row_b in zip(a, b, strict=True) for x, y in zip(row_a, row_b, strict=True))
