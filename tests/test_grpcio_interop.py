"""Every RPC through grpcio (the reference gRPC implementation) over the Unix socket, unary and
streaming, with deadlines and mid-stream cancellation: its replies equal ``loractl.Client``'s
(grpclib) for the same requests, and generations equal the HF + PEFT reference."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import queue
import re
import tempfile
import threading
import time
from pathlib import Path

import grpc
import pytest

from conftest import collect
from grpcio_stubs import RPCS, channel, generate_stubs, wire_error
from loractl.client import to_dict
from loractl.errors import AdapterNotFound
from loractl.v1 import loractl_pb2 as pb

NAMES = ["sql-expert/v1", "poet/v1"]
PROMPT = "Write a query that lists every user"


@pytest.fixture(scope="module")
def stubs():
    with tempfile.TemporaryDirectory(prefix="lct-grpcio-") as out:
        yield generate_stubs(Path(out))


@pytest.fixture(scope="module")
def own(rig):
    """conftest's rig, not the session daemon: this module pulls, pins and removes."""
    rig.pull(*NAMES)
    return rig.daemon


@pytest.fixture(scope="module")
def stub(stubs, own):
    with channel(own.socket) as chan:
        grpc.channel_ready_future(chan).result(timeout=10)
        yield stubs.LoractlStub(chan)


def with_client(own, method: str, *args, **kwargs):
    async def go():
        async with own.client() as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(go())


def settled(adapter: dict) -> dict:
    """An adapter without what a request in between may change (its use counters)."""
    return {k: v for k, v in adapter.items() if k not in ("last_used", "requests")}


def test_the_stubs_cover_every_rpc_of_the_proto(stubs):
    """The test below must not skip an RPC that a later change adds."""
    service = pb.DESCRIPTOR.services_by_name["Loractl"]
    assert {m.name for m in service.methods} == set(RPCS)
    servicer = {name for name in dir(stubs.LoractlServicer) if not name.startswith("_")}
    assert servicer == set(RPCS)


def test_unary_replies_equal_the_loractl_clients(stub, own):
    status = to_dict(stub.Status(pb.StatusRequest(), timeout=10))
    theirs = with_client(own, "status")
    for moving in ("uptime_s", "requests_in_flight"):
        status.pop(moving), theirs.pop(moving)
    assert status == theirs
    assert status["ready"] and status["socket"] == str(own.socket)

    listed = [to_dict(a) for a in stub.List(pb.ListRequest(), timeout=10).adapters]
    assert listed == with_client(own, "list")
    assert set(NAMES) <= {a["name"] for a in listed}   # the rig is shared: other modules' adapters may be there

    shown = to_dict(stub.Show(pb.ShowRequest(name=NAMES[0]), timeout=10))
    assert shown == with_client(own, "show", NAMES[0])
    assert shown["name"] == NAMES[0] and shown["rank"] > 0

    def series(text: str) -> dict[str, str]:
        """Metric name -> value for loractl's own series (vLLM's move with time)."""
        return dict(line.rsplit(" ", 1) for line in text.splitlines()
                    if line.startswith("loractl_tier_") or line.startswith("loractl_pins"))

    ours = stub.Metrics(pb.MetricsRequest(), timeout=10).text
    assert series(ours) and series(ours) == series(with_client(own, "metrics"))
    assert re.search(r'^loractl_tier_adapters\{tier="disk"\} \d+', ours, re.M), ours


@pytest.mark.parametrize("lora", [None, NAMES[0]], ids=["base", "sql"])
def test_generate_stream_equals_the_client_and_the_reference(stub, own, demo, reference, lora):
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=PROMPT)], lora=lora or "",
                                 sampling=pb.SamplingParams(max_tokens=12, min_tokens=12, temperature=0.0))
    replies = list(stub.Generate(request, timeout=60))
    assert len(replies) > 1  # streamed, not one message
    ids = [i for r in replies for i in r.token_ids]
    text = "".join(r.text for r in replies)

    async def theirs():
        async with own.client() as client:
            return await collect(client, messages=[{"role": "user", "content": PROMPT}], lora=lora,
                                 max_tokens=12, min_tokens=12, temperature=0.0)

    got = asyncio.run(theirs())
    assert list(replies[0].prompt_token_ids) == got["prompt_ids"] == reference.chat_ids(PROMPT)
    assert ids == got["ids"] == reference.greedy(got["prompt_ids"], demo / "adapters" / lora if lora else None, 12, 12)
    assert text == got["text"]
    assert replies[0].adapter == got["adapter"]
    assert replies[-1].finish_reason == got["finish"] == "length"
    assert (replies[-1].usage.prompt_tokens, replies[-1].usage.completion_tokens) == (len(got["prompt_ids"]), 12)


def test_generate_many_over_grpcio_equals_the_reference(stub, own, demo, reference):
    """Two generations on one bidirectional stream of grpcio's HTTP/2 stack (base and an
    adapter), sent then ended: each equals the reference, its replies under its own id."""
    def request(ident: int, lora: str) -> pb.GenerateManyRequest:
        return pb.GenerateManyRequest(id=ident, request=pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content=PROMPT)], lora=lora,
            sampling=pb.SamplingParams(max_tokens=10, min_tokens=10, temperature=0.0)))

    replies = list(stub.GenerateMany(iter([request(11, ""), request(12, NAMES[0])]), timeout=60))
    assert len(replies) > 1
    updates: dict[int, list] = {11: [], 12: []}
    for update in (u for r in replies for u in r.updates):
        assert not update.error_code, update.error_message
        updates[update.id].append(update.reply)
    prompt_ids = reference.chat_ids(PROMPT)
    for ident, adapter in ((11, None), (12, demo / "adapters" / NAMES[0])):
        got = updates[ident]
        assert list(got[0].prompt_token_ids) == prompt_ids
        assert [i for r in got for i in r.token_ids] == reference.greedy(prompt_ids, adapter, 10, 10)
        assert got[-1].finish_reason == "length" and got[-1].usage.completion_tokens == 10


def test_pull_stream_equals_the_clients(stub, own, home):
    folder = str(home / "tiny" / "adapters" / "python-expert/v1")
    events = [to_dict(e) for e in stub.Pull(pb.PullRequest(ref=folder, name="py/v1"), timeout=60)]
    assert [e["stage"] for e in events][-1] == "done"
    installed = events[-1]["adapter"]
    assert settled(installed) == settled(with_client(own, "show", "py/v1"))

    async def theirs():
        async with own.client() as client:
            return [e async for e in client.pull(folder, name="py/v1")]

    again_grpcio = [to_dict(e) for e in stub.Pull(pb.PullRequest(ref=folder, name="py/v1"), timeout=60)]
    again_client = asyncio.run(theirs())
    assert again_grpcio[-1]["stage"] == again_client[-1]["stage"] == "up_to_date"
    assert settled(again_grpcio[-1]["adapter"]) == settled(again_client[-1]["adapter"])


def test_tier_rpcs_equal_the_clients(stub, own):
    """Each operation once through grpcio and once through the client, in an order where both
    are valid (pin and unpin are not idempotent): the replies agree and say what was done."""
    name = NAMES[1]

    def ours(rpc, request):
        return settled(to_dict(getattr(stub, rpc)(request, timeout=30)))

    def theirs(method, **kwargs):
        return settled(with_client(own, method, name, **kwargs))

    loaded = ours("Load", pb.LoadRequest(name=name, to="device"))
    assert loaded == theirs("load", to="device") and loaded["tier"] == "device"
    evicted = ours("Evict", pb.EvictRequest(name=name, **{"from": "device"}))
    assert evicted == theirs("evict", source="device") and evicted["tier"] == "host"

    pinned, unpinned = ours("Pin", pb.PinRequest(name=name, to="device")), theirs("unpin")
    assert (pinned["pinned"], unpinned["pinned"]) == (True, False)
    assert pinned["pin"] == "device" and pinned == theirs("pin", to="device")
    assert unpinned == ours("Unpin", pb.NameRequest(name=name))

    gone = ours("Evict", pb.EvictRequest(name=name, **{"from": "host"}))
    assert gone == theirs("evict", source="host") and gone["tier"] == "disk"


def test_remove_equals_the_clients(stub, own, home):
    folder = str(home / "tiny" / "adapters" / "translator/v1")
    for name in ("rm/a", "rm/b"):
        asyncio.run(_drain_pull(own, folder, name))
    ours = to_dict(stub.Remove(pb.RemoveRequest(name="rm/a"), timeout=30))
    theirs = with_client(own, "remove", "rm/b")
    assert ours["adapter"]["name"] == "rm/a" and theirs["adapter"]["name"] == "rm/b"
    for reply in (ours, theirs):
        reply["adapter"] = settled({k: v for k, v in reply["adapter"].items() if k not in ("name", "pulled_at", "path")})
    assert ours == theirs
    names = [a.name for a in stub.List(pb.ListRequest(), timeout=10).adapters]
    assert "rm/a" not in names and "rm/b" not in names


async def _drain_pull(own, folder: str, name: str) -> None:
    async with own.client() as client:
        async for _ in client.pull(folder, name=name):
            pass


def test_domain_errors_reach_grpcio_as_the_client_sees_them(stub, own):
    with pytest.raises(grpc.RpcError) as caught:
        stub.Show(pb.ShowRequest(name="no-such/v9"), timeout=10)
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND
    payload = wire_error(caught.value)
    with pytest.raises(AdapterNotFound) as theirs:
        with_client(own, "show", "no-such/v9")
    assert payload == {"kind": "adapter_not_found", "message": theirs.value.message, "hint": theirs.value.hint}
    assert "no-such/v9" in payload["message"]


def test_events_stream_equals_the_clients(stub, own):
    """Both clients watch at once; an evict, a load and an evict reach both, the same events in
    the same order (each stream is read until it has been quiet for a while)."""
    name = NAMES[0]
    mine: queue.Queue = queue.Queue()
    call = stub.Events(pb.EventsRequest())

    def read():
        try:
            for event in call:
                mine.put(to_dict(event))
        except grpc.RpcError as e:
            mine.put(e.code())

    threading.Thread(target=read, daemon=True).start()

    async def theirs():
        async with own.client() as watcher, own.client() as actor:
            seen: asyncio.Queue = asyncio.Queue()

            async def watch():
                async for event in watcher.events():
                    seen.put_nowait(event)

            task = asyncio.create_task(watch())
            await asyncio.sleep(1)  # both subscriptions are open before anything happens
            await actor.evict(name, source="host")
            await actor.load(name, to="device")
            await actor.evict(name, source="device")
            events = []
            with contextlib.suppress(asyncio.TimeoutError):
                while True:
                    events.append(await asyncio.wait_for(seen.get(), QUIET))
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            return events

    seen = asyncio.run(theirs())
    got = []
    with contextlib.suppress(queue.Empty):
        while True:
            got.append(mine.get(timeout=QUIET))
    call.cancel()  # cancelling a stream that has nothing pending
    assert mine.get(timeout=10) == grpc.StatusCode.CANCELLED
    assert got == seen
    kinds = [e["kind"] for e in got if e["adapter"] == name]
    assert "LOADED_TO_DEVICE" in kinds and "UNLOADED_FROM_DEVICE" in kinds, kinds


QUIET = 3.0  # seconds without an event that end a watch


def in_flight(stub) -> int:
    return stub.Status(pb.StatusRequest(), timeout=10).requests_in_flight


def engine_requests(stub) -> float:
    text = stub.Metrics(pb.MetricsRequest(), timeout=10).text
    return float(next(line.split()[-1] for line in text.splitlines() if line.startswith("loractl_engine_requests")))


def wait_idle(stub, seconds: float = 30) -> None:
    """The daemon and its engine both let go of the abandoned request."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if in_flight(stub) == 0 and engine_requests(stub) == 0:
            return
        time.sleep(0.1)
    raise AssertionError(f"still in flight: daemon {in_flight(stub)}, engine {engine_requests(stub)}")


LONG = pb.GenerateRequest(prompt="Once", sampling=pb.SamplingParams(max_tokens=240, min_tokens=240, temperature=0.0))


def next_request_is_right(stub, reference) -> None:
    request = pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=PROMPT)],
                                 sampling=pb.SamplingParams(max_tokens=8, min_tokens=8, temperature=0.0))
    ids = [i for r in stub.Generate(request, timeout=60) for i in r.token_ids]
    assert ids == reference.greedy(reference.chat_ids(PROMPT), None, 8, 8)


def test_cancel_mid_stream_aborts_in_the_engine(stub, reference):
    call = stub.Generate(LONG)
    received = 0
    for reply in call:
        received += len(reply.token_ids)
        if received >= 2:
            call.cancel()
            break
    with pytest.raises(grpc.RpcError) as caught:
        next(call)
    assert caught.value.code() == grpc.StatusCode.CANCELLED
    wait_idle(stub)
    next_request_is_right(stub, reference)


def test_stream_deadline_ends_the_request_in_the_daemon(stub, reference):
    """grpcio sends the deadline as grpc-timeout; the daemon's request ends with it."""
    received = 0
    started = time.monotonic()
    with pytest.raises(grpc.RpcError) as caught:
        for reply in stub.Generate(LONG, timeout=0.1):  # 240 engine steps never fit in 0.1 s
            received += len(reply.token_ids)
    assert caught.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert time.monotonic() - started < 30  # generous: a loaded two-core machine; the point is below
    assert received < 240
    wait_idle(stub)
    next_request_is_right(stub, reference)


def test_unary_deadline(stub, own):
    # A List can answer inside even 100 µs (a few calls in a thousand here), and some calls'
    # deadlines pass before the handler starts (about one in 150; grpclib alone answered those
    # UNKNOWN, see loractld/api/grpc_deadlines.py): every call either answers or exceeds its
    # deadline, nothing else, and the daemon logs no traceback for it.
    codes = collections.Counter()
    for _ in range(1000):
        try:
            stub.List(pb.ListRequest(), timeout=1e-4)
            codes[grpc.StatusCode.OK] += 1
        except grpc.RpcError as e:
            codes[(e.code(), e.details())] += 1
    assert codes and all(c == grpc.StatusCode.OK or c[0] == grpc.StatusCode.DEADLINE_EXCEEDED
                         for c in codes), codes
    assert "Timeout occurred" not in own.log.read_text()
    # The daemon answers the next call normally. Tiers may still settle from the previous test's
    # requests (the follower reads them within 200 ms), so compare once both reads agree.
    for _ in range(20):
        ours = with_client(own, "list")
        if [to_dict(a) for a in stub.List(pb.ListRequest(), timeout=10).adapters] == ours:
            break
        time.sleep(0.25)
    else:
        pytest.fail("grpcio's List never equalled the client's")
