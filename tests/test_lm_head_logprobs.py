"""Issue 46, item 5: an adapter with an ``lm_head`` LoRA (made by PEFT) asked for prompt logprobs
in the same engine step as requests for other adapters gets HF + PEFT's logprobs (float32,
within 1e-3) on every prompt row and every sampled token, and so do the requests beside it.

vLLM computes one request's prompt logits from its slice of the step's rows, and its CPU LoRA
logits op indexed those rows with the step's one-index-per-request ``sampler_indices``: with two
adapters in the step, prompt rows got another request's ``lm_head`` delta, or none (loractl's ops
before the fix), and vLLM's own ops kill the engine (an einsum over mismatched rows). The engine
runs in a child process (tests/prompt_logprobs_child.py): loractl's CPU fixes patch vLLM there.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

import peft_corpus

TOLERANCE = 1e-3
CHILD = Path(__file__).with_name("prompt_logprobs_child.py")
TEXTS = ["the quick brown fox jumps over the lazy dog again and again",
         "hello world, how are you today my friend?",
         "one two three four five six seven eight nine ten eleven twelve"]
ADAPTERS = {   # made by PEFT on the tiny model; weights from a fixed seed (peft_corpus.build)
    "head": peft_corpus.Case("lm-head-only", lambda: peft_corpus._lora(target_modules=["lm_head"])),
    "head-all": peft_corpus.Case("lm-head-and-all", lambda: peft_corpus._lora(
        target_modules=[*peft_corpus.ALL, "lm_head"], r=8, lora_alpha=16)),
    "plain": peft_corpus.Case("no-lm-head", lambda: peft_corpus._lora()),
}
ROUNDS = [
    # The note's case: two requests asking prompt logprobs for different adapters in one step.
    [("head", 0), ("plain", 1)],
    # Two lm_head adapters and the base model, each more than once, shuffled in the batch.
    [("head", 0), ("head-all", 1), (None, 2), ("head-all", 0), ("head", 2), (None, 1)],
    # The outside check: lm_head beside four requests for two other adapters (three slots).
    [("plain", 2), ("head-all", 0), ("head", 1), ("plain", 0), ("head-all", 2)],
]


@pytest.fixture(scope="module")
def world(demo: Path, tmp_path_factory) -> dict:
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lm-head")
    model = demo / "model"
    folders = {key: str(peft_corpus.build(case, model, root / key, scale=0.1)) for key, case in ADAPTERS.items()}
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [tokenizer.encode(text) for text in TEXTS]
    rounds = [[(key, prompts[p]) for key, p in requests] for requests in ROUNDS]
    return {"model": str(model), "adapters": folders, "rounds": rounds, "root": root}


def run_engine(world: dict, cpu_fixes: bool, rounds: list) -> dict:
    job = world["root"] / f"job-{cpu_fixes}.json"
    job.write_text(json.dumps({"model": world["model"], "adapters": world["adapters"], "cpu_fixes": cpu_fixes,
                               "rounds": rounds}))
    done = subprocess.run([sys.executable, str(CHILD), str(job)], capture_output=True, text=True, timeout=400)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1].removeprefix("RESULT "))


class Reference:
    """HF transformers + PEFT in float32: the logprob of every token of a sequence after the first."""

    def __init__(self, model: str, adapters: dict[str, str]) -> None:
        self.model, self.adapters, self.loaded = model, adapters, {}

    def logprobs(self, key: str | None, ids: list[int]) -> list[float]:
        import torch
        from transformers import AutoModelForCausalLM

        if key not in self.loaded:
            net = AutoModelForCausalLM.from_pretrained(self.model, dtype=torch.float32)
            if key is not None:
                from peft import PeftModel

                net = PeftModel.from_pretrained(net, self.adapters[key])
            self.loaded[key] = net.eval()
        with torch.no_grad():
            scores = torch.log_softmax(self.loaded[key](torch.tensor([ids])).logits[0].float(), -1)
        return [scores[i, ids[i + 1]].item() for i in range(len(ids) - 1)]


def errors(reference: Reference, key: str | None, got: dict) -> list[float]:
    """|vLLM - HF + PEFT| for every prompt row (second token on) and every sampled token."""
    expected = reference.logprobs(key, got["prompt"] + got["sampled"])
    return [abs(a - b) for a, b in zip(got["prompt_logprobs"] + got["sample_logprobs"], expected, strict=True)]


def test_prompt_logprobs_with_an_lm_head_lora_beside_other_adapters_equal_hf_peft(world):
    reference = Reference(world["model"], world["adapters"])
    result = run_engine(world, True, world["rounds"])
    assert "error" not in result, result
    for requests, outputs in zip(world["rounds"], result["rounds"], strict=True):
        # Every request of the round was first scheduled in one step: they shared its logits.
        assert len({out["scheduled"] for out in outputs}) == 1 and outputs[0]["scheduled"] > 0, outputs
        keys = {key for key, _ in requests}
        assert len(keys - {None}) >= 2
        for (key, _), out in zip(requests, outputs, strict=True):
            assert len(out["prompt_logprobs"]) == len(out["prompt"]) - 1 and len(out["sampled"]) == 4
            worst = max(errors(reference, key, out))
            assert worst <= TOLERANCE, (key, worst, requests)
    # The lm_head deltas are large enough that another request's delta (or none) on a row fails.
    prompt = world["rounds"][0][0][1]
    base = reference.logprobs(None, prompt)
    for key in ("head", "head-all"):
        assert max(abs(a - b) for a, b in zip(reference.logprobs(key, prompt), base)) > 50 * TOLERANCE


def test_vllms_own_cpu_path_is_exact_or_fails_loudly(world):
    """Without loractl's CPU fixes (``--no-cpu-fixes``), vLLM 0.32's own CPU LoRA ops: the note's
    case either matches HF + PEFT or ends in an error, never in silently wrong logprobs. (Measured
    with vLLM 0.32.0: the engine dies, ``einsum(): subscript b has size 2 ... size N``.)"""
    result = run_engine(world, False, world["rounds"][:1])
    if "error" in result:
        assert result["engine_dead"], result
        return
    reference = Reference(world["model"], world["adapters"])
    for (key, _), out in zip(world["rounds"][0], result["rounds"][0], strict=True):
        assert max(errors(reference, key, out)) <= TOLERANCE, key
