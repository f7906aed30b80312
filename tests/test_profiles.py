"""Profiles (issue 47): a named model made of an adapter (or the base model), a system prompt,
default parameters and few-shot messages, served by name through every door.

A profile's answer equals a plain request that carries the same system prompt, few-shot
messages and parameters itself — through gRPC (``loractl.Client``), HTTP
``/v1/chat/completions`` and Ollama's ``/api/chat``, on the session's rig; a request's own
values win over the profile's; ``show --modelfile`` gives a Modelfile that recreates the
profile; ``cp`` copies profiles and adapters; ``rm`` of an adapter a profile runs is refused
unless forced.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import ollama
import pytest

from conftest import collect

ADAPTER = "sql-expert/v1"
SYSTEM = "You answer in SQL only."
SHOTS = [{"role": "user", "content": "Count the customers."},
         {"role": "assistant", "content": "SELECT COUNT(*) FROM customers;"}]
QUESTION = [{"role": "user", "content": "List the ten newest orders."}]
MODELFILE = f'''# a SQL assistant
FROM {ADAPTER}
SYSTEM """{SYSTEM}"""
PARAMETER temperature 0
PARAMETER num_predict 12
PARAMETER repeat_penalty 1.15
MESSAGE user {SHOTS[0]["content"]}
MESSAGE assistant {SHOTS[1]["content"]}
'''
PLAIN = [{"role": "system", "content": SYSTEM}, *SHOTS, *QUESTION]


@pytest.fixture(scope="module")
def served(rig, tmp_path_factory):
    rig.pull(ADAPTER)
    path = tmp_path_factory.mktemp("modelfile") / "Modelfile"
    path.write_text(MODELFILE)
    rig.ok("create", "sql-assistant", "-f", str(path))
    return rig


def _grpc(rig, lora: str, messages: list[dict], **sampling) -> dict:
    async def go() -> dict:
        async with rig.daemon.client() as client:
            return await collect(client, messages=messages, lora=lora, **sampling)
    return asyncio.run(go())


def test_a_profile_answers_as_the_plain_request_through_every_door(served):
    plain = _grpc(served, ADAPTER, PLAIN, temperature=0.0, max_tokens=12, repetition_penalty=1.15)
    assert len(plain["ids"]) == 12, plain
    profiled = _grpc(served, "sql-assistant", QUESTION)
    assert (profiled["ids"], profiled["text"]) == (plain["ids"], plain["text"])
    http = httpx.post(f"{served.http}/v1/chat/completions", timeout=120,
                      json={"model": "sql-assistant", "messages": QUESTION, "return_token_ids": True})
    assert http.status_code == 200, http.text
    choice = http.json()["choices"][0]
    assert (choice["token_ids"], choice["message"]["content"]) == (plain["ids"], plain["text"])
    answer = ollama.Client(host=served.http, timeout=120).chat(model="sql-assistant", messages=QUESTION)
    assert answer.message.content == plain["text"]
    # Without the profile the same question answers otherwise: the defaults reached the engine.
    bare = _grpc(served, ADAPTER, QUESTION, temperature=0.0, max_tokens=12, repetition_penalty=1.15)
    assert bare["ids"] != plain["ids"]


def test_the_requests_own_values_win(served):
    own_system = [{"role": "system", "content": "You are terse."}, *QUESTION]
    plain = _grpc(served, ADAPTER, [own_system[0], *SHOTS, *QUESTION], temperature=0.0, max_tokens=5,
                  repetition_penalty=1.15)
    profiled = _grpc(served, "sql-assistant", own_system, max_tokens=5)
    assert profiled["ids"] == plain["ids"] and len(plain["ids"]) == 5


def test_show_ls_modelfile_copy_and_rm(served):
    shown = json.loads(served.ok("show", "sql-assistant", "--json").stdout)
    assert shown["kind"] == "profile" and shown["profile"]["adapter"] == ADAPTER
    assert shown["profile"]["system"] == SYSTEM and len(shown["profile"]["messages"]) == 2
    text = served.ok("show", "sql-assistant", "--modelfile").stdout
    assert text.startswith("# Modelfile generated") and f"FROM {ADAPTER}" in text
    listing = served.ok("ls").stdout
    assert "PROFILE" in listing and "sql-assistant" in listing and "temperature=0.0" in listing
    served.ok("cp", "sql-assistant", "sql-assistant-copy")
    copy = json.loads(served.ok("show", "sql-assistant-copy", "--modelfile", "--json").stdout)
    assert copy["modelfile"] == text
    refused = served.cli("rm", ADAPTER)
    assert refused.returncode == 2 and "used by profiles sql-assistant, sql-assistant-copy" in refused.stderr
    served.ok("rm", "sql-assistant-copy")
    assert served.cli("show", "sql-assistant-copy").returncode != 0


def test_create_from_flags_and_refusals(served):
    served.ok("create", "base-terse", "--from", "base" if False else json.loads(
        served.ok("status", "--json").stdout)["engine"]["model_name"], "--system", "Be terse.",
        "--param", "temperature=0", "--param", "num_predict=3")
    base = _grpc(served, "base-terse", QUESTION)
    assert len(base["ids"]) == 3
    bad = served.cli("create", "x", "--from", ADAPTER, "--param", "mirostat=2")
    assert bad.returncode == 2 and "mirostat" in bad.stderr
    clash = served.cli("create", ADAPTER, "--from", ADAPTER)
    assert clash.returncode == 2 and "is an adapter" in clash.stderr
    served.ok("rm", "base-terse")
