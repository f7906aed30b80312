"""Ollama's API on the HTTP door, driven by the official ``ollama`` Python client against a real
daemon (the session's ``rig``: --http, no key), and its translations as pure functions.

Greedy answers (temperature 0) are checked against the HF + PEFT reference, token for token."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from datetime import datetime

import httpx
import ollama
import pytest

from loractld.api.ollama.names import hub_reference, listed_name, resolve
from loractld.api.ollama.options import map_format, map_options, parse_keep_alive
from loractld.api.ollama.pulls import progress_line
from loractld.api.ollama.translate import Clock, Stream, answer, chat_body, generate_body

ADAPTERS = ["sql-expert/v1", "python-expert/v1"]
PROMPT = "How do I reverse a list in Python?"
TOKENS = 16


# -- translations, without a daemon ------------------------------------------------------------
def test_names_map_both_ways_and_every_listed_name_resolves_back():
    stored = {"sql-expert/v1", "pirate", "solo", "solo/latest", "org/repo"}
    listed = {name: listed_name(name, stored) for name in stored}
    assert listed == {"sql-expert/v1": "sql-expert:v1", "pirate": "pirate:latest", "solo": "solo",
                      "solo/latest": "solo:latest", "org/repo": "org:repo"}
    for name, shown in listed.items():
        assert resolve(shown, {"tiny"}, stored.__contains__).adapter == name
    assert resolve("sql-expert/v1", {"tiny"}, stored.__contains__).adapter == "sql-expert/v1"  # loractl's spelling
    assert resolve("SQL-Expert:v1", {"tiny"}, stored.__contains__).adapter == "sql-expert/v1"
    assert resolve("pirate", {"tiny"}, stored.__contains__).adapter == "pirate"
    assert resolve("hf.co/Org/Repo:latest", {"tiny"}, stored.__contains__).adapter == "org/repo"
    assert resolve("tiny:latest", {"tiny"}, stored.__contains__).adapter is None   # the base model
    assert resolve("tiny", {"tiny"}, stored.__contains__).adapter is None
    assert resolve("sql-expert:v2", {"tiny"}, stored.__contains__) is None
    assert hub_reference("hf.co/Org/Repo:v2") == ("Org/Repo", "v2")   # /api/pull: the Hub repo at a revision
    assert hub_reference("huggingface.co/Org/Repo:latest") == ("Org/Repo", "") and hub_reference("org/repo") is None


def test_options_are_mapped_or_refused_by_name():
    assert map_options({"temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7, "num_predict": 9,
                        "stop": "x", "repeat_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3,
                        "num_ctx": 512, "mirostat": 0, "typical_p": 1.0, "tfs_z": None}, context=1024) == {
        "temperature": 0, "top_p": 0.5, "top_k": 3, "min_p": 0.1, "seed": 7, "max_tokens": 9, "stop": ["x"],
        "repetition_penalty": 1.1, "presence_penalty": 0.2, "frequency_penalty": 0.3}
    assert map_options({"num_predict": -1}, context=1024) == {}   # as many as the context allows
    for options, named in [({"mirostat": 2}, "options.mirostat"), ({"num_gpu": 1}, "options.num_gpu"),
                           ({"bogus": 1}, "options.bogus"), ({"num_ctx": 4096}, "options.num_ctx"),
                           ({"repeat_penalty": 1.2, "repeat_last_n": 64}, "options.repeat_last_n"),
                           ({"temperature": "hot"}, "options.temperature")]:
        with pytest.raises(Exception) as refused:
            map_options(options, context=1024)
        assert refused.value.status == 400 and refused.value.param == named, options
        assert named.removeprefix("options.") in refused.value.message and refused.value.hint
    assert map_format("json") == {"response_format": {"type": "json_object"}}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}}
    assert map_format(schema)["response_format"]["json_schema"]["schema"] == schema


def test_keep_alive_means_a_tier():
    assert [parse_keep_alive(v).action for v in (None, 0, "0", "0s", -1, "-1m", "5m", 300, "1h30m")] == \
        [None, "evict", "evict", "evict", "pin", "pin", None, None, None]
    with pytest.raises(Exception) as refused:
        parse_keep_alive("soon")
    assert refused.value.param == "keep_alive"


def test_chat_requests_become_openai_requests_with_tool_call_ids():
    body = chat_body({"model": "sql-expert:v1", "stream": True, "tools": [{"type": "function", "function": {
        "name": "add", "parameters": {"type": "object"}}}], "messages": [
        {"role": "user", "content": "1+2?"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1}}}]},
        {"role": "tool", "content": "3", "tool_name": "add"}]}, "sql-expert/v1", 1024)
    assert body["model"] == "sql-expert/v1" and body["stream_options"] == {"include_usage": True}
    call = body["messages"][1]["tool_calls"][0]
    assert call["function"] == {"name": "add", "arguments": '{"a": 1}'}
    assert body["messages"][2]["tool_call_id"] == call["id"]
    for field, value in [("think", True), ("images", ["aGk="]), ("bogus", 1)]:
        with pytest.raises(Exception) as refused:
            chat_body({"model": "m", "messages": [], field: value}, "m", None)
        assert refused.value.param == field and refused.value.status == 400


def test_generate_requests_raw_or_templated():
    route, body = generate_body({"model": "m", "prompt": "p", "system": "s", "stream": False}, "m", None)
    assert route == "chat" and body["messages"] == [{"role": "system", "content": "s"},
                                                    {"role": "user", "content": "p"}]
    route, body = generate_body({"model": "m", "prompt": "SELECT", "raw": True}, "m", None)
    assert route == "completion" and body["prompt"] == "SELECT" and body["stream"] is True
    for field, value in [("template", "{{ .Prompt }}"), ("context", [1, 2]), ("suffix", "x"), ("images", ["a"])]:
        with pytest.raises(Exception) as refused:
            generate_body({"model": "m", "prompt": "p", field: value}, "m", None)
        assert refused.value.param == field


def test_openai_chunks_become_ollama_lines():
    stream = Stream("chat", "sql-expert:v1", Clock())
    lines = stream.feed({"choices": [{"index": 0, "delta": {"role": "assistant", "content": "He"}}]})
    lines += stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [
        {"index": 0, "id": "c", "function": {"name": "add", "arguments": '{"a"'}}]}}]})
    lines += stream.feed({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {
        "arguments": ": 2}"}}]}, "finish_reason": "tool_calls"}]})
    lines += stream.feed({"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 3}})
    lines += stream.finish()
    assert [part["message"]["content"] for part in lines] == ["He", "", ""]
    assert lines[1]["message"]["tool_calls"] == [{"function": {"name": "add", "arguments": {"a": 2}}}]
    last = lines[-1]
    assert last["done"] is True and last["done_reason"] == "stop" and not lines[0]["done"]
    assert (last["prompt_eval_count"], last["eval_count"]) == (5, 3) and last["model"] == "sql-expert:v1"
    assert last["total_duration"] >= last["eval_duration"] >= 0 and last["prompt_eval_duration"] >= 0
    assert datetime.fromisoformat(last["created_at"]).tzinfo is not None
    whole = answer("generate", "m", {"choices": [{"message": {"content": "hi"}, "finish_reason": "length"}],
                                     "usage": {"prompt_tokens": 2, "completion_tokens": 1}}, Clock())
    assert (whole["response"], whole["done_reason"], whole["eval_count"]) == ("hi", "length", 1)


def test_pull_progress_lines_are_ollamas():
    assert progress_line("resolving", "", 0, 0) == {"status": "pulling manifest"}
    assert progress_line("downloading", "adapter_model.safetensors", 5, 10) == {
        "status": "pulling adapter_model.safetensors", "digest": "adapter_model.safetensors", "total": 10,
        "completed": 5}
    assert progress_line("done", "", 0, 0) == {"status": "success"}


# -- the real daemon ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def api(rig):
    rig.pull(*ADAPTERS)
    return rig


def client(rig) -> ollama.Client:
    return ollama.Client(host=rig.http, timeout=120)


def greedy(reference, demo, adapter: str | None, prompt_ids: list[int], n: int = TOKENS) -> list[int]:
    return reference.greedy(prompt_ids, demo / "adapters" / adapter if adapter else None, n)


def test_the_probe_version_and_the_listings(api):
    assert httpx.get(api.http + "/").text == "Ollama is running"
    assert httpx.head(api.http + "/").status_code == 200
    assert client(api).ps()  # answers
    assert httpx.get(api.http + "/api/version").json()["version"]
    listed = {m.model: m for m in client(api).list().models}
    assert {"tiny:latest", "sql-expert:v1", "python-expert:v1"} <= set(listed)
    sql = listed["sql-expert:v1"]
    assert sql.details.parent_model == "tiny:latest" and sql.size > 0 and len(sql.digest) == 64
    assert sql.modified_at.tzinfo is not None and "lora" in sql.details.families
    assert listed["tiny:latest"].details.parameter_size
    for name in listed:   # every listed name means the model it lists
        shown = client(api).show(name)
        assert shown.details.parent_model == listed[name].details.parent_model and "completion" in shown.capabilities
    shown = client(api).show("sql-expert/v1")   # loractl's own spelling too
    assert "lora_rank" in shown.parameters and shown.modelinfo["lora.rank"] > 0 and shown.template
    assert "tools" in shown.capabilities   # the rig runs with --enable-auto-tool-choice --tool-call-parser hermes
    assert any(k.endswith(".context_length") for k in shown.modelinfo)


def test_unknown_models_and_refused_options_in_ollamas_shape(api):
    with pytest.raises(ollama.ResponseError) as e:
        client(api).chat("no-such:model", messages=[{"role": "user", "content": "hi"}])
    assert e.value.status_code == 404 and "not found" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:
        client(api).show("sql-expert:v9")
    assert e.value.status_code == 404 and "sql-expert:v1" in e.value.error   # a close match, as listed
    with pytest.raises(ollama.ResponseError) as e:
        client(api).generate("sql-expert:v1", "hi", options={"mirostat": 2})
    assert e.value.status_code == 400 and "options.mirostat" in e.value.error
    with pytest.raises(ollama.ResponseError) as e:   # the OpenAI door's refusal, naming Ollama's field too
        client(api).chat("tiny", messages=[{"role": "user", "content": "hi"}], options={"num_predict": 5000})
    assert e.value.status_code == 400 and "options.num_predict" in e.value.error
    raw = httpx.post(api.http + "/api/chat", json={"model": "tiny", "messages": [], "options": {"num_gpu": 1}})
    assert raw.status_code == 400 and set(raw.json()) == {"error", "hint"}
    assert httpx.post(api.http + "/api/embed", json={"model": "tiny", "input": "x"}).status_code in (403, 501)


def test_pull_a_folder_then_delete_it(api, tmp_path):
    folder = tmp_path / "ollama-pulled" / "v1"
    shutil.copytree(api.root / "tiny" / "adapters" / "poet" / "v1", folder)
    statuses = list(client(api).pull(str(folder), stream=True))
    assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success"
    downloads = [s for s in statuses if s.digest]
    assert downloads and all(s.total and s.completed is not None for s in downloads)
    assert "ollama-pulled:v1" in {m.model for m in client(api).list().models}
    assert client(api).pull(str(folder)).status == "success"   # stream: false, and up to date
    client(api).delete("ollama-pulled:v1")
    assert "ollama-pulled:v1" not in {m.model for m in client(api).list().models}
    with pytest.raises(ollama.ResponseError) as e:
        client(api).delete("ollama-pulled:v1")
    assert e.value.status_code == 404


@pytest.mark.parametrize("adapter", [None, "sql-expert/v1"], ids=["base", "sql"])
def test_chat_and_generate_equal_the_reference(api, demo, reference, adapter):
    name = listed_name(adapter, set()) if adapter else "tiny:latest"
    ids = greedy(reference, demo, adapter, reference.chat_ids(PROMPT))
    want = reference.text(ids)
    options = {"temperature": 0, "num_predict": TOKENS}
    messages = [{"role": "user", "content": PROMPT}]
    whole = client(api).chat(name, messages=messages, options=options)
    assert whole.message.content == want and whole.done and whole.model == name
    assert whole.done_reason == ("length" if len(ids) == TOKENS else "stop") and whole.eval_count == len(ids)
    assert whole.prompt_eval_count == len(reference.chat_ids(PROMPT)) and whole.total_duration > 0
    # A whole answer splits its time at its first token, as a streamed one does (all of it went to
    # prompt_eval_duration, and clients computed ~900,000 tokens/s from eval_duration).
    assert 0 < whole.prompt_eval_duration < whole.total_duration and whole.eval_duration > 0
    if whole.eval_count > 1:
        assert whole.eval_count / (whole.eval_duration / 1e9) < 20_000, whole
    parts = list(client(api).chat(name, messages=messages, options=options, stream=True))
    assert "".join(p.message.content for p in parts) == want and parts[-1].done and not parts[0].done
    assert parts[-1].eval_count == whole.eval_count and parts[-1].eval_duration > 0
    assert client(api).generate(name, PROMPT, options=options).response == want
    assert "".join(p.response for p in client(api).generate(name, PROMPT, options=options, stream=True)) == want
    raw = client(api).generate(name, "SELECT name FROM", raw=True, options=options).response
    assert raw == reference.text(greedy(reference, demo, adapter, reference.tokenizer.encode("SELECT name FROM")))


def test_logprobs_of_chat_and_raw_generate(api):
    for whole in (client(api).chat("sql-expert:v1", messages=[{"role": "user", "content": "hi"}], logprobs=True,
                                   top_logprobs=2, options={"temperature": 0, "num_predict": 3}),
                  client(api).generate("sql-expert:v1", "SELECT", raw=True, logprobs=True, top_logprobs=2,
                                       options={"temperature": 0, "num_predict": 3})):
        assert len(whole.logprobs) == whole.eval_count == 3
        assert all(p.logprob <= 0 and len(p.top_logprobs) == 2 for p in whole.logprobs)
        assert whole.logprobs[0].token == whole.logprobs[0].top_logprobs[0].token   # greedy: the likeliest


def openai_chat(api, **body) -> dict:
    reply = httpx.post(api.http + "/v1/chat/completions", json=body, timeout=120)
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]


def test_format_json_schema_gives_what_the_openai_door_gives(api):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"],
              "additionalProperties": False}
    messages = [{"role": "user", "content": "Is SQL a language? Answer in JSON."}]
    ours = client(api).chat("sql-expert:v1", messages=messages, format=schema,
                            options={"temperature": 0, "num_predict": 48})
    theirs = openai_chat(api, model="sql-expert/v1", messages=messages, temperature=0, max_tokens=48,
                         response_format={"type": "json_schema", "json_schema": {"name": "format", "schema": schema}})
    assert ours.message.content == theirs["message"]["content"]
    if ours.done_reason == "stop":
        assert isinstance(json.loads(ours.message.content)["ok"], bool)
    whole = client(api).generate("sql-expert:v1", "Is SQL a language?", format="json",
                                 options={"temperature": 0, "num_predict": 48})
    if whole.done_reason == "stop":
        assert isinstance(json.loads(whole.response), dict)


def test_tools_and_tool_answers_as_the_openai_door_answers_them(api):
    tools = [{"type": "function", "function": {"name": "add", "description": "Add two numbers", "parameters": {
        "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}, "required": ["a", "b"]}}}]
    asked = [{"role": "user", "content": "What is 2 + 3?"}]
    answered = asked + [{"role": "assistant", "content": "", "tool_calls": [{"function": {
        "name": "add", "arguments": {"a": 2, "b": 3}}}]}, {"role": "tool", "content": "5", "tool_name": "add"}]
    for messages in (asked, answered):
        ours = client(api).chat("sql-expert:v1", messages=messages, tools=tools,
                                options={"temperature": 0, "num_predict": TOKENS})
        theirs = openai_chat(api, model="sql-expert/v1", messages=chat_body({"messages": messages}, "m", None)[
            "messages"], tools=tools, temperature=0, max_tokens=TOKENS)["message"]
        assert ours.message.content == (theirs["content"] or "")
        assert [(c.function.name, dict(c.function.arguments)) for c in ours.message.tool_calls or []] == [
            (c["function"]["name"], json.loads(c["function"]["arguments"])) for c in theirs.get("tool_calls") or []]


def test_keep_alive_zero_evicts_and_minus_one_pins(api):
    def ps() -> dict:
        return {m.model: m for m in client(api).ps().models}

    options = {"temperature": 0, "num_predict": 2}
    client(api).chat("python-expert:v1", messages=[{"role": "user", "content": "hi"}], options=options)
    assert "python-expert:v1" in ps()   # used: in the engine
    client(api).chat("python-expert:v1", messages=[{"role": "user", "content": "hi"}], options=options, keep_alive=0)
    assert "python-expert:v1" not in ps()
    # The rig is shared: a pin another test left would take the one host pin it allows.
    # ``pinned`` in the listing is the weights' (names with the same bytes share it): unpin what
    # unpins, and put back exactly those.
    others = []
    for a in json.loads(api.ok("ls", "--json").stdout):
        if a["pinned"] and api.cli("unpin", a["name"]).returncode == 0:
            others.append((a["name"], a["pin"]))
    try:
        client(api).generate("python-expert:v1", "hi", options=options, keep_alive=-1)
        assert ps()["python-expert:v1"].expires_at.year == 9999
    finally:
        api.cli("unpin", "python-expert/v1")
        for name, tier in others:
            api.ok("pin", name, "--to", tier or "host")
    assert client(api).generate("python-expert:v1", keep_alive=0).done_reason == "unload"
    assert "python-expert:v1" not in ps()


NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("curl"),
                    reason="needs root, setpriv and curl to call as another user")
def test_a_keyless_stranger_may_list_but_not_pin_pull_or_delete(api):
    def curl(method: str, path: str, body: dict | None = None) -> tuple[int, str]:
        args = ["-X", method, "-H", "Content-Type: application/json"] + (["-d", json.dumps(body)] if body else [])
        out = subprocess.run([*NOBODY, "curl", "-s", "-m", "60", "-w", "\n%{http_code}", *args, api.http + path],
                             capture_output=True, text=True).stdout
        text, _, code = out.rpartition("\n")
        return int(code), text

    assert curl("GET", "/api/tags")[0] == 200
    for method, path, body in [("POST", "/api/chat", {"model": "sql-expert:v1", "keep_alive": -1, "messages": [
            {"role": "user", "content": "hi"}]}), ("POST", "/api/generate", {"model": "sql-expert:v1",
                                                                               "keep_alive": 0}),
            ("POST", "/api/pull", {"model": "hf.co/acme/x"}), ("DELETE", "/api/delete", {"model": "sql-expert:v1"})]:
        status, text = curl(method, path, body)
        assert status == 403 and "may not" in json.loads(text)["error"], (path, status, text)
    log = api.daemon.log.read_text(errors="replace")
    for operation, target in [("pin", "sql-expert/v1"), ("evict", "sql-expert/v1"), ("pull", "(request not read)"),
                              ("rm", "(request not read)")]:   # each refusal audited, with the stranger's uid
        line = rf"audit uid=65534 http=127\.0\.0\.1:\d+ op={operation} target={re.escape(target)} result=denied"
        assert re.search(line, log), (operation, log[-2000:])
    assert "sql-expert:v1" in {m.model for m in client(api).list().models}   # the stranger changed nothing
    assert not any(m.model == "sql-expert:v1" and m.expires_at and m.expires_at.year == 9999
                   for m in client(api).ps().models)


def test_pull_from_the_hub_stand_in_lists_and_chats(home, demo, reference):
    """``/api/pull hf.co/ORG/REPO`` as Ollama's Hub integration spells it, from the Hub stand-in
    (the daemon's own HF_ENDPOINT: Ollama's pull carries no endpoint): the status lines, then the
    adapter listed under its Ollama name and answering as HF + PEFT does."""
    from conftest import start_daemon, sub_home
    from hub_stub import HubStub

    folder = demo / "adapters" / "sql-expert" / "v1"
    with HubStub() as hub:
        hub.add_commit("acme/sql-lora", {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()})
        d = start_daemon(sub_home(home, "ollama-hub"), "--http", "127.0.0.1:0", name="oh",
                         env={"HF_ENDPOINT": hub.endpoint})
        try:
            url = json.loads(subprocess.run([str(d.proc.args[0]).replace("loractld", "loractl"), "status", "--json",
                                             "--socket", str(d.socket)], capture_output=True, text=True,
                                            check=True).stdout)["http"]
            ol = ollama.Client(host=url, timeout=120)
            statuses = list(ol.pull("hf.co/acme/sql-lora", stream=True))
            assert statuses[0].status == "pulling manifest" and statuses[-1].status == "success", statuses
            assert any(s.digest and s.total for s in statuses)
            listed = {m.model for m in ol.list().models}
            assert "acme:sql-lora" in listed or "acme/sql-lora" in {n.replace(":", "/") for n in listed}, listed
            name = next(n for n in listed if n.replace(":", "/") == "acme/sql-lora")
            ids = reference.chat_ids(PROMPT)
            got = ol.chat(name, messages=[{"role": "user", "content": PROMPT}],
                          options={"temperature": 0, "num_predict": TOKENS})
            assert got.message.content == reference.text(reference.greedy(ids, folder, TOKENS))
        finally:
            d.stop()
