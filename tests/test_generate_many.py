"""``GenerateMany``: a client's concurrent generations over one stream, on the real daemon.

loractl.Client sends every generation this way (the rest of the suite runs over it too);
these tests pin what the multiplexing itself promises: one stream for many generations, exact
outputs, per-generation errors and cancels, and a daemon that survives a client misusing the
stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import re

import pytest
from grpclib.client import Channel
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from conftest import collect
from loractl import Client
from loractl.errors import AdapterNotFound
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlStub

PROMPTS = ["Write a query that lists every user", "How do I reverse a list in Python?", "SELECT name FROM",
           "Once upon a time"]


def test_concurrent_generations_share_one_stream_and_match_the_reference(daemon, demo, reference):
    sql = demo / "adapters" / "sql-expert/v1"
    jobs = [(prompt, path, n) for prompt, n in zip(PROMPTS, (5, 9, 17, 12)) for path in (None, sql)]

    async def go():
        async with daemon.client() as client:
            results = await asyncio.gather(*[
                collect(client, messages=[{"role": "user", "content": prompt}], lora=str(path) if path else None,
                        max_tokens=n, min_tokens=n, temperature=0.0) for prompt, path, n in jobs])
            return results, client._mux.streams_opened

    results, streams = asyncio.run(go())
    assert streams == 1
    for (prompt, path, n), got in zip(jobs, results):
        ids = reference.chat_ids(prompt)
        assert got["prompt_ids"] == ids
        assert got["ids"] == reference.greedy(ids, path, n, n), (prompt, path)
        assert got["text"] == reference.text(got["ids"])
        assert got["finish"] == "length"


def _base_tokens(metrics: str) -> float:
    match = re.search(r'^loractl_adapter_generated_tokens_total\{adapter=""\} (\S+)$', metrics, re.M)
    return float(match.group(1)) if match else 0.0


def test_closing_one_generation_stops_it_in_the_engine_and_not_the_others(daemon):
    long = dict(prompt="Once upon a time", max_tokens=120, min_tokens=120, temperature=0.0)

    async def go():
        async with daemon.client() as client:
            before = _base_tokens(await client.metrics())

            async def closed_early() -> int:
                got = 0
                async with contextlib.aclosing(client.generate(**long)) as chunks:
                    async for chunk in chunks:
                        got += len(chunk.token_ids)
                        if got >= 3:
                            break
                return got

            early, *full = await asyncio.gather(closed_early(), collect(client, **long), collect(client, **long))
            await asyncio.sleep(0.5)   # the metric counts what the engine made; let the abort land
            return early, full, _base_tokens(await client.metrics()) - before

    early, full, made = asyncio.run(go())
    assert [len(f["ids"]) for f in full] == [120, 120] and full[0]["ids"] == full[1]["ids"]
    assert early >= 3
    # The closed generation was aborted, not run to its 120 tokens with nobody reading.
    assert 240 + early <= made < 240 + 60, made


def test_one_generation_failing_leaves_the_others_running(daemon):
    async def go():
        async with daemon.client() as client:
            good = asyncio.ensure_future(collect(client, prompt="Once upon a time", max_tokens=40, min_tokens=40))
            with pytest.raises(AdapterNotFound) as failed:
                await collect(client, prompt="hello", lora="no-such-adapter/v9", max_tokens=4)
            return await good, failed.value, client._mux.streams_opened

    good, error, streams = asyncio.run(go())
    assert len(good["ids"]) == 40 and good["finish"] == "length"
    assert "no-such-adapter" in str(error) and error.hint
    assert streams == 1


def test_a_client_with_a_deadline_uses_a_stream_per_generation(daemon, reference):
    async def go():
        async with Client(daemon.socket, timeout=60) as client:
            got = await collect(client, prompt="SELECT name FROM", max_tokens=6, min_tokens=6, temperature=0.0)
            return got, client._mux

    got, mux = asyncio.run(go())
    assert mux is None
    assert got["ids"] == reference.greedy(reference.tokenizer.encode("SELECT name FROM"), None, 6, 6)


# -- the raw protocol, as another client could send it ------------------------------------
def _request(ident: int, n: int = 4, **kwargs) -> pb.GenerateManyRequest:
    sampling = pb.SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0)
    return pb.GenerateManyRequest(id=ident, request=pb.GenerateRequest(prompt="Once upon a time",
                                                                       sampling=sampling), **kwargs)


async def _raw(daemon, messages: list[pb.GenerateManyRequest], *, end: bool = True):
    """Send ``messages`` on one GenerateMany stream (then end our side), read to the end."""
    channel = Channel(path=str(daemon.socket))
    try:
        async with LoractlStub(channel).GenerateMany.open() as stream:
            for message in messages:
                await stream.send_message(message)
            if end:
                await stream.end()
            updates = [u async for reply in stream for u in reply.updates]
            return updates
    finally:
        channel.close()


def test_requests_sent_then_closed_all_finish(daemon):
    """A client may send all its requests and end its side, as gRPC allows; the cancel of an
    id that is not running is ignored."""
    updates = asyncio.run(_raw(daemon, [_request(7, 5), _request(3, 8), pb.GenerateManyRequest(id=99, cancel=True)]))
    by_id: dict[int, list[int]] = {}
    for u in updates:
        assert not u.error_code, u
        by_id.setdefault(u.id, []).extend(u.reply.token_ids)
    assert {k: len(v) for k, v in by_id.items()} == {7: 5, 3: 8}
    assert [u.reply.finish_reason for u in updates if u.reply.finish_reason] and \
        {u.id for u in updates if u.reply.finish_reason == "length"} == {7, 3}


@pytest.mark.parametrize("messages, needle", [
    ([_request(1, 60), _request(1, 4)], "already running"),
    ([pb.GenerateManyRequest(id=5)], "neither request nor cancel"),
], ids=["reused-id", "empty"])
def test_a_misused_stream_ends_with_invalid_argument_and_the_daemon_serves_on(daemon, messages, needle):
    with pytest.raises(GRPCError) as failed:
        asyncio.run(_raw(daemon, messages, end=False))
    assert failed.value.status is Status.INVALID_ARGUMENT and needle in failed.value.message

    async def after():
        async with daemon.client() as client:
            return await collect(client, prompt="hello", max_tokens=3, min_tokens=3)

    assert len(asyncio.run(after())["ids"]) == 3


def test_a_per_generation_error_carries_the_domain_error(daemon):
    bad = pb.GenerateManyRequest(id=2, request=pb.GenerateRequest(prompt="", sampling=pb.SamplingParams()))
    updates = asyncio.run(_raw(daemon, [bad, _request(4, 3)]))
    errors = [u for u in updates if u.error_code]
    assert [(u.id, Status(u.error_code)) for u in errors] == [(2, Status.INVALID_ARGUMENT)]
    assert '"kind": "invalid_request"' in errors[0].error_message
    assert sum(len(u.reply.token_ids) for u in updates if u.id == 4) == 3


def test_a_daemon_without_generate_many_is_served_over_generate(tmp_path):
    """A daemon from before GenerateMany answers it UNIMPLEMENTED: the client falls back to a
    Generate stream per generation, once. (A double stands in for the engine: the fault here is
    the missing method, which the real daemon cannot produce.)"""
    from types import SimpleNamespace

    from grpclib.server import Server

    from loractld.api.grpc_service import LoractlService
    from loractld.engine.sampling import Delta

    class EngineDouble:
        async def prepare(self, generation):
            return SimpleNamespace(adapter=None, prompt_ids=[1, 2, 3], sampling=generation.sampling)

        async def run(self, prepared):
            n = prepared.sampling.max_tokens
            for i in range(n):
                yield Delta(text=f"<{i}>", token_ids=[100 + i], finish_reason="length" if i == n - 1 else None,
                            prompt_token_ids=[1, 2, 3] if i == 0 else None)

    class BeforeGenerateMany(LoractlService):
        def __mapping__(self):
            return {path: handler for path, handler in super().__mapping__().items()
                    if not path.endswith("/GenerateMany")}

    async def go():
        server = Server([BeforeGenerateMany(EngineDouble())])  # type: ignore[arg-type]
        await server.start(path=str(tmp_path / "old.sock"))
        try:
            async with Client(tmp_path / "old.sock") as client:
                first = await asyncio.gather(*[collect(client, prompt="x", max_tokens=n) for n in (3, 5)])
                second = await collect(client, prompt="x", max_tokens=2)
                return first, second, client._unary_only
        finally:
            server.close()
            await server.wait_closed()

    first, second, unary_only = asyncio.run(go())
    assert [r["ids"] for r in first] == [[100, 101, 102], [100, 101, 102, 103, 104]]
    assert second["text"] == "<0><1>" and second["finish"] == "length"
    assert unary_only
