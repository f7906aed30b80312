"""The OpenAI-compatible HTTP API on a real daemon, driven by real clients: the official
``openai`` package (sync and async, streaming and not) and ``curl``. Every generated text is
checked against the HF + PEFT reference and against the same request through the gRPC socket."""

from __future__ import annotations

import asyncio
import json
import re
import socket
import subprocess
import time
from dataclasses import dataclass

import httpx
import openai
import pytest

from conftest import Daemon, collect, run_cli, start_daemon

KEY = "test-key-0123456789abcdef"
ADAPTERS = ["sql-expert/v1", "python-expert/v1"]
PROMPT = "How do I reverse a list in Python?"
TOKENS = 24


@dataclass
class Api:
    daemon: Daemon
    url: str

    def openai(self, **kwargs) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0, **kwargs)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key=KEY, max_retries=0)

    def post(self, path: str, body, **kwargs) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kwargs.pop("headers", {})}
        return httpx.post(self.url + path, json=body, headers=headers, timeout=60, **kwargs)

    def get(self, path: str) -> httpx.Response:
        return httpx.get(self.url + path, headers={"Authorization": f"Bearer {KEY}"}, timeout=60)


@pytest.fixture(scope="module")
def api(home) -> Api:
    """A daemon of its own with the HTTP API on, an API key, a low concurrency cap (4, so the
    429 test can reach it) and two demo adapters pulled into its store."""
    sub = home / "http"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").symlink_to(home / "tiny")
    key_file = sub / "api-key"
    key_file.write_text(KEY + "\n")
    key_file.chmod(0o600)
    d = start_daemon(sub, "--http", "127.0.0.1:0", "--api-key-file", str(key_file), "--http-max-concurrency", "4",
                     name="h")
    for name in ADAPTERS:
        result = run_cli("pull", str(home / "tiny" / "adapters" / name), "--name", name, "--socket", str(d.socket))
        assert result.returncode == 0, result.stderr
    status = json.loads(run_cli("status", "--json", "--socket", str(d.socket)).stdout)
    assert re.fullmatch(r"http://127\.0\.0\.1:\d+", status["http"]), status
    yield Api(d, status["http"])
    d.stop()


def expected(reference, demo, adapter: str | None, prompt_ids: list[int], n: int = TOKENS) -> str:
    path = demo / "adapters" / adapter if adapter else None
    return reference.text(reference.greedy(prompt_ids, path, n, n))


def grpc_text(api: Api, **kwargs) -> str:
    async def go():
        async with api.daemon.client() as client:
            return await collect(client, temperature=0.0, **kwargs)

    return asyncio.run(go())["text"]


@pytest.mark.parametrize("adapter", [None, *ADAPTERS], ids=["base", "sql", "python"])
def test_openai_chat_equals_the_reference_and_the_socket(api, demo, reference, adapter):
    client = api.openai()
    model = adapter or "tiny"
    kwargs = dict(model=model, messages=[{"role": "user", "content": PROMPT}], temperature=0, max_tokens=TOKENS,
                  extra_body={"min_tokens": TOKENS})
    whole = client.chat.completions.create(**kwargs)
    want = expected(reference, demo, adapter, reference.chat_ids(PROMPT))
    assert whole.choices[0].message.content == want
    assert whole.choices[0].finish_reason == "length" and whole.model == model
    assert (whole.usage.prompt_tokens, whole.usage.completion_tokens) == (len(reference.chat_ids(PROMPT)), TOKENS)

    chunks = list(client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == TOKENS  # the final usage chunk

    socket = grpc_text(api, messages=[{"role": "user", "content": PROMPT}], lora=adapter, max_tokens=TOKENS,
                       min_tokens=TOKENS)
    assert socket == want


@pytest.mark.parametrize("adapter", [None, "sql-expert/v1"], ids=["base", "sql"])
def test_openai_completions_equal_the_reference(api, demo, reference, adapter):
    client = api.openai()
    prompt = "SELECT name FROM"
    kwargs = dict(model=adapter or "tiny", prompt=prompt, temperature=0, max_tokens=12,
                  extra_body={"min_tokens": 12})
    want = expected(reference, demo, adapter, reference.tokenizer.encode(prompt), 12)
    assert client.completions.create(**kwargs).choices[0].text == want
    assert "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True)) == want
    assert grpc_text(api, prompt=prompt, lora=adapter, max_tokens=12, min_tokens=12) == want


def test_stop_top_p_and_max_completion_tokens(api, demo, reference):
    """top_p so small that only the likeliest token survives is greedy even at temperature 1;
    a stop string cuts the answer before its first occurrence, with finish_reason "stop"."""
    client = api.openai()
    messages = [{"role": "user", "content": PROMPT}]
    want = expected(reference, demo, "sql-expert/v1", reference.chat_ids(PROMPT), 20)
    nucleus = client.chat.completions.create(model="sql-expert/v1", messages=messages, temperature=1.0,
                                             top_p=1e-6, max_completion_tokens=20, extra_body={"min_tokens": 20})
    assert nucleus.choices[0].message.content == want and nucleus.usage.completion_tokens == 20
    # Without min_tokens (which holds stop strings back), on an answer that runs 20 tokens.
    full = reference.text(reference.greedy(reference.chat_ids("Write a query that lists every user"), None, 20))
    stop = full[len(full) // 2:len(full) // 2 + 3]
    cut = client.chat.completions.create(model="tiny", temperature=0, max_completion_tokens=20,
                                         messages=[{"role": "user", "content": "Write a query that lists every user"}],
                                         stop=[stop, "never-seen-stop"])
    assert full.index(stop) > 0 and cut.choices[0].message.content == full[:full.index(stop)]
    assert cut.choices[0].finish_reason == "stop"


def test_completions_take_token_ids_and_batches_of_prompts(api, demo, reference):
    prompts = ["SELECT name FROM", "def load("]
    ids = [reference.tokenizer.encode(p) for p in prompts]
    want = [expected(reference, demo, "python-expert/v1", i, 8) for i in ids]
    client = api.openai()
    for prompt in (prompts, ids):  # a batch of texts, a batch of token id lists
        got = client.completions.create(model="python-expert/v1", prompt=prompt, temperature=0, max_tokens=8,
                                        extra_body={"min_tokens": 8})
        assert [c.text for c in sorted(got.choices, key=lambda c: c.index)] == want
        assert got.usage.prompt_tokens == sum(len(i) for i in ids)  # once per prompt
    single = client.completions.create(model="python-expert/v1", prompt=ids[1], temperature=0, max_tokens=8,
                                       extra_body={"min_tokens": 8})
    assert single.choices[0].text == want[1]


def test_n_choices_follow_vllms_seeds(api):
    """n=3 with a seed: choice i samples as a single request with seed + i (vLLM's rule), so
    each equals the socket's answer for that seed; without sampling noise they would not differ."""
    messages = [{"role": "user", "content": "Once upon a time"}]
    got = api.openai().chat.completions.create(model="tiny", messages=messages, n=3, seed=11, temperature=1.0,
                                               max_tokens=10, extra_body={"min_tokens": 10})
    texts = [c.message.content for c in sorted(got.choices, key=lambda c: c.index)]
    assert texts == [_seeded(api, messages, 11 + i) for i in range(3)]
    assert len(set(texts)) > 1
    assert got.usage.completion_tokens == 30


def _seeded(api: Api, messages, seed: int) -> str:
    async def go():
        async with api.daemon.client() as client:
            return await collect(client, messages=messages, max_tokens=10, min_tokens=10, temperature=1.0, seed=seed)

    return asyncio.run(go())["text"]


def test_async_streams_and_socket_requests_for_different_adapters_share_batches(api, demo, reference):
    """Three HTTP streams (base and two adapters, async client) and three socket requests run at
    once; every one equals its reference, so batching across both doors mixes nothing up."""
    n = 48
    ids = reference.chat_ids(PROMPT)

    async def over_http(client, adapter):
        stream = await client.chat.completions.create(model=adapter or "tiny", stream=True, temperature=0,
                                                      messages=[{"role": "user", "content": PROMPT}], max_tokens=n,
                                                      extra_body={"min_tokens": n})
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    async def over_socket(adapter):
        async with api.daemon.client() as client:
            return (await collect(client, messages=[{"role": "user", "content": PROMPT}], lora=adapter,
                                  max_tokens=n, min_tokens=n, temperature=0.0))["text"]

    async def go():
        async with api.async_openai() as client:
            names = [None, *ADAPTERS]
            return await asyncio.gather(*[over_http(client, a) for a in names],
                                        *[over_socket(a) for a in reversed(names)])

    results = asyncio.run(go())
    names = [None, *ADAPTERS]
    want = [expected(reference, demo, a, ids, n) for a in names]
    assert results[:3] == want and results[3:] == want[::-1]


def test_curl_chat_and_server_sent_events(api, demo, reference):
    body = json.dumps({"model": "sql-expert/v1", "messages": [{"role": "user", "content": PROMPT}],
                       "temperature": 0, "max_tokens": TOKENS, "min_tokens": TOKENS})
    base = ["curl", "-sS", "--fail-with-body", "-H", "Content-Type: application/json",
            "-H", f"Authorization: Bearer {KEY}", f"{api.url}/v1/chat/completions"]
    whole = subprocess.run([*base, "-d", body], capture_output=True, text=True, timeout=60)
    assert whole.returncode == 0, whole.stdout + whole.stderr
    want = expected(reference, demo, "sql-expert/v1", reference.chat_ids(PROMPT))
    assert json.loads(whole.stdout)["choices"][0]["message"]["content"] == want

    streamed = subprocess.run([*base, "-N", "-d", json.dumps({**json.loads(body), "stream": True})],
                              capture_output=True, text=True, timeout=60)
    events = [line[len("data: "):] for line in streamed.stdout.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    deltas = [json.loads(e)["choices"][0]["delta"].get("content", "") for e in events[:-1]]
    assert "".join(deltas) == want
    assert "text/event-stream" in subprocess.run([*base[:-1], "-D", "-", "-o", "/dev/null", "-d",
                                                 json.dumps({**json.loads(body), "stream": True}), base[-1]],
                                                capture_output=True, text=True, timeout=60).stdout


def test_models_agree_with_ls_json(api):
    api.post("/v1/chat/completions", {"model": "python-expert/v1", "messages": [{"role": "user", "content": "hi"}],
                                      "max_tokens": 2}).raise_for_status()
    models = api.openai().models.list()
    cards = {m.id: m.model_dump() for m in models.data}
    listing = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", str(api.daemon.socket)).stdout)}
    assert set(cards) == {"tiny", *listing}
    assert cards["tiny"]["parent"] is None and cards["tiny"]["max_model_len"] == 256
    for name, adapter in listing.items():
        card = cards[name]
        assert card["parent"] == "tiny" and card["root"] == adapter["path"]
        own = card["loractl"]
        for field in ("tier", "pinned", "slot", "state", "rank", "revision"):
            assert own[field] == adapter[field], (name, field)
        assert own["last_used"] == pytest.approx(adapter["last_used"])
        assert int(own["requests"]) == int(adapter["requests"])
    assert listing["python-expert/v1"]["last_used"] > 0
    assert api.openai().models.retrieve("sql-expert/v1").id == "sql-expert/v1"
    with pytest.raises(openai.NotFoundError, match="sql-expert/v1"):
        api.openai().models.retrieve("sql-expert/v2")


def test_vllm_load_and_unload_routes(api, home, demo, reference):
    folder = home / "tiny" / "adapters" / "poet" / "v1"
    loaded = api.post("/v1/load_lora_adapter", {"lora_name": "poet/v1", "lora_path": str(folder)})
    assert (loaded.status_code, loaded.text) == (200, "Success: LoRA adapter 'poet/v1' added successfully.")
    card = api.openai().models.retrieve("poet/v1").model_dump()
    assert card["loractl"]["tier"] == "device"
    got = api.openai().chat.completions.create(model="poet/v1", messages=[{"role": "user", "content": PROMPT}],
                                                temperature=0, max_tokens=8, extra_body={"min_tokens": 8})
    assert got.choices[0].message.content == expected(reference, demo, "poet/v1", reference.chat_ids(PROMPT), 8)

    unloaded = api.post("/v1/unload_lora_adapter", {"lora_name": "poet/v1"})
    assert (unloaded.status_code, unloaded.text) == (200, "Success: LoRA adapter 'poet/v1' removed successfully.")
    assert api.openai().models.retrieve("poet/v1").model_dump()["loractl"]["tier"] == "disk"
    missing = api.post("/v1/unload_lora_adapter", {"lora_name": "poett/v1"})
    assert missing.status_code == 404 and "poet/v1" in missing.json()["error"]["message"]
    log = api.daemon.log.read_text()
    assert re.search(r"audit uid=\d+ http=127\.0\.0\.1:\d+ op=pull target=\S+poet/v1 as poet/v1 result=ok", log)
    assert re.search(r"audit uid=\d+ http=127\.0\.0\.1:\d+ op=load target=poet/v1 result=ok", log)
    assert re.search(r"audit uid=\d+ http=127\.0\.0\.1:\d+ op=evict target=poet/v1 result=ok", log)


def error_of(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) >= {"message", "type", "param", "code", "hint"} and error["hint"]
    assert "\n" not in error["message"]
    return error


CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}


@pytest.mark.parametrize("body, status, param, needle", [
    # vLLM's own checks (its request models), answered in the OpenAI schema with a hint:
    ({**CHAT, "temperature": "warm"}, 400, "temperature", "valid number"),
    ({**CHAT, "messages": []}, 400, None, "empty conversation"),
    ({**CHAT, "stop": 3}, 400, "stop", "valid"),
    # loractl's, in front of vLLM's:
    ({**CHAT, "max_token": 5}, 400, "max_token", "unknown field"),
    ({**CHAT, "guided_json": {"type": "object"}}, 400, "guided_json", "unknown field"),
    ({**CHAT, "n": 999}, 400, "n", "over this daemon's limit"),
    ({**CHAT, "model": "sql-expret/v1"}, 404, "model", "sql-expert/v1"),
    ({**CHAT, "model": "/etc"}, 404, "model", "does not exist"),
    ({**CHAT, "model": 7}, 400, "model", "must be a string"),
    ([1, 2], 400, None, "JSON object"),
])
def test_bad_chat_requests_get_their_status_and_schema(api, body, status, param, needle):
    error = error_of(api.post("/v1/chat/completions", body), status)
    assert error["param"] == param and needle in error["message"] + error["hint"], error


def test_bad_bodies_and_routes(api):
    malformed = httpx.post(api.url + "/v1/completions", content=b'{"model": "tiny", "prompt": ', timeout=30,
                           headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    assert "not valid JSON" in error_of(malformed, 400)["message"]
    plain = httpx.post(api.url + "/v1/completions", content=b'{"model":"tiny","prompt":"x"}', timeout=30,
                       headers={"Authorization": f"Bearer {KEY}", "Content-Type": "text/plain"})
    assert "Content-Type: application/json" in error_of(plain, 415)["message"]
    huge = api.post("/v1/completions", {"model": "tiny", "prompt": "x" * (5 << 20)})
    assert "larger than" in error_of(huge, 413)["message"]
    chunked = httpx.post(api.url + "/v1/completions", content=iter([b'{"prompt": "'] + [b"x" * (1 << 20)] * 5),
                         headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"}, timeout=30)
    assert "larger than" in error_of(chunked, 413)["message"]  # no Content-Length to go by: counted
    for empty, needle in (("", "non-empty"), ([], "at least one prompt"), ([[1, 2], []], "cannot be empty")):
        assert needle in error_of(api.post("/v1/completions", {"model": "tiny", "prompt": empty}), 400)["message"]
    out_of_vocab = api.post("/v1/completions", {"model": "tiny", "prompt": [1, 2, 10 ** 6]})
    assert "out of vocabulary" in error_of(out_of_vocab, 400)["message"]
    assert error_of(api.get("/v1/nothing"), 404)["code"] == "not_found"
    assert error_of(httpx.delete(api.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"}), 405)
    # openai's own exception classes come from the status and the schema.
    with pytest.raises(openai.NotFoundError) as caught:
        api.openai().chat.completions.create(model="no-such/v1", messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["code"] == "model_not_found"
    with pytest.raises(openai.BadRequestError):
        api.openai().completions.create(model="tiny", prompt="hi", max_tokens=300)


def test_too_many_requests_get_429_and_leave_the_others_alone(api, demo, reference):
    """Four long streams fill the cap of 4; a fifth request, sent once all four are streaming,
    is refused at once with 429, and the four still end exactly as their references."""
    n = 200
    ids = reference.chat_ids(PROMPT)
    names = ["tiny", "sql-expert/v1", "python-expert/v1", "tiny"]
    for adapter in set(names):  # loaded first, so that no stream waits on a load while another ends
        api.openai().chat.completions.create(model=adapter, messages=[{"role": "user", "content": "hi"}], max_tokens=1)

    async def go():
        streaming = asyncio.Semaphore(0)
        finished: list[float] = []
        async with api.async_openai() as client:
            async def stream(adapter):
                s = await client.chat.completions.create(model=adapter, messages=[{"role": "user", "content": PROMPT}],
                                                         stream=True, temperature=0, max_tokens=n,
                                                         extra_body={"min_tokens": n})
                streaming.release()  # the status line came: this request holds its slot
                text = "".join([c.choices[0].delta.content or "" async for c in s if c.choices])
                finished.append(time.monotonic())
                return text

            tasks = [asyncio.create_task(stream(a)) for a in names]
            for _ in names:
                await streaming.acquire()
            refusal = None
            try:
                await client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}])
            except openai.RateLimitError as refused:
                refusal = refused
            answered_at = time.monotonic()
            return await asyncio.gather(*tasks), refusal, answered_at, finished

    for _attempt in range(3):
        texts, refusal, answered_at, finished = asyncio.run(go())
        if refusal is not None or min(finished) > answered_at:
            break
        # One of the four ended before the fifth was answered (a loaded two-core machine can end
        # 200 tokens in well under a second): the cap was not full, so the try proves nothing.
    assert refusal is not None, "a fifth request while four streamed was not refused"
    # Refused, not queued behind the four: a queued request would answer after they end. (No
    # absolute time: on a loaded two-core machine the four can end within a second.)
    assert answered_at < max(finished)
    want = {a: expected(reference, demo, None if a == "tiny" else a, ids, n) for a in set(names)}
    assert texts == [want[a] for a in names]
    assert refusal.status_code == 429 and refusal.response.headers["retry-after"] == "1"
    assert refusal.body["code"] == "too_many_requests"


def _generated_tokens(api: Api) -> float:
    """vLLM's own count of the tokens it generated (its Prometheus counter, in our /metrics)."""
    text = api.get("/metrics").text
    return sum(float(v) for v in re.findall(r"^vllm:generation_tokens_total\{[^}]*\} (\S+)$", text, re.M))


def _engine_requests(api: Api) -> int:
    return api.get("/load").json()["engine_requests"]


def _wait_until(condition, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "whole"])
def test_a_client_that_goes_away_aborts_its_request_in_the_engine(api, stream):
    """The client hangs up while the engine generates eight 240-token choices (min_tokens: no
    early EOS; eight, so the work outlasts the polling on a loaded machine): the engine drops
    the request at once, and vLLM's own token counter shows it stopped short of 8 x 240."""
    _wait_until(lambda: _engine_requests(api) == 0, "the engine is busy before the test")
    before = _generated_tokens(api)
    payload = json.dumps({"model": "sql-expert/v1", "prompt": "Once", "max_tokens": 240, "min_tokens": 240,
                          "n": 8, "temperature": 1.0, "seed": 7, "stream": stream}).encode()
    host, port = api.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Authorization: Bearer " + KEY.encode() + b"\r\nContent-Length: %d\r\n\r\n" % len(payload)
                     + payload)
        if stream:
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # headers: every choice has begun
        else:
            _wait_until(lambda: _engine_requests(api) > 0, "the request never reached the engine")
    # Generous: on a loaded two-core machine the abort reaches the engine between steps.
    _wait_until(lambda: _engine_requests(api) == 0, "the engine still holds the request", timeout=30)
    produced = _generated_tokens(api) - before
    assert produced < 8 * 240, produced
    # The daemon serves on, and the counter counts what a finished request generates.
    before = _generated_tokens(api)
    after = api.post("/v1/completions", {"model": "sql-expert/v1", "prompt": "Once", "max_tokens": 4, "min_tokens": 4})
    assert after.json()["usage"]["completion_tokens"] == 4
    _wait_until(lambda: _generated_tokens(api) - before == 4, "vLLM's counter missed the 4 tokens")


def test_health_metrics_and_registry(api):
    health = httpx.get(api.url + "/health", timeout=10)  # open without the key, for monitors
    assert (health.status_code, health.json()) == (200, {"status": "ok"})
    unauthorised = httpx.get(api.url + "/v1/models", timeout=10)
    assert error_of(unauthorised, 401)["code"] == "invalid_api_key"
    assert unauthorised.headers["www-authenticate"] == "Bearer"
    wrong = httpx.get(api.url + "/v1/models", headers={"Authorization": "Bearer nope"}, timeout=10)
    assert wrong.status_code == 401
    text = api.get("/metrics").text
    socket = run_cli("metrics", "--socket", str(api.daemon.socket)).stdout
    names = lambda t: sorted(set(re.findall(r"^# TYPE (\S+)", t, re.M)))  # noqa: E731
    assert names(text) == names(socket) and "vllm:generation_tokens_total" in names(text)
    instances = json.loads(run_cli("instances", "--json", env={"LORACTL_HOME": str(api.daemon.home)}).stdout)
    assert any(i["metadata"].get("http") == api.url for i in instances), instances


def test_the_model_is_named_as_users_know_it_with_its_folder_a_detail(api, home):
    """--model tiny is served from <home>/tiny/model; status, /v1/models, the metrics and the
    registry say loractl/demo-tiny-llama (the tiny model's id), the folder only as a detail."""
    folder = str(home / "http" / "tiny" / "model")
    status = json.loads(run_cli("status", "--json", "--socket", str(api.daemon.socket)).stdout)
    assert (status["engine"]["model_name"], status["engine"]["model_arg"], status["engine"]["model"]) == \
        ("loractl/demo-tiny-llama", "tiny", folder)
    human = run_cli("status", "--socket", str(api.daemon.socket)).stdout
    assert re.search(r"^model +loractl/demo-tiny-llama \(--model tiny\) *$", human, re.M), human
    assert re.search(rf"^model folder +{re.escape(folder)} *$", human, re.M), human
    card = api.get("/v1/models/tiny").json()
    assert card["root"] == folder and card["loractl"]["model_name"] == "loractl/demo-tiny-llama"
    api.post("/v1/completions", {"model": "sql-expert/v1", "prompt": "hi", "max_tokens": 2}).raise_for_status()
    metrics = api.get("/metrics").text
    labels = set(re.findall(r'model_name="([^"]*)"', metrics))
    assert labels == {"loractl/demo-tiny-llama"}, labels        # vLLM's series too, not the folder
    assert folder not in metrics and "@" not in "".join(re.findall(r'adapters?="([^"]*)"', metrics))
    entry = json.loads(run_cli("instances", "--json", "--home", str(home / "http")).stdout)
    mine = [i["metadata"] for i in entry if i["metadata"].get("model_path") == folder]
    assert [m["model"] for m in mine] == ["loractl/demo-tiny-llama"], entry


def test_model_names_follow_what_was_asked(tmp_path):
    from loractld.models.naming import name_model, relabel_model

    folder = tmp_path / "smol"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"_name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct"}))
    assert name_model("demo", str(folder)).name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert name_model("hf://org/repo/m-q4_k_m.gguf", "/cache/gguf-1").name == "org/repo"
    assert name_model(str(tmp_path / "m.gguf"), str(folder)).name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert name_model(str(tmp_path / "m.gguf"), str(tmp_path / "nothing")).name == "m.gguf"
    assert name_model(str(folder), str(folder)).name == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert name_model("org/model", "org/model").name == "org/model"
    assert name_model("demo", str(folder), served_name="mine").name == "mine"
    text = 'vllm:x{engine="0",model_name="/c/gguf-1"} 1\n'
    assert relabel_model(text, "/c/gguf-1", "org/repo") == 'vllm:x{engine="0",model_name="org/repo"} 1\n'
