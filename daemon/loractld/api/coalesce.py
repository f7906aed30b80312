"""One socket write per event-loop turn per connection, not one per gRPC frame.

grpclib writes every HTTP/2 frame it makes straight to the transport: for a streamed
generation that is one ``send`` system call per token per stream (headers, each data
frame, trailers). When an engine step ends, every stream it advanced wakes in the same loop
turn and writes its token; on one connection (a client multiplexing its streams, as
``loractl.Client`` and the benchmarks do) that was 64 system calls a step at 64 streams,
a fifth of the daemon's CPU (py-spy, docs/benchmarks.md "Front-end cost").

:class:`CoalescingTransport` stands in front of the real transport: ``write`` appends, and
the bytes of the turn leave in one ``write`` at the start of the next turn (``call_soon``).

Invariants:
- Bytes leave in the order they were written, none twice, none lost while the transport
  is open: ``close`` and the flush both write what is buffered first.
- Nothing waits longer than one loop turn; a connection that only reads never schedules.
- Flow control is the real transport's: it calls the protocol's ``pause_writing`` /
  ``resume_writing`` on its own buffer, which grpclib honours before it makes frames.
- After ``abort`` or once the transport is closing, buffered bytes are dropped, as the real
  transport would drop them.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

from grpclib.protocol import H2Protocol
from grpclib.server import Server


class CoalescingTransport:
    """A write-coalescing front for an ``asyncio.Transport``; everything else is delegated."""

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self._transport = transport
        self._loop = loop
        self._pending: list[bytes] = []
        self._scheduled = False
        self.writes = 0   # real writes made (tests/test_grpc_coalesce.py)

    def write(self, data: bytes) -> None:
        if not data:
            return
        self._pending.append(data)
        if not self._scheduled:
            self._scheduled = True
            self._loop.call_soon(self.flush)

    def writelines(self, chunks) -> None:
        for chunk in chunks:
            self.write(chunk)

    def flush(self) -> None:
        self._scheduled = False
        if not self._pending:
            return
        data = self._pending[0] if len(self._pending) == 1 else b"".join(self._pending)
        self._pending.clear()
        if self._transport.is_closing():
            return
        self.writes += 1
        self._transport.write(data)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def abort(self) -> None:
        self._pending.clear()
        self._transport.abort()

    def __getattr__(self, name: str) -> Any:   # get_extra_info, is_closing, pause_reading...
        return getattr(self._transport, name)


class CoalescingH2Protocol(H2Protocol):
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(CoalescingTransport(transport, asyncio.get_running_loop()))  # type: ignore[arg-type]


class _ClientHungUp(logging.Filter):
    """grpclib logs at INFO every call whose client closed its connection before the call's end
    (``Request was cancelled: Connection lost``): what every ``loractl run`` does once it has its
    answer, and a Ctrl-C. Normal client behaviour: kept at DEBUG (``--log-level DEBUG``), not INFO."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno == logging.INFO and str(record.msg).startswith("Request was cancelled"):
            record.levelno, record.levelname = logging.DEBUG, "DEBUG"
            return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)
        return True


def quiet_hang_ups(logger: logging.Logger = logging.getLogger("grpclib.server")) -> None:
    """Install :class:`_ClientHungUp` on grpclib's server logger, once."""
    if not any(isinstance(f, _ClientHungUp) for f in logger.filters):
        logger.addFilter(_ClientHungUp())


class CoalescingServer(Server):
    """grpclib's ``Server`` whose connections coalesce their writes (see the module's doc)."""

    def _protocol_factory(self) -> H2Protocol:
        # grpclib 0.4's factory, with our protocol: the handler bookkeeping is the base class's.
        protocol = super()._protocol_factory()
        return CoalescingH2Protocol(protocol.handler, protocol.config, protocol.h2_config)
