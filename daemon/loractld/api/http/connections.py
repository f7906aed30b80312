"""Caps on what HTTP connections may hold: how many are open, how long and how large a
request's head may be. uvicorn has none of these (``limit_concurrency`` answers 503 but keeps
the connection; nothing times out a request head that trickles in), so a flood of slow
connections would hold file descriptors that the gRPC socket and the engine also need.

Invariants:
- At most ``max_connections`` connections are open; one more is answered 503 and closed at
  once, before any of its bytes are read.
- A connection must complete each request head within ``header_timeout_s`` of its first
  byte (or of connecting) and within ``max_head_bytes``; else it is closed (431 for size).
- A running request (its head complete) is never cut by these caps: streams keep flowing.
"""

from __future__ import annotations

import asyncio
import json

from loractld.api.http.errors import error_body

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

    class Capped(base):
        _refused = False
        _head_timer: asyncio.TimerHandle | None = None
        _head_bytes = 0

        def connection_made(self, transport) -> None:
            # self.connections is the server's set of open connections (shared by all).
            if len(self.connections) >= max_connections:
                self._refused = True
                transport.write(too_many)
                transport.close()
                return
            super().connection_made(transport)
            self._await_head()

        def data_received(self, data: bytes) -> None:
            if self._refused:
                return
            waiting = self._between_requests()
            if waiting and self._head_timer is None:
                self._await_head()  # a new request head begins: it has header_timeout_s
            self._head_bytes = self._head_bytes + len(data) if waiting else 0
            super().data_received(data)
            if not self._between_requests():
                self._head_bytes = 0
                self._cancel_timer()
            elif self._head_bytes > max_head_bytes:
                self._close(head_too_large)

        def connection_lost(self, exc) -> None:
            self._cancel_timer()
            if not self._refused:
                super().connection_lost(exc)

        def _between_requests(self) -> bool:
            """No request head is complete that has not been answered yet."""
            return self.cycle is None or self.cycle.response_complete

        def _await_head(self) -> None:
            self._cancel_timer()
            self._head_timer = asyncio.get_running_loop().call_later(header_timeout_s, self._head_late)

        def _head_late(self) -> None:
            self._head_timer = None
            if self._between_requests() and not self.transport.is_closing():
                self.transport.close()  # no answer: the client never finished asking

        def _cancel_timer(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _close(self, answer: bytes) -> None:
            self._cancel_timer()
            if not self.transport.is_closing():
                self.transport.write(answer)
                self.transport.close()

    Capped.__name__ = f"Capped{base.__name__}"
    return Capped
