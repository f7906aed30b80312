"""``GenerateMany`` under a client that does not read: bounded buffers, backpressure.

Issue 37, finding 7: 512 generations × 1,000 tokens on one stream whose client never read grew
the daemon from 541 to 1,007 MiB (every update queued, without bound, behind a send blocked by
HTTP/2 flow control), not returned after. A ``Generate`` stream waits for its reader instead.
Now an update waits for room before it is queued (``loractld.api.multiplexed``): per stream,
and in a budget shared by all of a daemon's ``GenerateMany`` streams.

The first tests drive ``Multiplexed`` in-process over a stream double whose sends block until
opened (fast, exact); the last runs the real daemon and measures its RSS.
"""

from __future__ import annotations

import asyncio
import time

from grpclib.client import Channel
from grpclib.config import Configuration
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from conftest import collect
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlStub
from loractld.api import multiplexed

# -- in-process: Multiplexed over a stream double ------------------------------------------


class StreamDouble:
    """A server stream: requests from ``incoming`` (``None`` ends the client's side); each send
    waits until ``readable`` is set (a client that does not read: HTTP/2 flow control)."""

    def __init__(self, *, reading: bool = True, fail_sends: bool = False) -> None:
        self.incoming: asyncio.Queue = asyncio.Queue()
        self.readable = asyncio.Event()
        if reading:
            self.readable.set()
        self.fail_sends = fail_sends
        self.sent: list[pb.GenerateManyReply] = []

    async def send_initial_metadata(self) -> None:
        pass

    def __aiter__(self):
        return self

    async def __anext__(self) -> pb.GenerateManyRequest:
        message = await self.incoming.get()
        if message is None:
            raise StopAsyncIteration
        if isinstance(message, Exception):
            raise message
        return message

    async def send_message(self, message: pb.GenerateManyReply) -> None:
        await self.readable.wait()
        if self.fail_sends:   # the connection broke: its reading side hears it too
            self.incoming.put_nowait(ConnectionResetError("the client went away"))
            raise ConnectionResetError("the client went away")
        self.sent.append(message)

    def updates(self) -> list[pb.GenerationUpdate]:
        return [u for reply in self.sent for u in reply.updates]


class EngineDouble:
    """``replies`` as ``LoractlService.replies`` gives them: one token per step; counts what
    each generation has pulled (what it took from the engine)."""

    def __init__(self) -> None:
        self.pulled: dict[str, int] = {}

    async def replies(self, stream, request: pb.GenerateRequest):
        n = request.sampling.max_tokens
        for i in range(n):
            await asyncio.sleep(0)   # an engine step
            self.pulled[request.prompt] = self.pulled.get(request.prompt, 0) + 1
            yield pb.GenerateReply(text=f" t{i}", token_ids=[1000 + i], finish_reason="length" if i == n - 1 else "")


def _as_error(e: Exception, operation: str) -> GRPCError:
    return GRPCError(Status.INTERNAL, f"{operation}: {e}")


def _ask(ident: int, tokens: int, tag: str = "") -> pb.GenerateManyRequest:
    return pb.GenerateManyRequest(id=ident, request=pb.GenerateRequest(
        prompt=f"{tag}{ident}", sampling=pb.SamplingParams(max_tokens=tokens)))


async def _settle(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def _cost() -> int:
    """What one double's update costs in the bound (its encoded size varies by a byte or two)."""
    return pb.GenerationUpdate(id=1, reply=pb.GenerateReply(text=" t100", token_ids=[1100])).ByteSize() \
        + multiplexed.UPDATE_OVERHEAD


def _check_complete(updates: list[pb.GenerationUpdate], tokens: dict[int, int]) -> None:
    by_id: dict[int, list[int]] = {}
    for u in updates:
        assert not u.error_code, u
        by_id.setdefault(u.id, []).extend(u.reply.token_ids)
    assert by_id == {i: [1000 + k for k in range(n)] for i, n in tokens.items()}   # all, in order
    finished = [u.id for u in updates if u.reply.finish_reason]
    assert sorted(finished) == sorted(tokens)


def test_a_stream_not_read_stops_its_generations_pulling_and_all_arrive_once_read():
    async def go():
        engine, stream, budget = EngineDouble(), StreamDouble(reading=False), multiplexed.Budget(2**30)
        limit = 64 * 2**10
        mux = multiplexed.Multiplexed(engine.replies, stream, _as_error, budget=budget, stream_limit=limit,
                                      reserved=limit)
        serving = asyncio.ensure_future(mux.serve())
        for i in range(1, 33):
            stream.incoming.put_nowait(_ask(i, 2000))
        stream.incoming.put_nowait(None)   # all sent; the client then reads, later
        await asyncio.sleep(0.5)
        pulled = sum(engine.pulled.values())
        await asyncio.sleep(0.5)
        assert sum(engine.pulled.values()) == pulled, "generations kept pulling with nobody reading"
        # What is held: the bound, plus at most one update per generation, pulled and waiting.
        assert mux._pending <= limit
        assert pulled <= limit // (_cost() - 2) + 32, pulled
        assert 32 * 2000 > 10 * pulled
        stream.readable.set()
        await asyncio.wait_for(serving, 30)
        return stream, mux

    stream, mux = asyncio.run(go())
    _check_complete(stream.updates(), {i: 2000 for i in range(1, 33)})
    assert mux._pending == 0
    # Still batched: many updates a message, and no message over the bound.
    assert len(stream.sent) < 32 * 2000 / 10
    assert max(m.ByteSize() + len(m.updates) * multiplexed.UPDATE_OVERHEAD for m in stream.sent) <= 64 * 2**10 + 100


def test_streams_not_read_share_one_bound_and_a_stream_read_goes_on_beside_them():
    async def go():
        engine = EngineDouble()
        budget = multiplexed.Budget(128 * 2**10)
        reserved = 16 * 2**10
        lagging = [StreamDouble(reading=False) for _ in range(4)]
        muxes = [multiplexed.Multiplexed(engine.replies, s, _as_error, budget=budget, stream_limit=2**20,
                                         reserved=reserved) for s in lagging]
        serving = [asyncio.ensure_future(m.serve()) for m in muxes]
        for k, s in enumerate(lagging):
            for i in range(1, 9):
                s.incoming.put_nowait(_ask(i, 5000, tag=f"lag{k}-"))
        await _settle(lambda: budget.used >= budget.limit - _cost())
        await asyncio.sleep(0.3)
        # The streams together hold the shared budget plus each one's reserve, no more
        # (each may have gone past by one update).
        held = sum(m._pending for m in muxes)
        assert held <= budget.limit + len(muxes) * (reserved + _cost()), held
        assert budget.used <= budget.limit + _cost()
        pulled = sum(engine.pulled.values())

        # Another client, which reads, is served from its stream's reserve meanwhile.
        reader = StreamDouble()
        fresh = multiplexed.Multiplexed(engine.replies, reader, _as_error, budget=budget, stream_limit=2**20,
                                        reserved=reserved)
        for i in range(1, 9):
            reader.incoming.put_nowait(_ask(i, 300, tag="reader-"))
        reader.incoming.put_nowait(None)
        await asyncio.wait_for(fresh.serve(), 30)
        _check_complete(reader.updates(), {i: 300 for i in range(1, 9)})
        assert sum(v for k, v in engine.pulled.items() if k.startswith("lag")) <= pulled + 4 * 8

        for s in lagging:
            s.incoming.put_nowait(None)
            s.readable.set()
        await asyncio.wait_for(asyncio.gather(*serving), 60)
        for s in lagging:
            _check_complete(s.updates(), {i: 5000 for i in range(1, 9)})
        return budget

    budget = asyncio.run(go())
    assert budget.used == 0


def test_the_budget_comes_back_when_a_stream_fails_or_is_cancelled():
    async def go():
        engine, budget = EngineDouble(), multiplexed.Budget(64 * 2**10)
        failing = StreamDouble(reading=False, fail_sends=True)
        stuck = StreamDouble(reading=False)
        serving = [asyncio.ensure_future(multiplexed.Multiplexed(engine.replies, s, _as_error, budget=budget,
                                                     stream_limit=2**20, reserved=8 * 2**10).serve())
                   for s in (failing, stuck)]
        for s in (failing, stuck):
            for i in range(1, 5):
                s.incoming.put_nowait(_ask(i, 5000))
        await _settle(lambda: budget.used >= budget.limit - _cost())
        failing.readable.set()   # its send fails: the stream ends with that error
        done, _ = await asyncio.wait([serving[0]], timeout=10)
        assert done and isinstance(serving[0].exception(), ConnectionResetError)
        serving[1].cancel()      # the connection dropped: grpclib cancels the handler
        await asyncio.gather(serving[1], return_exceptions=True)
        return budget

    assert asyncio.run(go()).used == 0


def test_the_refusal_of_a_generation_over_the_cap_waits_for_room_too(monkeypatch):
    """Requests over ``MAX_GENERATIONS`` each make a refusal: with nobody reading, the stream
    stops reading requests once its bound is full, rather than queue refusals without end."""
    monkeypatch.setattr(multiplexed, "MAX_GENERATIONS", 1)

    async def go():
        engine, stream = EngineDouble(), StreamDouble(reading=False)
        limit = 16 * 2**10
        mux = multiplexed.Multiplexed(engine.replies, stream, _as_error, budget=multiplexed.Budget(2**30),
                                      stream_limit=limit, reserved=limit)
        serving = asyncio.ensure_future(mux.serve())
        stream.incoming.put_nowait(_ask(1, 20000))   # runs while the others come, and fills the bound
        for i in range(2, 2002):
            stream.incoming.put_nowait(_ask(i, 10))
        stream.incoming.put_nowait(None)
        await asyncio.sleep(0.5)
        assert mux._pending <= limit + 1024
        assert stream.incoming.qsize() > 1500   # the rest wait, unread
        stream.readable.set()
        await asyncio.wait_for(serving, 30)
        return stream.updates()

    updates = asyncio.run(go())
    refused = [u for u in updates if u.error_code]
    assert len(refused) == 2000 and all(Status(u.error_code) is Status.INTERNAL for u in refused)
    assert sum(len(u.reply.token_ids) for u in updates if u.id == 1) == 20000


# -- the real daemon -----------------------------------------------------------------------
GENERATIONS = 512
TOKENS = 200
HOLD_S = 20.0
# RSS the daemon may gain while a stream of GENERATIONS x TOKENS is not read: the stream's
# bound (STREAM_PENDING_BYTES, 4 MiB), the engine's outputs merged meanwhile (~100k token ids
# and their text, ~5 MiB), the state of 512 running requests, and allocator slack. Before the
# bound every one of the ~100k updates was queued at ~1.1 KB each: > 100 MiB.
GROWTH_BOUND_MIB = 40


def _rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def test_a_client_that_does_not_read_does_not_grow_the_daemon(daemon):
    pid = daemon.proc.pid
    sampling = pb.SamplingParams(max_tokens=TOKENS, min_tokens=TOKENS, temperature=0.0)

    async def go():
        # The smallest window HTTP/2 allows (64 KiB): the daemon's sends wait after ~4,600
        # one-token updates (the default 4 MiB window would absorb most of this test's output).
        small = Configuration(http2_connection_window_size=2**16 - 1, http2_stream_window_size=2**16 - 1)
        channel = Channel(path=str(daemon.socket), config=small)
        try:
            async with LoractlStub(channel).GenerateMany.open() as stream:
                await stream.send_request()
                await asyncio.sleep(0.5)
                before = _rss_mib(pid)
                for ident in range(1, GENERATIONS + 1):
                    await stream.send_message(pb.GenerateManyRequest(
                        id=ident, request=pb.GenerateRequest(prompt="hi", sampling=sampling)))
                await stream.end()   # all sent: half-closed, the daemon finishes them

                peak, started, others = before, time.monotonic(), None
                while time.monotonic() - started < HOLD_S:
                    await asyncio.sleep(0.25)
                    peak = max(peak, _rss_mib(pid))
                    if others is None and time.monotonic() - started > HOLD_S / 2:
                        # Another client is served meanwhile: Status, and a generation.
                        async with daemon.client() as client:
                            t0 = time.monotonic()
                            status = await asyncio.wait_for(client.status(), 30)
                            t1 = time.monotonic()
                            got = await asyncio.wait_for(collect(client, prompt="hello", max_tokens=5, min_tokens=5),
                                                         60)
                            others = status, got, t1 - t0, time.monotonic() - t1
                held_peak = peak

                by_id: dict[int, int] = {}
                finished: set[int] = set()
                async for reply in stream:
                    for u in reply.updates:
                        assert not u.error_code, u
                        by_id[u.id] = by_id.get(u.id, 0) + len(u.reply.token_ids)
                        if u.reply.finish_reason:
                            assert u.reply.finish_reason == "length" and u.id not in finished
                            finished.add(u.id)
                    peak = max(peak, _rss_mib(pid))
                # The context exits without error: the daemon ended the stream with OK.
            await asyncio.sleep(1.0)
            return before, held_peak, peak, _rss_mib(pid), others, by_id, finished
        finally:
            channel.close()

    before, held_peak, peak, after, others, by_id, finished = asyncio.run(go())
    print(f"daemon RSS: {before:.1f} MiB before, {held_peak:.1f} peak while not read ({HOLD_S:.0f} s), "
          f"{peak:.1f} peak while read, {after:.1f} after; meanwhile Status {others[2]:.2f} s, "
          f"a 5-token generate {others[3]:.2f} s (behind the engine's 512 generations)")
    status, got, _, _ = others
    assert status["ready"]
    assert len(got["ids"]) == 5 and got["finish"] == "length"
    assert by_id == {i: TOKENS for i in range(1, GENERATIONS + 1)}
    assert finished == set(by_id)
    # Both phases: how much the old code had queued by the end of the hold depends on the
    # engine's speed (on a loaded 2-core VM +35 to +88 MiB); the rest then went out as one
    # message of every update, copied, while the client read (+95 MiB at the peak).
    assert peak - before < GROWTH_BOUND_MIB, (before, held_peak, peak)
    assert held_peak - before < GROWTH_BOUND_MIB, (before, held_peak)
