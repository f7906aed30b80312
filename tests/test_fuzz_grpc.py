"""Property-based fuzzing of every RPC (Hypothesis), through grpcio so that malformed bytes reach
the daemon exactly as sent: raw garbage, wrong wire types, invalid UTF-8 in strings, huge and
negative numbers, NaN, huge strings, empty and oversized prompts, unknown ``to``/``from`` values.

Properties, for every example:
- the reply is a success or a clean status: never INTERNAL or UNKNOWN, a one-line message that
  is loractl's error payload (kind, message, hint) of a domain error, not "internal";
- the daemon is still running, and a request sent right after answers exactly as it did before
  the fuzzing began (a greedy generation through an adapter, itself checked against HF + PEFT).

Derandomized, so CI runs the same examples every time; example counts are kept small enough that
the module runs in about a minute on two cores.
"""

from __future__ import annotations

import json

import grpc
import pytest
from hypothesis import HealthCheck, Phase, event, given, settings
from hypothesis import strategies as st
from hypothesis.control import currently_in_test_context

from grpcio_stubs import RPCS, channel, field, raw_call, varint
from loractl.v1 import loractl_pb2 as pb

ADAPTER = "sql-expert/v1"
PROBE = pb.GenerateRequest(prompt="The list of users", lora=ADAPTER,
                           sampling=pb.SamplingParams(max_tokens=4, min_tokens=4, temperature=0.0))
# What a malformed or refused request may be answered with; INTERNAL and UNKNOWN never.
CLEAN = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION,
         grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED}
KINDS = {"invalid_request", "adapter_not_found", "invalid_adapter", "source_unavailable", "disk_full"}


def fuzz(examples: int):
    # No shrinking: on this engine a shrink runs for many minutes; the first failing example,
    # printed as is, is enough to reproduce (derandomize makes it the same every run).
    return settings(max_examples=examples, deadline=None, derandomize=True, database=None,
                    phases=[Phase.explicit, Phase.generate],
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                           HealthCheck.large_base_example])


@pytest.fixture(scope="module")
def fz(rig):
    """conftest's killable rig (its Hub endpoint is a closed port: pulls fail fast and offline)."""
    rig.pull(ADAPTER)
    return rig.daemon


@pytest.fixture(scope="module")
def chan(fz):
    with channel(fz.socket) as c:
        grpc.channel_ready_future(c).result(timeout=10)
        yield c


def generate(chan, request: pb.GenerateRequest) -> list[int]:
    replies = raw_call(chan, "Generate", request.SerializeToString())
    return [i for r in replies for i in pb.GenerateReply.FromString(r).token_ids]


@pytest.fixture(scope="module")
def before(chan, fz, reference, demo):
    """The probe's answer before any fuzzing, checked against the HF + PEFT reference."""
    ids = generate(chan, PROBE)
    prompt_ids = reference.tokenizer.encode(PROBE.prompt)
    assert ids == reference.greedy(prompt_ids, demo / "adapters" / ADAPTER, 4, 4)
    return ids


def send(chan, fz, before, rpc: str, payload: bytes) -> None:
    """Send one request; check its answer is clean, then that the daemon still answers right."""
    outcome = "OK"
    try:
        # Events only ends when the daemon drains: an open stream with nothing to say is its success.
        raw_call(chan, rpc, payload, timeout=0.3 if rpc == "Events" else 60)
    except grpc.RpcError as e:
        outcome = e.code().name
        if not (rpc == "Events" and e.code() == grpc.StatusCode.DEADLINE_EXCEEDED):
            assert_clean(e)
            outcome = f"{outcome}: {json.loads(e.details())['message'][:40]}"
    if currently_in_test_context():
        event(f"{rpc} {outcome}")  # --hypothesis-show-statistics shows what the examples reached
    assert fz.proc.poll() is None, f"the daemon died:\n{fz.log_tail()}"
    assert generate(chan, PROBE) == before


def assert_clean(error: grpc.RpcError) -> None:
    details = error.details() or ""
    assert error.code() in CLEAN, (error.code(), details[:300])
    assert "\n" not in details and len(details) <= 8192, details[:300]  # 8 KiB: grpcio's trailer cap
    payload = json.loads(details)
    assert payload["kind"] in KINDS, details[:300]
    for key in ("message", "hint"):
        assert payload[key] and "\n" not in payload[key], details[:300]


# -- strategies ---------------------------------------------------------------------------------
def huge(alphabet=st.characters()):
    """A string of 5,000-200,000 characters, cheap to generate."""
    return st.builds(lambda c, n: c * n, st.text(alphabet, min_size=1, max_size=3), st.integers(5_000, 200_000))


names = st.one_of(
    st.text(max_size=40),
    huge(),
    st.sampled_from(["", ".", "..", "../x", "/", "/etc/passwd", "a/b/c", "A/B", " sql-expert/v1", "x" * 300,
                     "sql-expert/v1\x00", "con/nul", "-rf", "sql-expert/v2", "SQL-EXPERT/V1"]),
)
tiers = st.one_of(st.sampled_from(["", "device", "host", "disk", "DEVICE", "gpu", "-1"]), st.text(max_size=12))
int32 = st.integers(-2**31, 2**31 - 1)
float32 = st.floats(width=32, allow_nan=True, allow_infinity=True)
prompts = st.one_of(st.text(max_size=200), huge(st.characters(codec="utf-8")), st.just(""))


@st.composite
def generate_requests(draw) -> pb.GenerateRequest:
    """A valid, short request with one part made hostile (or none): one bad field at a time, so
    each reaches the check that should refuse it (the daemon's own, or the engine's)."""
    request = pb.GenerateRequest(lora=draw(st.sampled_from(["", ADAPTER])),
                                 sampling=pb.SamplingParams(max_tokens=draw(st.integers(1, 4)), temperature=0.0))
    if draw(st.booleans()):
        request.prompt = draw(st.text(min_size=1, max_size=40))
    else:
        request.messages.add(role="user", content=draw(st.text(max_size=40)))
    part = draw(st.sampled_from(["none", "prompt", "both", "role", "lora", "max_tokens", "min_tokens", "temperature",
                                 "top_p", "top_k", "seed", "stop"]))
    if part == "prompt":
        request.ClearField("messages")
        request.prompt = draw(prompts)
    elif part == "both":
        request.prompt = request.prompt or "x"
        request.messages.add(role="user", content="y")
    elif part == "role":
        request.ClearField("prompt")
        request.messages.add(role=draw(st.one_of(st.text(max_size=10), st.sampled_from(["USER", "tool", ""]))),
                             content=draw(prompts))
    elif part == "lora":
        request.lora = draw(names)
    elif part == "stop":
        request.sampling.stop.extend(draw(st.lists(st.one_of(st.text(max_size=8), huge()), min_size=1, max_size=3)))
    elif part == "seed":
        request.sampling.seed = draw(st.integers(-2**63, 2**63 - 1))
    elif part in ("temperature", "top_p"):
        setattr(request.sampling, part, draw(float32))
    elif part != "none":  # max_tokens, min_tokens, top_k: int32 (a large max_tokens overflows the context)
        setattr(request.sampling, part, draw(st.one_of(st.integers(-3, 8), int32)))
    return request


def wire_fields(draw, rpc: str) -> bytes:
    """A message of valid keys but hostile values: each string field gets invalid UTF-8, a wrong
    wire type, a huge or negative varint, or a nested garbage message."""
    descriptor = RPCS[rpc][0].DESCRIPTOR
    out = b""
    for f in descriptor.fields:
        choice = draw(st.sampled_from(["skip", "bad_utf8", "varint", "fixed32", "fixed64", "garbage", "negative"]))
        if choice == "bad_utf8":
            out += field(f.number, 2, draw(st.binary(max_size=6)) + b"\xff\xfe\xc3" + draw(st.binary(max_size=6)))
        elif choice == "varint":
            out += field(f.number, 0, draw(st.integers(0, 2**64 - 1)))
        elif choice == "negative":
            out += field(f.number, 0, draw(st.integers(-2**63, -1)))
        elif choice == "fixed32":
            out += field(f.number, 5, draw(st.binary(min_size=4, max_size=4)))
        elif choice == "fixed64":
            out += field(f.number, 1, draw(st.binary(min_size=8, max_size=8)))
        elif choice == "garbage":
            out += field(f.number, 2, draw(st.binary(max_size=40)))
    return out


@st.composite
def raw_payloads(draw) -> tuple[str, bytes]:
    rpc = draw(st.sampled_from(sorted(RPCS)))
    kind = draw(st.sampled_from(["bytes", "fields", "unknown_field", "truncated"]))
    if kind == "bytes":
        return rpc, draw(st.binary(max_size=120))
    if kind == "fields":
        return rpc, wire_fields(draw, rpc)
    if kind == "unknown_field":  # valid protobuf: unknown fields are skipped, the request is the default one
        return rpc, field(draw(st.integers(100, 2**29 - 1)), 2, draw(st.binary(max_size=20)))
    return rpc, field(1, 2, b"x" * 10)[:-3] + varint(2**63)[:4]  # a length past the end, a cut varint


# -- the properties -----------------------------------------------------------------------------
@fuzz(60)
@given(raw_payloads())
def test_raw_and_malformed_bytes_to_every_rpc(chan, fz, before, case):
    rpc, payload = case
    if rpc == "Remove" and ADAPTER.encode() in payload:
        return  # removing the probe's adapter would be a correct answer, not a bug
    send(chan, fz, before, rpc, payload)


@fuzz(60)
@given(generate_requests())
def test_generate_with_random_prompts_and_sampling(chan, fz, before, request):
    send(chan, fz, before, "Generate", request.SerializeToString())


@fuzz(60)
@given(st.sampled_from(["Show", "Load", "Evict", "Pin", "Unpin", "Remove"]), names, tiers, st.booleans())
def test_adapter_operations_with_random_names(chan, fz, before, rpc, name, tier, force):
    if rpc == "Remove" and name == ADAPTER:
        return
    request = {"Show": lambda: pb.ShowRequest(name=name), "Load": lambda: pb.LoadRequest(name=name, to=tier),
               "Evict": lambda: pb.EvictRequest(name=name, **{"from": tier}),
               "Pin": lambda: pb.NameRequest(name=name), "Unpin": lambda: pb.NameRequest(name=name),
               "Remove": lambda: pb.RemoveRequest(name=name, force=force)}[rpc]()
    send(chan, fz, before, rpc, request.SerializeToString())


refs = st.one_of(names, st.sampled_from(["hf://", "hf://a/b@", "hf://a/b/../../c", "org/repo", "org/repo@main",
                                         "hf://org/repo/sub", "file:///etc", "@@@", "a/b@main/sub"]))


@fuzz(40)
@given(refs, st.data())
def test_pull_with_random_refs(chan, fz, before, ref, data):
    # The name is checked first: mostly leave it to the default, so the reference itself is tried.
    name = data.draw(names) if data.draw(st.integers(0, 9)) < 3 else ""
    request = pb.PullRequest(ref=ref, name=name, revision=data.draw(st.one_of(st.just(""), st.text(max_size=20))),
                             force=data.draw(st.booleans()),
                             hf_endpoint=data.draw(st.sampled_from(["", "not a url", "http://127.0.0.1:9", "ftp://x",
                                                                    "http://[::1"])))
    send(chan, fz, before, "Pull", request.SerializeToString())


def test_the_fuzzer_can_see_a_failure(chan, fz, before):
    """Guards the properties above: a request the daemon refuses is seen as a clean refusal, and
    one it cannot parse is too (not waved through as a success)."""
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(chan, "Show", pb.ShowRequest(name="no-such/v9").SerializeToString())
    assert_clean(caught.value)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(chan, "Show", field(1, 2, b"\xff\xfe"))
    assert_clean(caught.value)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT


# -- what the fuzzing found, pinned down -----------------------------------------------------
FOUND = {
    # grpclib parses the request inside the handler: a DecodeError was an INTERNAL error.
    "invalid UTF-8 in a name": ("Show", field(1, 2, b"sql\xff\xfe"), grpc.StatusCode.INVALID_ARGUMENT,
                                "malformed Show request"),
    "a length past the end": ("Load", field(1, 2, b"x" * 10)[:-3], grpc.StatusCode.INVALID_ARGUMENT,
                              "malformed Load request"),
    # A 200 kB name came back in the message: past grpcio's 8 KiB trailer cap, no error of ours arrived.
    "a huge name": ("Show", pb.ShowRequest(name="\U0002df2d" * 50_000).SerializeToString(),
                    grpc.StatusCode.INVALID_ARGUMENT, "more characters)"),
    # httpx's UnsupportedProtocol was an INTERNAL error.
    "a Hub endpoint that is no URL": ("Pull", pb.PullRequest(ref="org/repo", hf_endpoint="ftp://x").SerializeToString(),
                                      grpc.StatusCode.INVALID_ARGUMENT, "is not an http(s) URL"),
    # httpx2's ConnectError (huggingface_hub 2.x) must read as an unreachable Hub.
    "a Hub that does not answer": ("Pull", pb.PullRequest(ref="org/repo", hf_endpoint="http://127.0.0.1:9")
                                   .SerializeToString(), grpc.StatusCode.UNAVAILABLE, "cannot reach the Hub"),
    # vLLM's SamplingParams checks (VLLMValidationError) were INTERNAL errors.
    "an empty stop string": ("Generate", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(
        max_tokens=2, stop=[""])).SerializeToString(), grpc.StatusCode.INVALID_ARGUMENT, "stop cannot contain"),
}


@pytest.mark.parametrize("case", FOUND, ids=list(FOUND))
def test_what_the_fuzzing_found(chan, fz, before, case):
    rpc, payload, code, needle = FOUND[case]
    with pytest.raises(grpc.RpcError) as caught:
        raw_call(chan, rpc, payload)
    assert_clean(caught.value)
    assert caught.value.code() == code and needle in caught.value.details(), caught.value.details()[:300]
    send(chan, fz, before, rpc, payload)


def test_a_name_cannot_forge_an_audit_line(chan, fz):
    """A newline in a name went into the audit log as is: one request could write a fake line."""
    forged = "audit uid=0 pid=1 op=rm target=sql-expert/v1 result=ok"
    with pytest.raises(grpc.RpcError):
        raw_call(chan, "Load", pb.LoadRequest(name=f"x\n{forged}").SerializeToString())
    log = fz.log.read_text(errors="replace").splitlines()
    assert any('op=load target="x\\n' in line for line in log)   # quoted: it holds '='
    assert not any(line.startswith(forged) for line in log)
