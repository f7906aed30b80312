"""The HTTP door's connection caps (``api/http/connections.py``) under the two floods of issue 37,
without an engine: the real app on a real uvicorn port over a core whose engine never comes
(as tests/test_trust_http.py). A streamed response stands in for a streamed completion: the
unload route is replaced by one that streams a line every 50 ms.

- finding 8: the head caps hold for a request pipelined behind a running one (its head is
  counted from its first byte, not buffered until the running one ends);
- finding 10: connections trickling their heads do not lock a new client out at the cap (the
  one waiting longest for its head makes room), and a running stream is never the one closed.
"""

from __future__ import annotations

import asyncio
import re
import select
import socket
import threading
import time

import httpx
import pytest
from starlette.responses import StreamingResponse

from loractld.api.http import models
from loractld.api.http import settings as http_settings
from test_trust_http import _answer as _until_closed, _raw, _serve

KEY = b"k"
MiB = 1 << 20
STREAM_END = b"4\r\nend\n\r\n0\r\n\r\n"   # the stream's last line, then its last chunk


@pytest.fixture
def streamed(monkeypatch):
    """POST /v1/unload_lora_adapter answers a stream of ``n`` lines, one per 50 ms, and a last
    line ``end`` (sooner when ``stop`` is set)."""
    stream = {"n": 20, "stop": threading.Event()}

    async def unload_adapter(core, body, who):
        async def lines():
            for i in range(stream["n"]):
                if stream["stop"].is_set():
                    break
                yield b"tick %d\n" % i
                await asyncio.sleep(0.05)
            yield b"end\n"
        return StreamingResponse(lines(), media_type="text/plain")

    monkeypatch.setattr(models, "unload_adapter", unload_adapter)
    return stream


def _stream_request(*, close: bool) -> bytes:
    body = b'{"lora_name": "x"}'
    return (b"POST /v1/unload_lora_adapter HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer k\r\n"
            b"Content-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (len(body), b"Connection: close\r\n"
                                                                                  if close else b"")) + body


def _answer(sock: socket.socket) -> bytes:
    """Everything until the server closes (a reset after its answer counts as closed)."""
    return _until_closed(sock, reset=b"")


def _until(sock: socket.socket, needle: bytes) -> bytes:
    got = b""
    while needle not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    return got


def _push(sock: socket.socket, data: bytes, stall_s: float) -> int:
    """Send as much of ``data`` as the peer takes; stop when it has taken none for ``stall_s``
    (it stopped reading) or closed. The bytes the kernel accepted."""
    view, sent = memoryview(data), 0
    sock.setblocking(False)
    try:
        while sent < len(data):
            if not select.select([], [sock], [], stall_s)[1]:
                break
            try:
                sent += sock.send(view[sent:sent + MiB])
            except BlockingIOError:
                continue
            except OSError:
                break
    finally:
        sock.setblocking(True)
        sock.settimeout(10)
    return sent


def _rss() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) << 10 for line in status if line.startswith("VmRSS:"))


def _closed_by_server(sock: socket.socket) -> bytes | None:
    """What the server said before closing ``sock``, or None while it is still open."""
    sock.setblocking(False)
    try:
        data = sock.recv(65536)
    except BlockingIOError:
        return None
    except ConnectionResetError:
        return b""
    finally:
        sock.setblocking(True)
    return data + _answer(sock) if data else b""


def test_a_head_pipelined_behind_a_running_stream_is_capped(streamed):
    """Finding 8: a second request's head sent on the same connection while a stream runs, with
    a 32 MiB header (cap 64 KiB). Its bytes stop being read once past the cap: the process
    grows by far less than the header while the stream runs (the code before buffered it all
    until the stream ended), the stream runs to its end, then 431 and close."""
    streamed["n"] = 200   # 10 s at most: ended by the client once it has measured
    settings = http_settings.HttpSettings(api_key=KEY, max_header_bytes=64 << 10, header_timeout_s=5)
    pad = b"a" * (32 * MiB)
    head = b"GET /version HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer k\r\nX-Pad: " + pad

    async def requests(url):
        def client():
            with _raw(url) as sock:
                sock.sendall(_stream_request(close=False))
                first = _until(sock, b"tick 0\n")        # the stream runs: its head is complete
                before = _rss()
                started = time.monotonic()
                sent = _push(sock, head, stall_s=0.5)
                time.sleep(0.2)                           # what was sent has been read, or is not going to be
                grown, measured_after = _rss() - before, time.monotonic() - started
                streamed["stop"].set()
                return sent, grown, measured_after, first + _answer(sock)

        return await asyncio.to_thread(client)

    sent, grown, measured_after, answer = asyncio.run(_serve(settings, requests))
    print(f"pipelined 32 MiB header: the client sent {sent / MiB:.1f} MiB (kernel buffers included), "
          f"RSS grew {grown / MiB:.1f} MiB, measured {measured_after:.2f} s into the stream")
    assert grown < 8 * MiB, f"RSS grew by {grown / MiB:.1f} MiB for a 32 MiB header (cap 64 KiB)"
    stream, end, after = answer.partition(STREAM_END)
    assert stream.startswith(b"HTTP/1.1 200 ") and end, answer[:400]
    assert after.startswith(b"HTTP/1.1 431 ") and b"--http-max-header-size" in after, answer[-600:]


def test_a_slow_pipelined_head_is_timed_out_behind_a_running_stream(streamed):
    """Finding 8, the timeout: a pipelined head that never completes has the header timeout
    (0.3 s here) from its first byte, as any head; it passes while the stream before it runs,
    which is never cut, so the connection is closed as soon as the stream ends (the code before
    kept it for uvicorn's 5 s keep-alive after)."""
    streamed["n"] = 10
    settings = http_settings.HttpSettings(api_key=KEY, header_timeout_s=0.3)

    async def requests(url):
        def client():
            with _raw(url) as sock:
                sock.sendall(_stream_request(close=False))
                _until(sock, b"tick 0\n")
                started = time.monotonic()
                sock.sendall(b"GET /version HTTP/1.1\r\nHost: localhost\r\n")   # never finished
                answer = _answer(sock)
                return answer, time.monotonic() - started

        return await asyncio.to_thread(client)

    answer, closed_after = asyncio.run(_serve(settings, requests))
    assert b"tick 9\n" in answer and answer.endswith(STREAM_END), answer[-200:]   # the stream ran to its end
    assert closed_after < 1.5, closed_after   # ~0.5 s of stream, not the 5 s keep-alive after it


def test_slow_heads_at_the_connection_cap_make_room_but_a_stream_is_never_closed(streamed):
    """Finding 10: 40 connections trickle their heads at a cap of 20 (one more connection holds
    a running stream, opened first: the oldest). A new client's request is answered at once;
    the connections closed to make room are the slow heads that waited longest, answered 503;
    the stream runs to its end."""
    streamed["n"] = 40   # 2 s
    settings = http_settings.HttpSettings(api_key=KEY, max_connections=20, header_timeout_s=30)

    async def requests(url):
        def flood():
            stream = _raw(url)
            stream.sendall(_stream_request(close=True))
            _until(stream, b"tick 0\n")
            slow = [_raw(url) for _ in range(40)]
            for sock in slow:
                sock.sendall(b"GET /version HTTP/1.1\r\nHost: localhost\r\n")   # never finished
            for _ in range(3):                                                  # trickled
                time.sleep(0.05)
                for sock in slow:
                    try:
                        sock.send(b"X")
                    except OSError:
                        pass
            started = time.monotonic()
            version = httpx.get(f"{url}/version", headers={"Authorization": "Bearer k"}, timeout=5)
            took = time.monotonic() - started
            time.sleep(0.1)
            closed = [_closed_by_server(sock) for sock in slow]
            rest = _answer(stream)
            for sock in [stream, *slow]:
                sock.close()
            return version, took, closed, rest

        return await asyncio.to_thread(flood)

    version, took, closed, rest = asyncio.run(_serve(settings, requests))
    print(f"/version at the cap among 40 trickling heads: {version.status_code} in {took * 1000:.0f} ms")
    assert version.status_code == 200 and took < 1, (version.status_code, took)
    # 1 stream + 40 slow + 1 client at a cap of 20: the 22 slow heads that waited longest made room.
    assert [answer is not None for answer in closed] == [True] * 22 + [False] * 18, closed
    assert all(answer.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in answer
               for answer in closed[:22]), closed[0]
    assert b"tick 39\n" in rest and rest.endswith(STREAM_END), rest[-200:]


def test_at_the_cap_with_no_slow_head_a_new_connection_is_refused(streamed):
    """When every connection is running a request, there is nothing to make room with: 503."""
    settings = http_settings.HttpSettings(api_key=KEY, max_connections=3)

    async def requests(url):
        def client():
            streams = [_raw(url) for _ in range(3)]
            for sock in streams:
                sock.sendall(_stream_request(close=True))
            for sock in streams:
                _until(sock, b"tick 0\n")
            refused = _answer(_raw(url))
            rests = [_answer(sock) for sock in streams]
            for sock in streams:
                sock.close()
            return refused, rests

        return await asyncio.to_thread(client)

    refused, rests = asyncio.run(_serve(settings, requests))
    assert refused.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in refused, refused
    assert all(b"tick 19\n" in rest and rest.endswith(STREAM_END) for rest in rests)


def test_pipelined_requests_are_answered_in_order_then_an_oversized_head_431():
    """Pipelining still works: three requests in one write are answered in order; a fourth
    whose (complete) head is over the cap, in the same write, is answered 431 after them."""
    settings = http_settings.HttpSettings(api_key=KEY, max_header_bytes=4096)
    get = b"GET /version HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer k\r\n\r\n"

    async def requests(url):
        def client():
            with _raw(url) as sock:
                sock.sendall(get * 3 + b"GET /version HTTP/1.1\r\nHost: localhost\r\nX-Pad: %s\r\n\r\n" % (b"a" * 5000))
                return _answer(sock)

        return await asyncio.to_thread(client)

    answer = asyncio.run(_serve(settings, requests))
    statuses = re.findall(rb"HTTP/1\.1 (\d{3}) ", answer)
    assert statuses == [b"200", b"200", b"200", b"431"], answer[-400:]
