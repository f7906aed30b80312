"""vLLM's sampling surface through gRPC, ``loractl.Client`` and ``loractl run`` (issue 38 item 2):
structured outputs (JSON schema, regex, choice, grammar), logprobs against an HF float32
reference, penalties, logit bias, min-p, stop token ids, ignore-eos, and refusals by name.

All on the session daemon (tiny random model, greedy, few tokens). The tiny model's weights are
random: under a JSON constraint it would pick whitespace for ever, so the JSON cases bias the
whitespace-only tokens away (a logit bias, as a user would), and the schemas bound their
strings and numbers.
"""

from __future__ import annotations

import asyncio
import json
import re

import pytest

from conftest import collect, run_cli
from loractl import Client
from loractl.errors import InvalidRequest

PROMPT = "Give me a record"
MESSAGES = [{"role": "user", "content": PROMPT}]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "enum": ["ann", "bob"]},
                   "n": {"type": "integer", "minimum": 0, "maximum": 99},
                   "ok": {"type": "boolean"}},
    "required": ["name", "n", "ok"],
    "additionalProperties": False,
}


def no_whitespace(reference) -> dict[int, float]:
    """A logit bias of -100 on every token that decodes to whitespace only."""
    tok = reference.tokenizer
    return {i: -100.0 for i in range(len(tok)) if tok.decode([i]).strip() == "" and i not in tok.all_special_ids}


def generate(daemon, client_kwargs: dict | None = None, **kwargs) -> dict:
    """One generation through ``loractl.Client``: collect()'s result plus chunks and logprobs."""
    async def go():
        async with Client(daemon.socket, **(client_kwargs or {})) as client:
            result = {"ids": [], "text": "", "finish": "", "logprobs": [], "chunks": []}
            async for chunk in client.generate(**{"messages": MESSAGES, "temperature": 0.0, **kwargs}):
                result["ids"] += chunk.token_ids
                result["text"] += chunk.text
                result["finish"] = chunk.finish_reason or result["finish"]
                result["logprobs"] += chunk.logprobs
                result["chunks"].append(chunk)
            return result

    return asyncio.run(go())


def refused(daemon, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        generate(daemon, max_tokens=4, **kwargs)
    return info.value


def cli(daemon, *args: str):
    return run_cli("run", "--socket", str(daemon.socket), "-t", "0", *args)


def one_line_error(result, *words: str) -> str:
    """The CLI's refusal: exit 2, one error line naming ``words``, one hint line."""
    assert result.returncode == 2, (result.returncode, result.stdout, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("loractl: error: ") and lines[1].startswith("hint: "), lines
    for word in words:
        assert word in lines[0], lines
    return lines[0]


# -- structured outputs -----------------------------------------------------------------------

def test_json_schema_through_the_client_gives_valid_json(daemon, reference):
    import jsonschema

    got = generate(daemon, max_tokens=64, json_schema=SCHEMA, logit_bias=no_whitespace(reference))
    assert got["finish"] == "stop", got
    jsonschema.validate(json.loads(got["text"]), SCHEMA)
    # The same schema as JSON text; and the constraint really acts: free text is no JSON.
    assert generate(daemon, max_tokens=64, json_schema=json.dumps(SCHEMA),
                    logit_bias=no_whitespace(reference))["text"] == got["text"]
    free = generate(daemon, max_tokens=16, logit_bias=no_whitespace(reference))["text"]
    with pytest.raises(ValueError):
        json.loads(free)


def test_run_json_schema_prints_valid_json(daemon, reference, tmp_path):
    import jsonschema

    schema_file = tmp_path / "record.schema.json"
    schema_file.write_text(json.dumps(SCHEMA))
    bias = [arg for i in no_whitespace(reference) for arg in ("--logit-bias", f"{i}=-100")]
    result = cli(daemon, "-n", "64", "--json-schema", str(schema_file), *bias, PROMPT)
    assert result.returncode == 0, result.stderr
    jsonschema.validate(json.loads(result.stdout), SCHEMA)


def test_json_object_gives_an_object(daemon, reference):
    got = generate(daemon, max_tokens=24, json_object=True, logit_bias=no_whitespace(reference))
    assert got["text"].startswith("{")  # the random model may not close it within 24 tokens


def test_choice_gives_one_of_them(daemon):
    result = cli(daemon, "--choice", "yes,no", PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout in ("yes\n", "no\n")
    choices = ["alpha", "beta", "gamma"]
    assert generate(daemon, max_tokens=16, choice=choices)["text"] in choices


def test_regex_is_matched(daemon):
    pattern = "[a-z]{3}-[0-9]{2}"
    got = generate(daemon, max_tokens=16, regex=pattern)
    assert re.fullmatch(pattern, got["text"]), got["text"]
    assert got["finish"] == "stop"
    result = cli(daemon, "-n", "16", "--regex", "[0-9]{4}", PROMPT)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch("[0-9]{4}\n", result.stdout), result.stdout


def test_grammar_file(daemon, tmp_path):
    grammar = tmp_path / "greeting.gbnf"
    grammar.write_text('root ::= "hi" | "ho" | "hey there"\n')
    result = cli(daemon, "-n", "16", "--grammar", str(grammar), PROMPT)
    assert result.returncode == 0, result.stderr
    assert result.stdout in ("hi\n", "ho\n", "hey there\n")


# -- logprobs ---------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def hf_logprobs(reference):
    """The HF float32 model's log-softmax at each position of ``prompt_ids + ids``."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(reference.model_dir, dtype=torch.float32).eval()

    def at(prompt_ids: list[int], ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt_ids + ids])).logits[0, len(prompt_ids) - 1:-1]
        return torch.log_softmax(logits.float(), dim=-1)

    return at


def test_logprobs_equal_the_hf_reference(daemon, reference, hf_logprobs):
    n, top = 8, 3
    got = generate(daemon, max_tokens=n, min_tokens=n, logprobs=top)
    prompt_ids = reference.chat_ids(PROMPT)
    assert got["ids"] == reference.greedy(prompt_ids, None, n, n)
    for chunk in got["chunks"]:  # one per token, in every reply
        assert len(chunk.logprobs) == len(chunk.token_ids)
    expected = hf_logprobs(prompt_ids, got["ids"])
    assert len(got["logprobs"]) == n
    for position, (token_id, entry) in enumerate(zip(got["ids"], got["logprobs"])):
        row = expected[position]
        assert entry.token_id == token_id
        assert entry.logprob == pytest.approx(row[token_id].item(), abs=1e-3)
        assert entry.text == reference.tokenizer.decode([token_id])
        best = row.topk(top)
        assert [t[0] for t in entry.top] == best.indices.tolist()
        for (_, logprob, text), want, i in zip(entry.top, best.values.tolist(), best.indices.tolist()):
            assert logprob == pytest.approx(want, abs=1e-3)
            assert text == reference.tokenizer.decode([i])
        assert entry.top[0][0] == token_id  # greedy: the sampled token is the most likely


def test_logprobs_zero_and_not_asked(daemon):
    got = generate(daemon, max_tokens=4, min_tokens=4, logprobs=0)
    assert len(got["logprobs"]) == 4 and all(entry.top == [] for entry in got["logprobs"])
    assert generate(daemon, max_tokens=4, min_tokens=4)["logprobs"] == []


def test_logprobs_over_a_unary_generate_stream(daemon):
    """A Client with a timeout uses Generate, not GenerateMany: the same replies."""
    unary = generate(daemon, client_kwargs={"timeout": 120}, max_tokens=4, min_tokens=4, logprobs=1)
    multiplexed = generate(daemon, max_tokens=4, min_tokens=4, logprobs=1)
    assert unary["logprobs"] == multiplexed["logprobs"] and len(unary["logprobs"]) == 4


def test_run_json_shows_logprobs(daemon, reference):
    result = cli(daemon, "-n", "5", "--json", "--logprobs", "2", PROMPT)
    assert result.returncode == 0, result.stderr
    answer = json.loads(result.stdout)
    assert len(answer["logprobs"]) == len(answer["token_ids"]) == answer["completion_tokens"]
    assert [entry["token_id"] for entry in answer["logprobs"]] == answer["token_ids"]
    assert all(len(entry["top"]) == 2 and entry["logprob"] <= 0 for entry in answer["logprobs"])
    assert answer["text"] == reference.text(answer["token_ids"])
    assert "logprobs" not in json.loads(cli(daemon, "-n", "3", "--json", PROMPT).stdout)


# -- penalties, bias, min-p, stops ------------------------------------------------------------

def test_neutral_values_equal_the_default(daemon):
    default = generate(daemon, max_tokens=16, min_tokens=16)["ids"]
    neutral = generate(daemon, max_tokens=16, min_tokens=16, repetition_penalty=1.0, presence_penalty=0.0,
                       frequency_penalty=0.0, min_p=0.0, logit_bias={})["ids"]
    assert neutral == default


@pytest.mark.parametrize("penalty", ["repetition_penalty", "presence_penalty", "frequency_penalty"])
def test_penalties_change_a_repeating_answer(daemon, penalty):
    default = generate(daemon, max_tokens=16, min_tokens=16)["ids"]
    assert len(set(default)) < len(default)  # the greedy answer repeats itself
    assert generate(daemon, max_tokens=16, min_tokens=16, **{penalty: 1.5})["ids"] != default


def test_repetition_penalty_equals_hf(daemon, reference):
    """vLLM's repetition penalty is HF's (prompt and output tokens, divide or multiply)."""
    import torch
    from transformers import AutoModelForCausalLM

    n = 12
    prompt_ids = reference.chat_ids(PROMPT)
    model = AutoModelForCausalLM.from_pretrained(reference.model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                             repetition_penalty=1.5, pad_token_id=reference.tokenizer.pad_token_id)
    assert generate(daemon, max_tokens=n, min_tokens=n, repetition_penalty=1.5)["ids"] == \
        out[0, len(prompt_ids):].tolist()


def test_logit_bias_forces_and_bans(daemon, reference):
    forced = reference.tokenizer.encode("[", add_special_tokens=False)[0]
    got = generate(daemon, max_tokens=6, logit_bias={forced: 100.0})
    assert got["ids"] == [forced] * 6
    default = generate(daemon, max_tokens=1)["ids"]
    assert generate(daemon, max_tokens=1, logit_bias={default[0]: -100.0})["ids"] != default


def test_min_p_one_is_greedy(daemon):
    """min_p 1 keeps only the most likely token: a sample at temperature 1 is the greedy answer."""
    greedy = generate(daemon, max_tokens=12, min_tokens=12)["ids"]
    assert generate(daemon, max_tokens=12, min_tokens=12, temperature=1.0, seed=3, min_p=1.0)["ids"] == greedy
    assert generate(daemon, max_tokens=12, min_tokens=12, temperature=1.0, seed=3)["ids"] != greedy


def test_stop_token_ids_stop(daemon):
    default = generate(daemon, max_tokens=16, min_tokens=16)
    stop = default["ids"][3]
    first = default["ids"].index(stop)
    got = generate(daemon, max_tokens=16, stop_token_ids=[stop])
    assert got["ids"] == default["ids"][:first + 1] and got["finish"] == "stop"
    assert default["text"].startswith(got["text"])
    result = cli(daemon, "-n", "16", "--json", "--stop-token-ids", f"{stop},{stop}", PROMPT)
    assert json.loads(result.stdout)["token_ids"] == got["ids"], result.stderr


def test_ignore_eos_goes_on(daemon, reference):
    eos = {reference.tokenizer.eos_token_id: 100.0}
    ended = generate(daemon, max_tokens=6, logit_bias=eos)
    assert len(ended["ids"]) == 1 and ended["finish"] == "stop"
    went_on = generate(daemon, max_tokens=6, logit_bias=eos, ignore_eos=True)
    assert len(went_on["ids"]) == 6 and went_on["finish"] == "length"
    result = cli(daemon, "-n", "6", "--json", "--ignore-eos", "--logit-bias",
                 f"{reference.tokenizer.eos_token_id}=100", PROMPT)
    assert json.loads(result.stdout)["finish_reason"] == "length", result.stderr


# -- refusals by name -------------------------------------------------------------------------

def test_two_constraints_are_refused_by_name(daemon, tmp_path):
    error = refused(daemon, regex="a+", choice=["x", "y"])
    assert "regex" in error.message and "choice" in error.message
    schema_file = tmp_path / "s.json"
    schema_file.write_text('{"type": "object"}')
    one_line_error(cli(daemon, "--json-schema", str(schema_file), "--regex", "a+", PROMPT),
                   "more than one", "json_schema", "regex")


def test_an_invalid_regex_is_refused_by_name(daemon):
    assert "invalid regex" in refused(daemon, regex="a(").message
    one_line_error(cli(daemon, "--regex", "a(", PROMPT), "invalid regex")


def test_invalid_schemas_and_grammars_are_refused_by_name(daemon, tmp_path):
    not_json = tmp_path / "not.json"
    not_json.write_text("{type: object")
    one_line_error(cli(daemon, "--json-schema", str(not_json), PROMPT), "--json-schema", "not JSON")
    one_line_error(cli(daemon, "--json-schema", str(tmp_path / "missing.json"), PROMPT), "--json-schema",
                   "cannot read")
    assert "invalid json_schema" in refused(daemon, json_schema="{not json").message
    bad_schema = tmp_path / "bad.schema.json"
    bad_schema.write_text('{"type": 5}')  # JSON, but no schema
    one_line_error(cli(daemon, "--json-schema", str(bad_schema), PROMPT), "invalid json_schema")
    grammar = tmp_path / "bad.gbnf"
    grammar.write_text("root ::= (\n")
    one_line_error(cli(daemon, "--grammar", str(grammar), PROMPT), "invalid grammar")


def test_values_out_of_vllms_range_are_refused_by_name(daemon):
    assert refused(daemon, repetition_penalty=0.0).message.startswith("invalid repetition_penalty")
    assert refused(daemon, logprobs=10_000).message.startswith("invalid logprobs")
    assert refused(daemon, logit_bias={10_000_000: 1.0}).message.startswith("invalid logit_bias")
    assert refused(daemon, stop_token_ids=[10_000_000]).message.startswith("invalid stop_token_ids")
    with pytest.raises(InvalidRequest, match="choice is empty"):
        generate(daemon, choice=[])
    one_line_error(cli(daemon, "--logprobs", "2", PROMPT), "--json")
    one_line_error(cli(daemon, "--logit-bias", "5", PROMPT), "--logit-bias")
    # The CLI's own range check (Typer) for penalties: a usage error, exit 2.
    assert cli(daemon, "--presence-penalty", "3", PROMPT).returncode == 2


def test_the_session_daemon_still_answers_after_the_refusals(daemon, reference):
    """Refused requests leave nothing behind: a plain request still equals the reference."""
    async def go():
        async with daemon.client() as client:
            return await collect(client, messages=MESSAGES, max_tokens=8, min_tokens=8, temperature=0.0)

    prompt_ids = reference.chat_ids(PROMPT)
    assert asyncio.run(go())["ids"] == reference.greedy(prompt_ids, None, 8, 8)


def test_logprobs_survive_vllms_merge_of_two_outputs():
    """A slow reader gets two outputs merged by vLLM (``RequestOutput.add``), which sends each flat
    position through a dict: the sampled token, when it is also the top one, is kept once."""
    from vllm.logprobs import FlatLogprobs

    from loractld.engine.params import token_logprobs

    flat = FlatLogprobs()
    flat.append_fast([5, 5, 7], [-1.0, -1.0, -2.0], iter([1, 1, 2]), ["a", "a", "b"])  # sampled 5, top 5 and 7
    flat.append_fast([9, 3, 9], [-3.0, -0.5, -3.0], iter([2, 1, 2]), ["x", "y", "x"])  # sampled 9, top 3 and 9
    merged = FlatLogprobs()
    merged.extend(flat)
    assert len(merged.token_ids) < len(flat.token_ids)  # the merge really dropped the repeats
    for logprobs in (flat, merged, list(flat)):
        got = token_logprobs(logprobs, [5, 9], 2)
        assert [(t.token_id, t.logprob, t.text) for t in got] == [(5, -1.0, "a"), (9, -3.0, "x")]
        assert [t.top for t in got] == [[(5, -1.0, "a"), (7, -2.0, "b")], [(3, -0.5, "y"), (9, -3.0, "x")]]
        assert [t.top for t in token_logprobs(logprobs, [5, 9], 1)] == [[(5, -1.0, "a")], [(3, -0.5, "y")]]
