"""Issue 47, items 3 and 5: a profile is a model in every door, on the session's rig.

One profile, ``duo`` (the base model, two weighted ADAPTER lines, a system prompt, temperature 0
and num_predict), made once for the module. What every door answers for it is checked against
the gRPC door's answer for the same name, which itself equals HF + PEFT's cat merge of the same
adapters under the same system prompt (tests/test_merge.py):

- the official ``openai`` client lists it and its chat answers with PEFT's tokens; its
  ``completions`` (a raw prompt) answers as the plain request with the profile's adapter and
  parameters, without its system prompt (the rule in ``loractld.core.profiles``);
- ``loractl run --lora`` and ``loractl chat --lora`` (stdin, not a terminal) print the gRPC text:
  the CLI sends no temperature of its own, so the profile's reaches the engine;
- ``GenerateMany``: the profile among plain requests on one stream, each its own answer;
- Ollama's ``/api/generate`` with the profile's system prompt (or the request's, which replaces
  it; ``raw`` as /v1/completions) and ``/api/show``'s Modelfile as ``loractl show --modelfile``;
- /tokenize renders the profile's prompt; /v1/responses and Anthropic's /v1/messages take its
  system prompt and parameters under their own names, and refuse by name what they cannot carry;
- a Jinja TEMPLATE: the engine's prompt is that template's rendering (HF's), answered with PEFT's
  tokens through gRPC and HTTP; a client's own chat_template stays refused.

The Dynamo door's checks are in tests/test_dynamo.py (its fleet of two daemons).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from pathlib import Path

import httpx
import ollama
import openai
import pytest

from conftest import collect, run_cli
from support_merges import MERGES, NEW_TOKENS, PROMPT, PeftMerge, pull_sources

WEIGHTS = MERGES["m/two"]
SYSTEM = "You finish the user's sentence."
QUESTION = [{"role": "user", "content": PROMPT}]


@dataclass
class Duo:
    rig: object
    folders: dict[str, Path]
    model_dir: Path
    adapter: str     # the merged adapter the profile runs
    exact: dict      # the gRPC door's answer with min_tokens=NEW_TOKENS: PEFT's tokens
    plain: dict      # the gRPC door's answer with the profile's own parameters only

    def grpc(self, lora: str = "duo", **kwargs) -> dict:
        async def go() -> dict:
            async with self.rig.daemon.client() as client:
                return await collect(client, lora=lora, **kwargs)
        return asyncio.run(go())


@pytest.fixture(scope="module")
def duo(rig, demo, tmp_path_factory) -> Duo:
    root = tmp_path_factory.mktemp("profile-doors")
    folders = pull_sources(rig, demo, root)
    base = json.loads(rig.ok("status", "--json").stdout)["engine"]["model_arg"]
    (root / "Modelfile").write_text("\n".join([
        f"FROM {base}", *(f"ADAPTER {n}={w}" for n, w in WEIGHTS.items()), f'SYSTEM """{SYSTEM}"""',
        "PARAMETER temperature 0", f"PARAMETER num_predict {NEW_TOKENS}", ""]))
    rig.ok("create", "duo", "-f", str(root / "Modelfile"))
    adapter = json.loads(rig.ok("show", "duo", "--json").stdout)["profile"]["adapter"]
    made = Duo(rig, folders, demo / "model", adapter, {}, {})
    made.exact = made.grpc(messages=QUESTION, min_tokens=NEW_TOKENS)
    ids, _ = PeftMerge(made.model_dir, folders).greedy(WEIGHTS, made.exact["prompt_ids"])
    assert made.exact["ids"] == ids, "the gRPC door is not PEFT's merge: see tests/test_merge.py"
    made.plain = made.grpc(messages=QUESTION)
    assert made.plain["text"], made.plain
    return made


def test_the_openai_client_picks_the_profile(duo):
    client = openai.OpenAI(base_url=duo.rig.http + "/v1", api_key="unused", timeout=120)
    assert "duo" in [m.id for m in client.models.list()]
    chat = client.chat.completions.create(model="duo", messages=QUESTION,
                                          extra_body={"min_tokens": NEW_TOKENS, "return_token_ids": True})
    choice = chat.choices[0].model_dump()
    assert (choice["token_ids"], choice["message"]["content"]) == (duo.exact["ids"], duo.exact["text"])
    assert chat.model == "duo"
    # Its own parameters only (temperature 0, num_predict): the gRPC door's answer.
    assert client.chat.completions.create(model="duo", messages=QUESTION).choices[0].message.content == \
        duo.plain["text"]


def test_a_raw_completion_takes_the_profiles_adapter_and_parameters_not_its_system_prompt(duo):
    from transformers import AutoTokenizer

    client = openai.OpenAI(base_url=duo.rig.http + "/v1", api_key="unused", timeout=120)
    profiled = client.completions.create(model="duo", prompt=PROMPT, extra_body={"min_tokens": NEW_TOKENS})
    plain = client.completions.create(model=duo.adapter, prompt=PROMPT, temperature=0, max_tokens=NEW_TOKENS,
                                      extra_body={"min_tokens": NEW_TOKENS})
    assert profiled.choices[0].text == plain.choices[0].text
    # The prompt as sent (no system prompt, no template), greedy, num_predict tokens: PEFT's merge.
    prompt_ids = AutoTokenizer.from_pretrained(duo.model_dir).encode(PROMPT)
    ids, _ = PeftMerge(duo.model_dir, duo.folders).greedy(WEIGHTS, prompt_ids)
    assert profiled.usage.prompt_tokens == len(prompt_ids) and profiled.usage.completion_tokens == NEW_TOKENS
    assert profiled.choices[0].text == AutoTokenizer.from_pretrained(duo.model_dir).decode(ids)
    # Without min_tokens the profile's num_predict still bounds it (vLLM's own default is 16).
    bounded = client.completions.create(model="duo", prompt=PROMPT)
    assert bounded.usage.completion_tokens <= NEW_TOKENS


def test_loractl_run_and_chat_answer_with_the_profile(duo):
    ran = duo.rig.ok("run", "--lora", "duo", PROMPT)
    assert ran.stdout == duo.plain["text"] + "\n"
    as_json = json.loads(duo.rig.ok("run", "--lora", "duo", "--json", PROMPT).stdout)
    assert as_json["token_ids"] == duo.plain["ids"]
    chatted = run_cli("chat", "--lora", "duo", "--socket", str(duo.rig.daemon.socket), input=PROMPT + "\n",
                      timeout=120)
    assert chatted.returncode == 0, chatted.stderr
    assert chatted.stdout == duo.plain["text"] + "\n"
    # The CLI's own temperature still wins when given (a sampled answer differs from the greedy one).
    sampled = json.loads(duo.rig.ok("run", "--lora", "duo", "--json", "-t", "2", "--seed", "7", PROMPT).stdout)
    assert sampled["token_ids"] != duo.plain["ids"]


def test_generate_many_runs_the_profile_among_plain_requests(duo, reference):
    plain_request = dict(messages=QUESTION, max_tokens=NEW_TOKENS, min_tokens=NEW_TOKENS, temperature=0.0)

    async def go():
        async with duo.rig.daemon.client() as client:
            results = await asyncio.gather(
                collect(client, lora="m/plain", **plain_request),
                collect(client, lora="duo", messages=QUESTION, min_tokens=NEW_TOKENS),
                collect(client, lora="m/rslora", **plain_request),
                collect(client, lora="duo", messages=QUESTION))
            return results, client._mux.streams_opened

    (first, profiled, second, own), streams = asyncio.run(go())
    assert streams == 1
    assert (profiled["ids"], profiled["text"]) == (duo.exact["ids"], duo.exact["text"])
    assert own["ids"] == duo.plain["ids"]
    for name, got in (("m/plain", first), ("m/rslora", second)):
        # A plain request carries no system prompt: the profile's stayed with the profile's requests.
        assert got["prompt_ids"] == reference.chat_ids(PROMPT) != duo.exact["prompt_ids"]
        assert got["ids"] == reference.greedy(got["prompt_ids"], duo.folders[name], NEW_TOKENS, NEW_TOKENS), name


def test_ollamas_generate_applies_the_profile_and_show_gives_its_modelfile(duo):
    client = ollama.Client(host=duo.rig.http, timeout=120)
    assert client.generate(model="duo", prompt=PROMPT).response == duo.plain["text"]
    # The request's system replaces the profile's, as Ollama does.
    own = "Answer in French."
    want = duo.grpc(messages=[{"role": "system", "content": own}, *QUESTION])
    assert want["prompt_ids"] != duo.plain["prompt_ids"]
    assert client.generate(model="duo", prompt=PROMPT, system=own).response == want["text"]
    # raw: the prompt as sent, with the profile's adapter and parameters (as /v1/completions).
    raw = client.generate(model="duo", prompt=PROMPT, raw=True)
    completion = httpx.post(f"{duo.rig.http}/v1/completions", timeout=120,
                            json={"model": duo.adapter, "prompt": PROMPT, "temperature": 0, "max_tokens": NEW_TOKENS})
    assert raw.response == completion.json()["choices"][0]["text"] and raw.eval_count <= NEW_TOKENS

    shown = client.show("duo")
    modelfile = duo.rig.ok("show", "duo", "--modelfile").stdout
    assert shown.modelfile == modelfile
    for line in [f"ADAPTER {n}={w}" for n, w in WEIGHTS.items()] + [SYSTEM, "PARAMETER temperature 0"]:
        assert line in modelfile, (line, modelfile)
    assert "temperature" in shown.parameters and "num_predict" in shown.parameters
    assert httpx.post(f"{duo.rig.http}/api/show", json={"model": "duo"}).json()["system"] == SYSTEM


def test_tokenize_responses_and_anthropic_messages_take_the_profile(duo):
    http = duo.rig.http
    tokens = httpx.post(f"{http}/tokenize", timeout=60, json={"model": "duo", "messages": QUESTION,
                                                               "add_generation_prompt": True})
    assert tokens.status_code == 200 and tokens.json()["tokens"] == duo.plain["prompt_ids"], tokens.text
    # /v1/responses: the system prompt as instructions, num_predict as max_output_tokens.
    client = openai.OpenAI(base_url=http + "/v1", api_key="unused", timeout=120)
    response = client.responses.create(model="duo", input=PROMPT)
    assert response.output_text == duo.plain["text"] and response.usage.output_tokens <= NEW_TOKENS
    # Anthropic's /v1/messages (max_tokens is required there): the system prompt as system.
    anthropic = httpx.post(f"{http}/v1/messages", timeout=120, json={
        "model": "duo", "max_tokens": NEW_TOKENS, "messages": QUESTION})
    assert anthropic.status_code == 200, anthropic.text
    assert anthropic.json()["content"][0]["text"] == duo.plain["text"]
    # A part a route has no field for is refused by name, not dropped.
    duo.rig.ok("create", "penalised", "--from", "m/plain", "--param", "repeat_penalty=1.3")
    try:
        refused = httpx.post(f"{http}/v1/messages", timeout=60, json={
            "model": "penalised", "max_tokens": 2, "messages": QUESTION})
        # Anthropic's error shape: the message names the line; the hint is in the OpenAI routes' shape.
        assert refused.status_code == 400 and "PARAMETER repeat_penalty" in refused.text, refused.text
        responses = httpx.post(f"{http}/v1/responses", timeout=60, json={"model": "penalised", "input": PROMPT,
                                                                          "max_output_tokens": 2})
        assert responses.status_code == 200, responses.text   # /v1/responses has repetition_penalty
    finally:
        duo.rig.ok("rm", "penalised")


TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>: {% endif %}")


def test_a_profiles_jinja_template_renders_its_prompt(duo, tmp_path):
    from transformers import AutoTokenizer

    rig = duo.rig
    (tmp_path / "Modelfile").write_text(f'FROM m/plain\nTEMPLATE """{TEMPLATE}"""\nSYSTEM """{SYSTEM}"""\n'
                                        f"PARAMETER temperature 0\nPARAMETER num_predict {NEW_TOKENS}\n")
    rig.ok("create", "templated", "-f", str(tmp_path / "Modelfile"))
    try:
        messages = [{"role": "system", "content": SYSTEM}, *QUESTION]
        tokenizer = AutoTokenizer.from_pretrained(duo.model_dir)
        text = tokenizer.apply_chat_template(messages, chat_template=TEMPLATE, add_generation_prompt=True,
                                             tokenize=False)
        assert text.startswith(f"<system>: {SYSTEM}\n<user>: {PROMPT}\n")
        want_prompt = tokenizer.encode(text, add_special_tokens=False)
        got = duo.grpc("templated", messages=QUESTION, min_tokens=NEW_TOKENS)
        assert got["prompt_ids"] == want_prompt
        ids, _ = PeftMerge(duo.model_dir, duo.folders).greedy({"m/plain": 1.0}, want_prompt)
        assert got["ids"] == ids
        http = httpx.post(f"{rig.http}/v1/chat/completions", timeout=120, json={
            "model": "templated", "messages": QUESTION, "min_tokens": NEW_TOKENS, "return_token_ids": True})
        assert http.status_code == 200, http.text
        assert http.json()["choices"][0]["token_ids"] == ids and http.json()["prompt_token_ids"] == want_prompt
        rendered = httpx.post(f"{rig.http}/tokenize", timeout=60, json={
            "model": "templated", "messages": QUESTION, "add_generation_prompt": True})
        assert rendered.status_code == 200 and rendered.json()["tokens"] == want_prompt, rendered.text
        refused = httpx.post(f"{rig.http}/v1/responses", timeout=60, json={"model": "templated", "input": PROMPT})
        assert refused.status_code == 400 and "TEMPLATE" in refused.text, refused.text
        # The profile's template is the daemon owner's; a client's own is still refused (vLLM's
        # --trust-request-chat-template), with the profile's name or without.
        for model in ("m/plain", "templated"):
            own = httpx.post(f"{rig.http}/v1/chat/completions", timeout=120, json={
                "model": model, "messages": QUESTION, "chat_template": TEMPLATE + " ", "max_tokens": 2})
            assert own.status_code == 400 and "--trust-request-chat-template" in own.text, (model, own.text)
    finally:
        rig.ok("rm", "templated")

