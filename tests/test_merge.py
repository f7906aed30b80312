"""Issue 47, item 2: exact weighted merges of LoRA adapters (``loractl merge``).

The pure part (``loractld.store.merge``) on adapters made by PEFT itself on the tiny model
(tests/peft_corpus.py): the merged adapter's delta, per module, equals the weighted sum of its
sources' deltas as PEFT computes them (rsLoRA, rank and alpha patterns, modules only some
sources have, bfloat16 weights), and what cannot be merged exactly is refused by name. The daemon
part: merges through the socket (the CLI and ``Client.merge``) answer with HF + PEFT's own merge
(``add_weighted_adapter(..., combination_type="cat")``): the same greedy tokens and logprobs
within 1e-3, through gRPC and through the HTTP door; merging again gives the same digest.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

import peft_corpus
from support_merges import MERGES, NEW_TOKENS, PROMPT, SERVED, PeftMerge, pull_sources

TOLERANCE = 1e-5
SOURCES = {   # PEFT configs on the tiny model; weights from a fixed seed (peft_corpus.build)
    "plain": SERVED["m/plain"],
    "rslora": SERVED["m/rslora"],
    "patterns": peft_corpus.Case("merge-patterns", lambda: peft_corpus._lora(
        r=2, rank_pattern={"o_proj": 4}, alpha_pattern={"v_proj": 7}, target_modules=["v_proj", "o_proj", "up_proj"])),
    "layer1": peft_corpus.Case("merge-layer1", lambda: peft_corpus._lora(layers_to_transform=[1], r=2, lora_alpha=3)),
    "bf16": peft_corpus.Case("merge-bf16", lambda: peft_corpus._lora(r=2, target_modules=["k_proj", "down_proj"]),
                             dtype="bfloat16"),
    "embed": peft_corpus.Case("merge-embed", lambda: peft_corpus._lora(r=2, target_modules=["embed_tokens", "q_proj"])),
    "head": peft_corpus.Case("merge-head", lambda: peft_corpus._lora(r=2, target_modules=["lm_head"])),
    "dora": peft_corpus.Case("merge-dora", lambda: peft_corpus._lora(use_dora=True, r=2)),
}


@pytest.fixture(scope="module")
def made(demo: Path, tmp_path_factory) -> dict[str, Path]:
    """Each source's folder as its user has it (``build`` writes it; it returns PEFT's own copy)."""
    root = tmp_path_factory.mktemp("merge-sources")
    for key, case in SOURCES.items():
        peft_corpus.build(case, demo / "model", root / key, scale=0.1)
    return {key: root / key for key in SOURCES}


def deltas(folder: Path) -> dict[str, object]:
    """module -> its delta as PEFT itself applies it (``get_delta_weight``), in float64: the
    oracle reads the adapter as PEFT does (rsLoRA, patterns, embeddings), not as the merge does."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer
    from transformers import AutoModelForCausalLM

    model_dir = Path(json.loads((folder / "adapter_config.json").read_text())["base_model_name_or_path"])
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), str(folder))
    with torch.no_grad():
        return {name.removeprefix("base_model.model."): layer.get_delta_weight("default").double().numpy()
                for name, layer in model.named_modules()
                if isinstance(layer, LoraLayer) and "default" in {**layer.lora_A, **layer.lora_embedding_A}}


def assert_weighted_sum(merged: Path, sources: list[tuple[Path, float]], tolerance: float = TOLERANCE) -> None:
    got = deltas(merged)
    want: dict[str, object] = {}
    for folder, weight in sources:
        for module, delta in deltas(folder).items():
            want[module] = want.get(module, 0) + weight * delta
    assert set(got) == set(want)
    for module, delta in want.items():
        assert abs(got[module] - delta).max() <= tolerance, module
        assert abs(delta).max() > 100 * tolerance, module   # a delta that is there, not zero


@pytest.mark.parametrize("keys,weights", [
    (["plain", "rslora"], [0.7, 0.3]),
    (["plain", "patterns", "layer1"], [1.0, -0.5, 2.0]),
    (["bf16", "rslora", "embed", "head"], [0.25, 1.5, 1.0, 0.5]),
])
def test_a_cat_merge_is_the_weighted_sum_of_the_deltas(made, demo, tmp_path, keys, weights):
    from loractld.models.weights import base_model_shapes
    from loractld.store.merge import merge_adapters
    from loractld.store.validate import validate_adapter

    sources = [(made[k], w) for k, w in zip(keys, weights)]
    report = merge_adapters(sources, tmp_path / "out", max_lora_rank=64)
    assert_weighted_sum(tmp_path / "out", sources)
    assert report.method == "cat" and report.relative_error == 0 and report.weights == weights
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert config["r"] == config["lora_alpha"] == report.rank and not config["use_rslora"]
    # What the store checks before it installs anything passes (shapes against the tiny model's).
    validate_adapter(tmp_path / "out", max_lora_rank=64, base_shapes=base_model_shapes(demo / "model"))


def test_the_same_merge_writes_the_same_bytes(made, tmp_path):
    from loractld.store.merge import merge_adapters

    for out in ("one", "two"):
        merge_adapters([(made["plain"], 0.5), (made["patterns"], 0.5)], tmp_path / out, max_lora_rank=16)
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "two" / name).read_bytes()
    merge_adapters([(made["plain"], 0.5), (made["patterns"], 0.25)], tmp_path / "other", max_lora_rank=16)
    assert (tmp_path / "other" / "adapter_model.safetensors").read_bytes() != \
        (tmp_path / "one" / "adapter_model.safetensors").read_bytes()


def test_svd_is_approximate_and_says_how_much(made, tmp_path):
    from loractld.store.merge import merge_adapters

    sources = [(made["plain"], 1.0), (made["layer1"], 1.0)]
    full = merge_adapters(sources, tmp_path / "full", max_lora_rank=16, method="svd", svd_rank=6)
    assert full.relative_error < 1e-6        # rank 6 holds the sum of ranks 4 and 2 exactly
    assert_weighted_sum(tmp_path / "full", sources, tolerance=1e-4)
    cut = merge_adapters(sources, tmp_path / "cut", max_lora_rank=16, method="svd", svd_rank=2)
    assert 0.05 < cut.relative_error < 1 and cut.rank == 2
    got, want = deltas(tmp_path / "cut"), {}
    for folder, weight in sources:
        for module, delta in deltas(folder).items():
            want[module] = want.get(module, 0) + weight * delta
    import numpy as np

    measured = math.sqrt(sum(float(np.sum((got[m] - want[m]) ** 2)) for m in want) /
                         sum(float(np.sum(want[m] ** 2)) for m in want))
    assert abs(measured - cut.relative_error) < 1e-4
    for module, delta in want.items():   # the best rank-2 approximation: a full SVD's truncation (Eckart-Young)
        u, sv, vt = np.linalg.svd(np.asarray(delta, dtype=np.float64), full_matrices=False)
        best = (u[:, :2] * sv[:2]) @ vt[:2]
        assert np.abs(got[module] - best).max() <= 1e-4 * max(1.0, float(np.abs(best).max())), module


@pytest.mark.parametrize("edit,needle", [
    ("dora", "DoRA (use_dora)"),
    ({"bias": "all"}, "bias='all'"),
    ({"lora_bias": True}, "LoRA bias (lora_bias)"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "LOHA"}, "peft_type 'LOHA'"),
    ({"base_model_name_or_path": "meta-llama/Llama-3.1-8B"}, "different base models"),
])
def test_what_cannot_be_merged_exactly_is_refused_by_name(made, tmp_path, edit, needle):
    from adapter_factory import edit_config

    from loractl.errors import InvalidAdapter
    from loractld.store.merge import merge_adapters

    if edit == "dora":
        odd = made["dora"]
    else:
        odd = tmp_path / "odd"
        odd.mkdir()
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (odd / name).write_bytes((made["plain"] / name).read_bytes())
        edit_config(odd, **edit)
    with pytest.raises(InvalidAdapter) as refused:
        merge_adapters([(made["rslora"], 1.0), (odd, 1.0)], tmp_path / "out", max_lora_rank=16,
                       labels=["a/v1", "odd/v1"])
    assert needle in refused.value.message
    assert "odd/v1" in refused.value.message or "a/v1" in refused.value.message
    assert not (tmp_path / "out").exists()   # nothing written


def test_a_rank_sum_above_the_limit_says_what_would_fit(made, tmp_path):
    from loractl.errors import InvalidAdapter
    from loractld.store.merge import merge_adapters

    with pytest.raises(InvalidAdapter) as refused:
        merge_adapters([(made["plain"], 1.0), (made["rslora"], 1.0), (made["plain"], 1.0)], tmp_path / "out",
                       max_lora_rank=8, labels=["a", "b", "c"])
    message, hint = refused.value.message, refused.value.hint
    assert "merged rank would be 12" in message and "max LoRA rank 8" in message
    assert "merge a and b only" in hint and "--svd-rank 8" in hint and "--max-lora-rank 16" in hint


# -- through the daemon: the socket (CLI, Client) and the HTTP door ------------------------------
@pytest.fixture(scope="module")
def served(rig, demo, tmp_path_factory) -> dict[str, Path]:
    """The sources, pulled into the rig."""
    return pull_sources(rig, demo, tmp_path_factory.mktemp("merge-served"))


def test_merges_through_the_socket_answer_as_peft_merges(rig, served, demo):
    import asyncio

    from loractl.client import Client

    two = json.loads(rig.ok("merge", "m/two", *(f"{n}={w}" for n, w in MERGES["m/two"].items()), "--json").stdout)
    assert two["merge"]["method"] == "cat" and two["rank"] == 8
    assert {(s["name"], s["weight"]) for s in two["merge"]["sources"]} == set(MERGES["m/two"].items())
    shown = rig.ok("show", "m/two").stdout
    assert "merged" in shown and "cat (exact)" in shown and "m/rslora × 0.3" in shown, shown
    # Each source by the revision ls and show give it (issue 60, item 9): one identifier.
    for source in two["merge"]["sources"]:
        revision = json.loads(rig.ok("show", source["name"], "--json").stdout)["revision"]
        assert source["revision"] == revision and f"{source['name']} × {source['weight']:g} (revision " \
            f"{revision.split(':', 1)[-1][:12]})" in shown, (source, revision, shown)

    async def scenario():
        async with Client(rig.daemon.socket) as client:
            three = await client.merge("m/three", MERGES["m/three"])
            again = await client.merge("m/three", list(reversed(MERGES["m/three"].items())))
            answers = {}
            for name in [*MERGES, "m/plain"]:
                answers[name] = {"ids": [], "logprobs": [], "prompt_ids": []}
                async for chunk in client.generate(PROMPT, lora=name, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS,
                                                   temperature=0, logprobs=0):
                    answers[name]["prompt_ids"] += chunk.prompt_token_ids
                    answers[name]["ids"] += chunk.token_ids
                    answers[name]["logprobs"] += [t.logprob for t in chunk.logprobs]
            return three, again, answers

    three, again, answers = asyncio.run(scenario())
    assert three["rank"] == 4 + 4 + 2 and three["merge"]["relative_error"] == 0
    # The same sources and weights (named in another order) are the same content.
    assert again["revision"] == three["revision"] and again["files"] == three["files"]
    reference = PeftMerge(demo / "model", served)
    # A source alone (PEFT's merge of one is that adapter) too: a miss there is the engine's, not the merge's.
    for name, weights in [("m/plain", {"m/plain": 1.0}), *MERGES.items()]:
        ids, logprobs = reference.greedy(weights, answers[name]["prompt_ids"])
        assert answers[name]["ids"] == ids, name
        assert max(abs(a - b) for a, b in zip(answers[name]["logprobs"], logprobs, strict=True)) <= 1e-3, name
    assert answers["m/two"]["ids"] != answers["m/three"]["ids"]   # the weights matter


def test_a_merged_adapter_answers_through_http(rig, served, demo):
    """``/v1/completions`` with the merged name: PEFT's merge's greedy text and logprobs."""
    import urllib.request

    from transformers import AutoTokenizer

    rig.ok("merge", "m/two", *(f"{n}={w}" for n, w in MERGES["m/two"].items()))
    body = {"model": "m/two", "prompt": PROMPT, "max_tokens": NEW_TOKENS, "min_tokens": NEW_TOKENS,
            "temperature": 0, "logprobs": 1}
    request = urllib.request.Request(f"{rig.http}/v1/completions", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as reply:
        choice = json.loads(reply.read())["choices"][0]
    tokenizer = AutoTokenizer.from_pretrained(demo / "model")
    ids, logprobs = PeftMerge(demo / "model", served).greedy(MERGES["m/two"], tokenizer.encode(PROMPT))
    assert choice["text"] == tokenizer.decode(ids)
    assert max(abs(a - b) for a, b in zip(choice["logprobs"]["token_logprobs"], logprobs, strict=True)) <= 1e-3


def test_a_merge_the_daemon_cannot_hold_is_refused_with_what_fits(rig, served):
    sources = ("m/plain", "m/rslora", "m/plain=2", "m/plain=3", "m/alpha")   # 4 + 4 + 4 + 4 + 2 on v_proj
    result = rig.cli("merge", "m/big", *sources)
    assert result.returncode == 5, result.stderr   # InvalidAdapter
    assert "merged rank would be 18" in result.stderr, result.stderr
    assert "above the daemon's max LoRA rank 16" in result.stderr and "--svd-rank 16" in result.stderr, result.stderr
    assert "m/big" not in rig.ok("ls").stdout
    approx = json.loads(rig.ok("merge", "m/big", *sources, "--svd-rank", "4", "--json").stdout)
    assert approx["merge"]["method"] == "svd" and approx["rank"] == 4 and 0 < approx["merge"]["relative_error"] < 1
    assert "approximate: relative error" in rig.ok("show", "m/big").stdout


def test_a_modelfile_of_two_weighted_adapters_answers_as_peft_merges_in_every_door(rig, served, demo, tmp_path):
    """Issue 47's "done when": a Modelfile with two weighted ADAPTER lines, a system prompt and
    parameters is one name that the socket, an OpenAI client's request and Ollama's chat answer
    with — exactly as PEFT's cat merge of the same adapters, under the same system prompt."""
    import asyncio

    import httpx
    import ollama

    from conftest import collect

    weights = MERGES["m/two"]
    system = "You finish the user's sentence."
    modelfile = tmp_path / "Modelfile"
    base = json.loads(rig.ok("status", "--json").stdout)["engine"]["model_arg"]
    modelfile.write_text("\n".join([f"FROM {base}", *(f"ADAPTER {n}={w}" for n, w in weights.items()),
                                    f'SYSTEM """{system}"""', "PARAMETER temperature 0",
                                    f"PARAMETER num_predict {NEW_TOKENS}", ""]))
    rig.ok("create", "mixed", "-f", str(modelfile))
    question = [{"role": "user", "content": PROMPT}]

    async def grpc(**extra) -> dict:
        async with rig.daemon.client() as client:
            return await collect(client, messages=question, lora="mixed", **extra)
    exact = asyncio.run(grpc(min_tokens=NEW_TOKENS, logprobs=0))
    ids, _ = PeftMerge(demo / "model", served).greedy(weights, exact["prompt_ids"])
    assert exact["ids"] == ids
    # The prompt the engine saw is the profile's system prompt and the question, as vLLM renders them.
    rendered = httpx.post(f"{rig.http}/tokenize", timeout=60, json={
        "model": "m/plain", "messages": [{"role": "system", "content": system}, *question],
        "add_generation_prompt": True})
    assert rendered.status_code == 200 and exact["prompt_ids"] == rendered.json()["tokens"], rendered.text
    http = httpx.post(f"{rig.http}/v1/chat/completions", timeout=120, json={
        "model": "mixed", "messages": question, "min_tokens": NEW_TOKENS, "return_token_ids": True})
    assert http.status_code == 200, http.text
    assert http.json()["choices"][0]["token_ids"] == ids
    plain = asyncio.run(grpc())   # the profile's own parameters only
    said = ollama.Client(host=rig.http, timeout=120).chat(model="mixed", messages=question).message.content
    assert said == plain["text"]
