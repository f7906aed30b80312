"""A quantized base on the CPU (issue 59): an AWQ, GPTQ or compressed-tensors W4A16 checkpoint
starts (bfloat16 chosen, as vLLM's CPU kernels for them need), answers as its dequantized weights
do in HF float32 within a measured tolerance, serves an adapter trained on the float model (named
as the float model, as real adapters for ``X-AWQ`` uploads are) as HF + PEFT does, and refuses by
name an adapter whose shapes do not fit its layers.

The checkpoints are written at test time in their formats' documented layouts, compressed-tensors'
by its own library (tests/quantized_factory.py); the adapters are made by ``peft`` itself on the
float twin.

Tolerance: vLLM's CPU paths for the three (CPUWNA16, bfloat16 activations) against HF float32 on
the same dequantized weights, the chosen tokens' logprobs: measured 0.0005 at most for each base
over 4 prompts x 16 tokens, 0.0009 with this adapter (bench/bases_check.py), 2026-12-02, on the
2-core x86 development machine; the test allows ``TOLERANCE``, and checks that the adapter moves
the same logprobs by many times that, so the comparison can tell them apart.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from conftest import adapter_folder, run_cli, start_daemon, sub_home
from quantized_factory import gap, hf_logprobs

PROMPTS = ["hello world", "The quick brown fox", "def main():", "1, 2, 3,"]
TOKENS = 16
TOLERANCE = 0.005


FOLDERS = {"awq": "tiny-llama-AWQ", "gptq": "tiny-llama-GPTQ-Int4",   # named as such uploads are
           "compressed-tensors": "tiny-llama-quantized.w4a16"}
ENGINE_NAMES = {"awq": "awq", "gptq": "auto_gptq", "compressed-tensors": "compressed-tensors"}   # as status shows it


@pytest.fixture(scope="module", params=sorted(FOLDERS))
def quantized_base(request, home, demo):
    import quantized_factory

    fmt = request.param
    root = sub_home(home, fmt)
    folder, reference = root / "quantized" / FOLDERS[fmt], root / "float" / "tiny-llama"
    quantized_factory.build(folder, reference, demo / "model", fmt=fmt)
    quantized_factory.build_adapter(reference, root / "a-float")
    d = start_daemon(root, name=fmt, model=str(folder))
    yield root, fmt, reference, d
    d.stop()


def served(d, lora=None) -> list[tuple[list[int], list[int], list[float]]]:
    from quantized_factory import served as from_daemon

    async def go():
        async with d.client() as client:
            return await from_daemon(client, PROMPTS, TOKENS, lora)
    return asyncio.run(go())


def test_the_factory_writes_awq_layout():
    """The packing the test relies on reads back (the nibble order is AutoAWQ's)."""
    import torch

    import quantized_factory

    torch.manual_seed(3)
    weight = torch.randn(64, 96) * 0.05
    qweight, qzeros, scales, dequantized = quantized_factory.quantize(weight)
    assert qweight.shape == (96, 8) and qzeros.shape == (3, 8) and scales.shape == (3, 64)
    q, z = quantized_factory.unpack(qweight), quantized_factory.unpack(qzeros)
    again = ((q - z.repeat_interleave(32, 0)) * scales.float().repeat_interleave(32, 0)).t()
    assert torch.equal(again, dequantized)
    assert (dequantized - weight).abs().max() < scales.float().max()   # one step of 4 bits at most
    first = int(qweight[0, 0]) & 0xFFFFFFFF
    assert first & 0xF == q[0, 0] and (first >> 4) & 0xF == q[0, 2]   # word nibble 1 holds column 2
    tensors, symmetric = quantized_factory.quantize_gptq(weight)
    assert tensors["qweight"].shape == (12, 64) and tensors["scales"].shape == (3, 64)
    rows = quantized_factory.unpack(tensors["qweight"].t(), range(8)).t()      # in x out, rows in order
    again = ((rows - 8) * tensors["scales"].float().repeat_interleave(32, 0)).t()
    assert torch.equal(again, symmetric) and (symmetric - weight).abs().max() < tensors["scales"].float().max()


def test_a_quantized_base_starts_and_answers_as_its_dequantized_weights(quantized_base):
    root, fmt, reference, d = quantized_base
    status = run_cli("status", "--socket", str(d.socket)).stdout
    assert "cpu (bfloat16)" in status and f"quantization={ENGINE_NAMES[fmt]}," in status, status
    assert f"quantized: {fmt}, 4-bit, groups of 32" in d.log.read_text()
    runs = served(d)
    assert gap([r[2] for r in runs], hf_logprobs(reference, None, runs)) < TOLERANCE


def test_an_adapter_trained_on_the_float_model_is_served_as_hf_peft(quantized_base):
    root, fmt, reference, d = quantized_base
    assert json.loads((root / "a-float" / "adapter_config.json").read_text())["base_model_name_or_path"].endswith(
        "/tiny-llama")   # the float model's name, not the AWQ folder's
    pulled = run_cli("pull", str(root / "a-float"), "--name", f"{fmt}/float", "--socket", str(d.socket))
    assert pulled.returncode == 0, pulled.stderr
    shown = run_cli("show", f"{fmt}/float", "--socket", str(d.socket))
    flowed = " ".join(shown.stdout.split())   # the table wraps a long base path at the terminal's width
    assert f"served on a quantized base ({ENGINE_NAMES[fmt]})" in flowed, shown.stdout
    runs = served(d, f"{fmt}/float")
    expected = hf_logprobs(reference, root / "a-float", runs)
    assert gap([r[2] for r in runs], expected) < TOLERANCE
    assert gap(expected, hf_logprobs(reference, None, runs)) > 10 * TOLERANCE   # the oracle tells them apart
    assert [r[1] for r in runs] != [r[1] for r in served(d)]


def test_an_adapter_that_does_not_fit_the_quantized_layers_is_refused_by_name(quantized_base, demo):
    """The demo's adapters are for a 256-wide model; this base is 128 wide. Forced past the
    name check, the shapes refuse it, naming the layer, before the engine sees it."""
    root, fmt, reference, d = quantized_base
    wrong = adapter_folder(demo, "sql-expert")
    plain = run_cli("pull", str(wrong), "--name", f"{fmt}/wrong", "--socket", str(d.socket))
    assert plain.returncode != 0 and "trained for" in plain.stderr, plain.stderr
    forced = run_cli("pull", str(wrong), "--name", f"{fmt}/wrong", "--force", "--socket", str(d.socket))
    assert forced.returncode != 0 and "does not fit the base model's" in forced.stderr, forced.stderr
    assert "model.layers." in forced.stderr and "hint:" in forced.stderr
    assert f"{fmt}/wrong" not in run_cli("ls", "--socket", str(d.socket)).stdout
    runs = served(d)   # the engine still serves the base as before
    assert gap([r[2] for r in runs], hf_logprobs(reference, None, runs)) < TOLERANCE


# The formats no quantizer here writes (GPTQ, compressed-tensors): their packed layouts as vLLM's
# loaders read them, mapped to the float shapes adapters are checked against.
@pytest.mark.parametrize("config, tensors", [
    ({"quant_method": "gptq", "bits": 4, "group_size": 128},
     {"m.q_proj.qweight": (512, 4096), "m.q_proj.qzeros": (32, 512), "m.q_proj.scales": (32, 4096),
      "m.q_proj.g_idx": (4096,)}),
    ({"quant_method": "awq", "bits": 4, "group_size": 128},
     {"m.q_proj.qweight": (4096, 512), "m.q_proj.qzeros": (32, 512), "m.q_proj.scales": (32, 4096)}),
    ({"quant_method": "compressed-tensors", "config_groups": {"group_0": {"weights": {"num_bits": 4}}}},
     {"m.q_proj.weight_packed": (4096, 512), "m.q_proj.weight_scale": (4096, 32), "m.q_proj.weight_shape": (2,)}),
    ({"quant_method": "gptq", "bits": 8},
     {"m.q_proj.qweight": (1024, 4096), "m.q_proj.scales": (1, 4096)}),
])
def test_a_packed_layer_is_checked_as_its_float_shape(config, tensors):
    from loractld.models.quantized import float_shapes, parameter_count

    shapes = float_shapes(tensors, config)
    assert shapes["m.q_proj.weight"] == (4096, 4096)   # out x in, as lora_B @ lora_A
    assert parameter_count(shapes) == 4096 * 4096      # its float model's count, not its words'


def test_a_float_weight_is_never_replaced_and_an_unknown_format_adds_nothing():
    from loractld.models.quantized import float_shapes

    fp8 = {"m.q_proj.weight": (4096, 4096), "m.q_proj.weight_scale": ()}
    assert float_shapes(fp8, {"quant_method": "fp8"}) == fp8
    odd = {"m.q_proj.qweight": (512, 4096)}
    assert float_shapes(odd, {"quant_method": "something-new"}) == odd
    assert float_shapes(odd, None) == odd


@pytest.mark.parametrize("upload, float_model", [
    ("Qwen/Qwen2.5-7B-Instruct-GPTQ-Int4", "Qwen/Qwen2.5-7B-Instruct"),
    ("Qwen/Qwen2.5-14B-Instruct-AWQ", "Qwen/Qwen2.5-14B-Instruct"),
    ("hugging-quants/Meta-Llama-3.1-8B-Instruct-AWQ-INT4", "hugging-quants/Meta-Llama-3.1-8B-Instruct"),
    ("RedHatAI/Llama-3.1-8B-Instruct-quantized.w4a16", "RedHatAI/Llama-3.1-8B-Instruct"),
    ("/models/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", "/models/Meta-Llama-3.1-8B-Instruct"),
    ("Qwen/Qwen2.5-7B-Instruct", "Qwen/Qwen2.5-7B-Instruct"),   # nothing to drop
    ("gptq-int4", "gptq-int4"),                                 # all quantization words: kept
])
def test_a_quantized_upload_names_its_float_model(upload, float_model):
    from loractld.models.quantized import float_name
    from loractld.store.validate import model_names_match

    assert float_name(upload) == float_model
    if upload != float_model:   # an adapter for the float model matches the upload through it
        assert model_names_match("meta/" + float_model.rsplit("/", 1)[-1], {float_name(upload)})


def test_a_qlora_adapter_trained_on_a_pre_quantized_upload_names_the_float_model():
    from loractld.store.validate import model_names_match

    assert model_names_match("unsloth/llama-3-8b-bnb-4bit", {"meta-llama/llama-3-8b"})
    assert model_names_match("unsloth/llama-3-8b-bnb-4bit", {"/models/llama-3-8b-AWQ", "/models/llama-3-8b"})
    assert not model_names_match("unsloth/llama-3-8b-bnb-4bit", {"Qwen/Qwen2.5-7B"})


def test_a_quantized_base_runs_in_bfloat16_on_the_cpu_unless_told():
    from loractld.models.defaults import choose

    config = {"max_position_embeddings": 4096, "quantization_config": {"quant_method": "awq", "bits": 4}}
    chosen = choose(config, 10**8, 16 << 30, "auto")
    assert chosen.dtype == "bfloat16" and "a quantized base (awq, 4-bit)" in chosen.reason
    assert choose(config, 10**8, 16 << 30, "float16").dtype == "float16"
    assert choose({"max_position_embeddings": 4096}, 10**8, 16 << 30, "auto").dtype == "float32"


def test_ollama_names_a_quantized_base_by_its_format():
    from loractld.api.ollama.catalog import quantization_level
    from loractld.models.quantized import describe

    assert quantization_level(describe({"quant_method": "awq", "bits": 4, "group_size": 128})) == "AWQ_4BIT"
    assert quantization_level(describe({"quant_method": "fp8"})) == "FP8"


def test_fp8_is_refused_on_the_cpu_before_the_engine_starts(tmp_path):
    """Run here: with --quantization fp8 on the CPU the engine died in its start after ~60 s
    (``_C::static_scaled_fp8_quant() expected at most 0 argument(s)``); an FP8 checkpoint or the
    flag is now refused at once, in one line, with a way out."""
    from loractld.models.defaults import for_model
    from loractld.models.gguf import ModelRefused

    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": {"quant_method": "fp8"}}))
    for folder, flag in ((tmp_path, None), (tmp_path / "float", "fp8")):
        folder.mkdir(exist_ok=True)
        with pytest.raises(ModelRefused, match="fp8 quantization cannot run on the CPU") as refused:
            for_model(str(folder), "auto", None, flag)
        assert "AWQ, GPTQ or compressed-tensors" in refused.value.hint
    assert for_model(str(tmp_path / "float"), "auto", None, "awq").dtype == "bfloat16"
