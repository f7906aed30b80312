"""One request path for every door: the same chat sent through the gRPC door (``loractl.Client``),
``loractl run``, the HTTP door (vLLM's ``/v1/chat/completions``) and Ollama's ``/api/chat`` on one
daemon (the session's rig) gets the same tokens from each — a system prompt, stop strings and
penalties included, which each door spells its own way. tests/test_dynamo.py checks the Dynamo
door against the gRPC door the same way.

The prompt each door rendered is compared too: the gRPC door's prompt token ids equal what
vLLM's own ``/tokenize`` renders for the same messages (the HTTP door's renderer).
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ollama
import pytest

from conftest import collect

ADAPTER = "sql-expert/v1"
MESSAGES = [{"role": "system", "content": "You answer in SQL only."},
            {"role": "user", "content": "List the ten newest orders with their customers."}]
PENALTIES = {"presence_penalty": 0.4, "frequency_penalty": 0.3, "repetition_penalty": 1.15}
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(rig):
    rig.pull(ADAPTER)
    return rig


def _grpc(rig, **sampling) -> dict:
    async def go() -> dict:
        async with rig.daemon.client() as client:
            return await collect(client, messages=MESSAGES, lora=ADAPTER, max_tokens=MAX_TOKENS, temperature=0.0,
                                 **PENALTIES, **sampling)
    return asyncio.run(go())


def _http(rig, **sampling) -> dict:
    body = {"model": ADAPTER, "messages": MESSAGES, "max_tokens": MAX_TOKENS, "temperature": 0.0,
            "return_token_ids": True, **PENALTIES, **sampling}
    answer = httpx.post(f"{rig.http}/v1/chat/completions", json=body, timeout=120)
    assert answer.status_code == 200, answer.text
    choice = answer.json()["choices"][0]
    return {"ids": choice["token_ids"], "text": choice["message"]["content"], "finish": choice["finish_reason"],
            "prompt_ids": answer.json().get("prompt_token_ids")}


def _ollama(rig, stop: list[str] | None = None) -> str:
    options = {"temperature": 0, "num_predict": MAX_TOKENS, "presence_penalty": PENALTIES["presence_penalty"],
               "frequency_penalty": PENALTIES["frequency_penalty"], "repeat_penalty": PENALTIES["repetition_penalty"]}
    if stop:
        options["stop"] = stop
    answer = ollama.Client(host=rig.http, timeout=120).chat(model="sql-expert:v1", messages=MESSAGES, options=options)
    return answer.message.content


def test_the_grpc_door_renders_the_chat_as_vllms_renderer_does(served):
    grpc = _grpc(served)
    rendered = httpx.post(f"{served.http}/tokenize", json={"model": ADAPTER, "messages": MESSAGES,
                                                           "add_generation_prompt": True}, timeout=60)
    assert rendered.status_code == 200, rendered.text
    assert grpc["prompt_ids"] == rendered.json()["tokens"]


def test_every_door_gives_the_same_tokens(served):
    grpc = _grpc(served)
    assert len(grpc["ids"]) == MAX_TOKENS and grpc["finish"] == "length", grpc
    http = _http(served)
    assert (http["ids"], http["text"]) == (grpc["ids"], grpc["text"])
    assert _ollama(served) == grpc["text"]
    # loractl run: one user message (it has no system prompt or stop flag), the same penalties.
    cli = served.ok("run", "--lora", ADAPTER, "-t", "0", "-n", str(MAX_TOKENS), "--json",
                    "--presence-penalty", str(PENALTIES["presence_penalty"]),
                    "--frequency-penalty", str(PENALTIES["frequency_penalty"]),
                    "--repetition-penalty", str(PENALTIES["repetition_penalty"]), MESSAGES[1]["content"])
    async def one_message() -> dict:
        async with served.daemon.client() as client:
            return await collect(client, messages=MESSAGES[1:], lora=ADAPTER, max_tokens=MAX_TOKENS,
                                 temperature=0.0, **PENALTIES)
    single = asyncio.run(one_message())
    assert json.loads(cli.stdout)["token_ids"] == single["ids"]
    assert single["ids"] != grpc["ids"]   # the system prompt reached the engine through each door


def test_a_stop_string_ends_the_answer_alike_at_every_door(served):
    whole = _grpc(served)["text"]
    # A stop string from the middle of the greedy answer: every door must cut there.
    middle = len(whole) // 2
    stop = whole[middle:middle + 3]
    assert len(stop.strip()) >= 1, whole
    grpc = _grpc(served, stop=[stop])
    assert grpc["finish"] == "stop" and grpc["text"] == whole[:whole.index(stop)], (grpc, whole, stop)
    http = _http(served, stop=[stop])
    assert (http["ids"], http["text"], http["finish"]) == (grpc["ids"], grpc["text"], "stop")
    assert _ollama(served, [stop]) == grpc["text"]


def test_a_value_vllm_refuses_is_refused_by_every_door_by_name(served):
    async def go():
        async with served.daemon.client() as client:
            return await collect(client, messages=MESSAGES, lora=ADAPTER, max_tokens=4, repetition_penalty=0.0)
    from loractl.errors import InvalidRequest

    with pytest.raises(InvalidRequest, match="repetition_penalty"):
        asyncio.run(go())
    answer = httpx.post(f"{served.http}/v1/chat/completions", timeout=60,
                        json={"model": ADAPTER, "messages": MESSAGES, "max_tokens": 4, "repetition_penalty": 0.0})
    assert answer.status_code == 400 and "repetition_penalty" in answer.text, answer.text
