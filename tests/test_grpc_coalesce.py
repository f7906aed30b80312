"""The daemon's gRPC connections write once per event-loop turn, not once per HTTP/2 frame
(loractld.api.coalesce), and lose, reorder or repeat nothing doing it.

The unit tests drive the transport front with a recording transport; the end-to-end one runs
grpclib's real server and client over a real Unix socket, with many concurrent streams on one
connection, and counts the real writes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

from grpclib.client import Channel
from grpclib.health.service import Health
from grpclib.health.v1.health_grpc import HealthStub
from grpclib.health.v1.health_pb2 import HealthCheckRequest, HealthCheckResponse

from loractld.api.coalesce import CoalescingServer, CoalescingTransport


class Recorder:
    """A transport that keeps what it was given."""

    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closing = False
        self.closed = False
        self.aborted = False

    def write(self, data: bytes) -> None:
        assert not self.closed
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closing or self.closed

    def close(self) -> None:
        self.closed = True

    def abort(self) -> None:
        self.aborted = True

    def get_extra_info(self, name, default=None):
        return {"socket": "the-socket"}.get(name, default)


def _run(coro):
    return asyncio.run(coro)


def test_one_write_per_turn_in_order():
    async def go():
        real = Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        for i in range(100):
            t.write(b"%d," % i)
        t.write(b"")
        assert real.writes == []          # nothing leaves inside the turn
        await asyncio.sleep(0)
        assert real.writes == [b"".join(b"%d," % i for i in range(100))]
        t.write(b"next")
        await asyncio.sleep(0)
        assert real.writes[1:] == [b"next"]
        await asyncio.sleep(0)
        assert len(real.writes) == 2      # an idle connection does not write
        assert t.writes == 2
    _run(go())


def test_close_flushes_first_and_abort_drops():
    async def go():
        real = Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"last words")
        t.close()
        assert real.writes == [b"last words"] and real.closed
        await asyncio.sleep(0)            # the scheduled flush finds nothing left
        assert real.writes == [b"last words"]

        real = Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"lost")
        t.abort()
        await asyncio.sleep(0)
        assert real.writes == [] and real.aborted
    _run(go())


def test_closing_transport_gets_nothing_and_the_rest_is_delegated():
    async def go():
        real = Recorder()
        t = CoalescingTransport(real, asyncio.get_running_loop())
        t.write(b"x")
        real.closing = True
        await asyncio.sleep(0)
        assert real.writes == []
        assert t.get_extra_info("socket") == "the-socket"   # SO_PEERCRED reads this
        assert t.is_closing()
    _run(go())


def test_real_server_many_streams_one_connection(tmp_path: Path, monkeypatch):
    """64 concurrent calls on one connection through grpclib's real server and client: every
    reply arrives, and the server made far fewer socket writes than the frames it sent
    (each call alone is headers, data and trailers: 3 frames)."""
    flushes: list[int] = []
    real_flush = CoalescingTransport.flush

    def counting_flush(self):
        before = self.writes
        real_flush(self)
        if self.writes > before:
            flushes.append(1)

    monkeypatch.setattr(CoalescingTransport, "flush", counting_flush)

    async def go():
        path = str(tmp_path / "s.sock")
        server = CoalescingServer([Health()])
        await server.start(path=path)
        channel = Channel(path=path)
        try:
            stub = HealthStub(channel)
            replies = await asyncio.gather(*(stub.Check(HealthCheckRequest()) for _ in range(64)))
            assert [r.status for r in replies] == [HealthCheckResponse.SERVING] * 64
        finally:
            channel.close()
            server.close()
            await server.wait_closed()
    _run(go())
    assert 0 < len(flushes) < 64, len(flushes)
