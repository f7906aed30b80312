"""Caps on what HTTP connections may hold: how many are open, how long and how large a
request's head may be. uvicorn has none of these (``limit_concurrency`` answers 503 but keeps
the connection; nothing times out a request head that trickles in), so a flood of slow
connections would hold file descriptors that the gRPC socket and the engine also need.

Invariants:
- At most ``max_connections`` connections are open. One more makes room by closing the
  connection that has waited longest for a request head (answered 503; closed without an
  answer when it is idle after a response); only when every open connection has a request
  running is the new one answered 503 and closed at once, before any of its bytes are read.
  Connections that trickle their heads cannot lock new clients out: a client that sends its
  request at once has it complete long before it is the longest waiting (issue 37, finding 10).
- Every request head on a connection, a pipelined one arriving while the request before it
  runs included, must be complete within ``header_timeout_s`` of its first byte (the first
  head: of connecting) and within ``max_head_bytes``; else the connection is closed (431 for
  size). A head is counted as it arrives, never buffered whole first (finding 8).
- A running request (its head complete) is never cut by these caps: streams keep flowing.
  A pipelined head that breaks a cap stops the reading (nothing more is buffered); the
  connection is closed once the responses before it are complete (431 for size).

Why the longest wait rather than a share per peer address: the door listens on loopback by
default, where every client is 127.0.0.1, and behind a proxy every client is the proxy; a
share per address would not let a local client in beside a local flood. A closed slow client
sees the 503 (or a reset, when some of its bytes were still unread at the close) and may
retry.

How a head is seen: with httptools (uvicorn's choice when it is installed, as vLLM's
dependencies make it) through the parser's callbacks, a message begins and its headers are
complete, so a head is counted from its first byte wherever it starts. With h11, between
requests only: h11 reads no further than one read past a running request, and answers 400
to an incomplete head past ``h11_max_incomplete_event_size`` (16 KiB by default).
"""

from __future__ import annotations

import asyncio
import json
from collections import OrderedDict

from loractld.api.http.errors import error_body

_LINGER_S = 1.0   # given a connection's last bytes to leave before a close that would reset it


def _raw_error(status: int, reason: str, message: str, hint: str, code: str) -> bytes:
    body = json.dumps(error_body(status, message, hint, code=code)).encode()
    return (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\nconnection: close\r\n"
            f"content-length: {len(body)}\r\n\r\n").encode() + body


def capped_protocol(base: type, *, max_connections: int, header_timeout_s: float, max_head_bytes: int) -> type:
    """``base`` (uvicorn's HTTP protocol class) with the caps of this module."""
    too_many = _raw_error(503, "Service Unavailable", f"too many open HTTP connections ({max_connections})",
                          "Retry in a moment, reuse connections, or raise loractld --http-max-connections.",
                          "too_many_connections")
    head_too_large = _raw_error(431, "Request Header Fields Too Large",
                                f"the request head is larger than {max_head_bytes} bytes",
                                "Send fewer or shorter headers, or raise loractld --http-max-header-size.",
                                "headers_too_large")
    # httptools' parser calls these on the protocol; h11's protocol has none of them.
    parser_callbacks = all(hasattr(base, name) for name in ("on_message_begin", "on_headers_complete",
                                                              "on_message_complete"))
    # Shared by the connections of one server (this class is made once per server):
    waiting: OrderedDict[Capped, None] = OrderedDict()   # no request running, oldest wait first
    evicted: set[Capped] = set()                         # closed to make room, not yet gone

    def make_room() -> bool:
        """Close the connection that has waited longest for a request head, if any."""
        while waiting:
            oldest, _ = waiting.popitem(last=False)
            if oldest._between_requests() and not oldest.transport.is_closing():
                evicted.add(oldest)
                oldest._close(b"" if oldest._idle() else too_many)
                return True
        return False

    class Capped(base):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0
        _in_head = False         # a request head has begun and is not complete (parser callbacks)
        _heads = 0               # request heads begun on this connection (parser callbacks)
        _boundary = True         # the next byte begins a new request (parser callbacks)
        _rejected = False        # a cap was broken: nothing more is read or parsed
        _answer = b""            # ... and this is the answer once the running request is (b"": none)

        def connection_made(self, transport) -> None:
            # self.connections is the server's set of open connections (shared by all).
            if len(self.connections) - len(evicted) >= max_connections and not make_room():
                self._refused = True
                transport.write(too_many)
                transport.close()
                return
            super().connection_made(transport)
            waiting[self] = None
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            if self._rejected:   # answered (or to be answered) and closed: read no further
                self.transport.pause_reading()
                return
            if parser_callbacks:
                self._parse(data)
            else:
                self._parse_between_requests(data)
            if not self._between_requests():
                waiting.pop(self, None)

        def _parse(self, data: bytes) -> None:
            heads, in_head, boundary = self._heads, self._in_head, self._boundary
            super().data_received(data)
            if not self._in_head or self._rejected:
                return   # no head left incomplete: a complete one was measured whole (on_headers_complete)
            if in_head and self._heads == heads:
                self._head_bytes += len(data)           # the same head goes on
            elif boundary and not in_head and self._heads == heads + 1:
                self._head_bytes = len(data)            # a head began with these bytes
            # else a head began after a body in these bytes: at most one read's worth goes
            # uncounted until its next bytes; its whole size is checked when it completes.
            if self._head_bytes > max_head_bytes:
                self._reject(head_too_large)

        def _parse_between_requests(self, data: bytes) -> None:
            waiting_for_head = self._between_requests()
            if waiting_for_head and self._head_timer is None:
                self._await_head()  # a new request head begins: it has header_timeout_s
            self._head_bytes = self._head_bytes + len(data) if waiting_for_head else 0
            super().data_received(data)
            if not self._between_requests():
                self._head_bytes = 0
                self._cancel_timer()
            elif self._head_bytes > max_head_bytes:
                self._close(head_too_large)

        # httptools' parser callbacks (see parser_callbacks)
        def on_message_begin(self) -> None:
            if self._rejected:
                return
            self._in_head, self._boundary, self._head_bytes = True, False, 0
            self._heads += 1
            if self._head_timer is None:
                self._await_head()   # a head after the first: header_timeout_s from its first byte
            super().on_message_begin()

        def on_url(self, url: bytes) -> None:
            if not self._rejected:
                super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            if not self._rejected:
                super().on_header(name, value)

        def on_headers_complete(self) -> None:
            if self._rejected:
                return
            self._in_head, self._head_bytes = False, 0
            self._cancel_timer()
            # The whole head, however its bytes came: request target, names, values, ": " and CRLFs.
            if len(self.url) + sum(len(name) + len(value) + 4 for name, value in self.headers) > max_head_bytes:
                self._reject(head_too_large)
                return
            super().on_headers_complete()

        def on_body(self, body: bytes) -> None:
            if not self._rejected:
                super().on_body(body)

        def on_message_complete(self) -> None:
            self._boundary = True
            if not self._rejected:
                super().on_message_complete()

        def on_response_complete(self) -> None:
            if self._rejected and not getattr(self, "pipeline", None):
                self._close_after(self._answer)   # the requests before the rejected head are answered
                return
            super().on_response_complete()
            if self._between_requests() and not self.transport.is_closing() and not self._rejected:
                waiting[self] = None   # waits for its next head from now: the newest wait
                waiting.move_to_end(self)
                if not parser_callbacks and self._buffered_head():
                    self._await_head()   # h11 held part of a pipelined head: its time runs from now

        def connection_lost(self, exc) -> None:
            self._cancel_timer()
            waiting.pop(self, None)
            evicted.discard(self)
            if not self._refused:
                super().connection_lost(exc)

        def _between_requests(self) -> bool:
            """No request head is complete that has not been answered yet."""
            return self.cycle is None or self.cycle.response_complete

        def _buffered_head(self) -> int:
            """h11: the bytes of the next request it holds unparsed (read while one ran)."""
            trailing = getattr(getattr(self, "conn", None), "trailing_data", None)
            self._head_bytes = len(trailing[0]) if trailing else 0
            return self._head_bytes

        def _idle(self) -> bool:
            """Kept alive after a response, and no byte of another request yet."""
            return self.cycle is not None and not self._in_head and self._head_bytes == 0

        def _reject(self, answer: bytes) -> None:
            """Close for a broken cap: now, or once the running request is answered (never cut it)."""
            self._rejected, self._answer, self._in_head = True, answer, False
            self._cancel_timer()
            waiting.pop(self, None)
            if self._between_requests():
                self._close(answer)
            else:
                self.transport.pause_reading()   # uvicorn's flow control does not know: stays paused

        def _await_head(self) -> None:
            self._cancel_timer()
            self._head_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self.transport.is_closing():
                return
            if self._between_requests():
                self.transport.close()  # no answer: the client never finished asking
            elif self._in_head:
                self._reject(b"")       # a pipelined head: closed once the request before it is answered

        def _cancel_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _close(self, answer: bytes) -> None:
            self._cancel_timer()
            waiting.pop(self, None)
            if not self.transport.is_closing():
                if answer:
                    self.transport.write(answer)
                self.transport.close()

        def _close_after(self, answer: bytes) -> None:
            """Close a connection whose unread bytes were left in the kernel (reading paused): a close
            then resets it, and the kernel drops what it has not sent yet (the last of the response
            before, this answer). So: the answer, end of writing (the client reads to the end),
            and the close a moment later."""
            self._cancel_timer()
            waiting.pop(self, None)
            if self.transport.is_closing():
                return
            if answer:
                self.transport.write(answer)
            if self.transport.can_write_eof():
                self.transport.write_eof()
            asyncio.get_running_loop().call_later(_LINGER_S, self.transport.close)

    Capped.__name__ = f"Capped{base.__name__}"
    return Capped
