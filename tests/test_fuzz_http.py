"""Property-based fuzzing of the HTTP API (Hypothesis), as tests/test_fuzz_grpc.py does for the
socket: random and malformed JSON bodies to every route that takes one, and random model ids to
the ones that take them in the path. Wrong types, huge strings and numbers, negative numbers,
invalid UTF-8, deep nesting, unknown fields, empty and oversized prompts, token ids past the
vocabulary.

Properties, for every example:
- the answer is a success or a clean 4xx in the OpenAI error schema: never a 5xx, and a message
  and a hint of one line each;
- the daemon is still running, and a completion sent right after answers exactly as it did
  before the fuzzing began (itself checked against HF + PEFT).

Derandomized (the same examples on every run), no shrinking, counts kept small for two cores.
"""

from __future__ import annotations

import json
from urllib.parse import quote

import httpx
import pytest
from hypothesis import event, given
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from test_fuzz_grpc import fuzz  # the same settings: derandomized, no shrinking, no deadline


ADAPTER = "sql-expert/v1"
PROBE = {"model": ADAPTER, "prompt": "The list of users", "max_tokens": 4, "min_tokens": 4, "temperature": 0}
ROUTES = ["/v1/completions", "/v1/chat/completions", "/v1/load_lora_adapter", "/v1/unload_lora_adapter"]
# A valid, cheap body per route: the fuzzer spoils one part of it at a time.
BASE = {
    "/v1/completions": {"model": ADAPTER, "prompt": "hi", "max_tokens": 2, "temperature": 0},
    "/v1/chat/completions": {"model": ADAPTER, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/load_lora_adapter": {"lora_name": "fuzz/loaded", "lora_path": "/nonexistent/adapter"},
    "/v1/unload_lora_adapter": {"lora_name": "fuzz/absent"},
}
FIELDS = {
    "/v1/completions": ["model", "prompt", "max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "n",
                        "stop", "stream", "stream_options", "user", "echo", "logprobs", "best_of", "suffix"],
    "/v1/chat/completions": ["model", "messages", "max_tokens", "max_completion_tokens", "min_tokens", "temperature",
                             "top_p", "top_k", "seed", "n", "stop", "stream", "stream_options", "tools",
                             "response_format", "logit_bias"],
    "/v1/load_lora_adapter": ["lora_name", "lora_path", "load_inplace"],
    "/v1/unload_lora_adapter": ["lora_name", "lora_int_id"],
}


@pytest.fixture(scope="module")
def web(rig):
    """conftest's shared daemon (HTTP API on, no API key: loopback only) and a client for it."""
    rig.pull(ADAPTER)
    with httpx.Client(base_url=rig.http, timeout=120) as client:
        yield rig.daemon, client


@pytest.fixture(scope="module")
def before(web, reference, demo):
    """The probe's answer before any fuzzing, checked against the HF + PEFT reference."""
    _, client = web
    reply = client.post("/v1/completions", json=PROBE)
    assert reply.status_code == 200, reply.text
    ids = reference.greedy(reference.tokenizer.encode(PROBE["prompt"]), demo / "adapters" / ADAPTER, 4, 4)
    assert reply.json()["choices"][0]["text"] == reference.text(ids)
    return reply.json()["choices"][0]["text"]


def send(web, before, method: str, path: str, body: bytes | None = None) -> None:
    """One request; its answer is a success or a clean 4xx; then the probe answers as before."""
    daemon, client = web
    if body is None:
        reply = client.request(method, path)
    else:
        reply = client.request(method, path, content=body, headers={"Content-Type": "application/json"})
    if currently_in_test_context():
        event(f"{path.split('/')[2] if path.startswith('/v1/') else path} {reply.status_code}")
    clean = reply.status_code < 400 or (reply.status_code < 500 and one_line_fields(reply.json()["error"]))
    assert clean, (reply.status_code, reply.text[:500])  # (the fields may be 100 kB: not shown whole)
    assert daemon.proc.poll() is None, f"the daemon died:\n{daemon.log_tail()}"
    probe = client.post("/v1/completions", json=PROBE)
    same = probe.status_code == 200 and probe.json()["choices"][0]["text"] == before
    assert same, probe.text[:500]


def one_line_fields(error: dict) -> bool:
    return all(error[key] and "\n" not in error[key] and len(error[key]) < 1000 for key in ("message", "hint"))


# -- strategies ---------------------------------------------------------------------------------
def huge_text():
    return st.builds(lambda c, n: c * n, st.text(min_size=1, max_size=3), st.integers(5_000, 100_000))


big_ints = st.one_of(st.integers(-3, 3), st.integers(-2**64, 2**64), st.sampled_from([2**63, -2**63 - 1, 10**100]))
json_values = st.recursive(
    st.one_of(st.none(), st.booleans(), big_ints, st.floats(allow_nan=False), st.text(max_size=20)),
    lambda inner: st.one_of(st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=10), inner, max_size=4)),
    max_leaves=10)
junk = st.one_of(
    json_values, huge_text(), big_ints, st.floats(), st.sampled_from([-1, 0, "", [], {}, [[]], [""], "NaN", 1e308]),
    st.lists(big_ints, min_size=1, max_size=5),  # token ids, past the vocabulary or negative
    st.lists(st.text(max_size=5), min_size=20, max_size=60),
    st.builds(lambda n: [{"role": "user", "content": "x"}] * n, st.integers(0, 300)),
    st.lists(st.fixed_dictionaries({"role": st.text(max_size=8), "content": json_values}), max_size=3),
)


class Body(bytes):
    """A request body that Hypothesis reports by its start and length, not in full."""

    def __repr__(self) -> str:
        return f"Body({bytes(self[:120])!r}, {len(self)} bytes)"


def dumps(value) -> Body:
    return Body(json.dumps(value).encode())  # NaN and Infinity as Python writes them: not JSON, sent anyway


@st.composite
def spoiled_bodies(draw) -> tuple[str, bytes]:
    """A valid body with one field given a hostile value, added, or removed."""
    route = draw(st.sampled_from(ROUTES))
    body = dict(BASE[route])
    how = draw(st.sampled_from(["value", "value", "value", "unknown", "missing"]))
    if how == "value":
        body[draw(st.sampled_from(FIELDS[route]))] = draw(junk)
    elif how == "unknown":
        body[draw(st.text(min_size=1, max_size=30))] = draw(json_values)
    else:
        body.pop(draw(st.sampled_from(sorted(body))))
    return route, dumps(body)


@st.composite
def malformed_bodies(draw) -> tuple[str, bytes]:
    """Bytes that are not a request at all: random, invalid UTF-8, cut JSON, deep nesting, not
    an object, huge."""
    route = draw(st.sampled_from(ROUTES))
    kind = draw(st.sampled_from(["bytes", "bad_utf8", "cut", "deep", "not_object", "huge", "empty"]))
    if kind == "bytes":
        return route, Body(draw(st.binary(max_size=200)))
    if kind == "bad_utf8":
        field = draw(st.sampled_from(["model", "prompt", "lora_name"]))
        return route, Body(b'{"%s": "' % field.encode() + draw(st.binary(max_size=6)) + b'\xff\xfe\xc3", "prompt": "x"}')
    if kind == "cut":
        whole = dumps(BASE[route])
        return route, Body(whole[:draw(st.integers(0, len(whole) - 1))])
    if kind == "deep":
        depth = draw(st.integers(10, 200_000))
        opener, closer = draw(st.sampled_from([("[", "]"), ('{"a":', "}")]))
        return route, Body((opener * depth + "1" + closer * depth).encode())
    if kind == "not_object":
        return route, dumps(draw(json_values.filter(lambda v: not isinstance(v, dict))))
    if kind == "huge":
        return route, dumps({**BASE[route], "model": "x" * draw(st.integers(100_000, 2_000_000))})
    return route, Body(b"")


# -- the properties -----------------------------------------------------------------------------
@fuzz(60)
@given(spoiled_bodies())
def test_bodies_with_one_hostile_field(web, before, case):
    route, body = case
    send(web, before, "POST", route, body)


@fuzz(40)
@given(malformed_bodies())
def test_malformed_bodies(web, before, case):
    route, body = case
    send(web, before, "POST", route, body)


@fuzz(25)
@given(st.sampled_from(ROUTES), json_values)
def test_random_json_documents(web, before, route, value):
    send(web, before, "POST", route, dumps(value))


@fuzz(20)
@given(st.one_of(st.text(max_size=60), st.sampled_from(["..", "../..", "%00", "a/b/c", ADAPTER + "/", "x" * 12_000])))
def test_random_model_ids_in_the_path(web, before, model):
    send(web, before, "GET", "/v1/models/" + quote(model, safe="/"))


def test_the_fuzzer_can_see_a_failure(web, before):
    """Guards the properties above: refusals are 4xx in the error schema with one-line fields,
    not waved through as successes."""
    _, client = web
    for reply in (client.post("/v1/completions", json={**PROBE, "max_tokens": "four"}),
                  client.post("/v1/completions", content=b"{", headers={"Content-Type": "application/json"}),
                  client.get("/v1/models/no-such/v9")):
        assert 400 <= reply.status_code < 500, reply.text
        error = reply.json()["error"]
        assert error["message"] and error["hint"] and "\n" not in error["message"] + error["hint"]


# -- the trust boundary's caps (--http-max-choices, the request head's size) --------------------
MAX_CHOICES = 128   # the rig runs with loractld's default


@fuzz(12)
@given(st.integers(1, 300), st.integers(1, 16))
def test_prompts_times_n_past_the_cap_is_a_clean_400(web, before, prompts, n):
    """Under the cap every choice is answered; past it, one 400 before anything is tokenized."""
    daemon, client = web
    reply = client.post("/v1/completions", json={"model": ADAPTER, "prompt": ["hi"] * prompts, "n": n,
                                                 "max_tokens": 1, "temperature": 0})
    if prompts * n > MAX_CHOICES:
        assert reply.status_code == 400 and reply.json()["error"]["code"] == "too_many_choices", reply.text[:300]
    else:
        assert reply.status_code == 200 and len(reply.json()["choices"]) == prompts * n, reply.text[:300]
    send(web, before, "GET", "/health")


@fuzz(10)
@given(st.integers(0, 3), st.integers(0, 40_000))
def test_request_heads_of_any_size_are_answered_or_refused_cleanly(web, before, headers, size):
    """Headers up to and past the head cap (--http-max-header-size, 64KiB on the rig): a success,
    or 431 and a closed connection (the other headers of the request take some of the 64 KiB)."""
    daemon, client = web
    padding = {f"x-pad-{i}": "a" * size for i in range(headers)}
    try:
        reply = client.get("/v1/models", headers=padding)
        assert reply.status_code in (200, 431), reply.text[:300]
        assert reply.status_code == 431 or headers * size < 64 << 10
    except httpx.RemoteProtocolError:
        assert headers * size > (64 << 10) - 1024  # closed mid-send: the answer was 431, the head was too big
    send(web, before, "GET", "/health")
