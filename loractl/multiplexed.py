"""The client side of ``GenerateMany``: one stream carries a ``Client``'s concurrent generations.

The daemon sends, per loop turn, one message with every update of every generation on the
stream (``loractld.api.multiplexed``); a client with 64 generations running gets one message
per engine step instead of 64, and opens no HTTP/2 stream per request.

Invariants:
- One stream per ``Multiplexer`` at a time, opened by the first generation and again by the
  first one after it ended.
- One sender at a time (a lock): grpclib's ``send_message`` is not safe from two tasks.
- One task reads and hands each update to its generation's queue. When the stream ends or
  fails, every generation still open gets that end: the daemon's status as a ``GRPCError``,
  anything else as ``StreamTerminatedError`` (``Client`` turns both into domain errors). A send
  that fails because the stream broke waits for that end too, which may carry the daemon's
  reason (an oversized message is refused so).
- A generation closed before its last update sends a cancel for its id, and the daemon aborts
  it in the engine; updates that still arrive for the id are dropped.
- At most ``MAX_GENERATIONS`` (the daemon's limit per stream) are open at once; more wait.
- A ``Multiplexer`` belongs to the event loop it was made in.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator

from grpclib.const import Status
from grpclib.exceptions import GRPCError, StreamTerminatedError

from loractl.v1 import loractl_pb2 as pb

MAX_GENERATIONS = 1024   # loractld.api.multiplexed.MAX_GENERATIONS


class Multiplexer:
    def __init__(self, stub) -> None:
        self.loop = asyncio.get_running_loop()
        self.streams_opened = 0      # for tests: generations share a stream
        self._stub = stub
        self._stream = None
        self._reader: asyncio.Task | None = None
        self._waiting: dict[int, tuple[object, asyncio.Queue]] = {}   # id: (its stream, its queue)
        self._ids = itertools.count(1)
        self._opening = asyncio.Lock()
        self._sending = asyncio.Lock()
        self._slots = asyncio.Semaphore(MAX_GENERATIONS)

    async def generate(self, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateReply]:
        """The replies of one generation, as ``Generate`` streams them."""
        async with self._slots:
            stream = await self._open()
            ident, queue = next(self._ids), asyncio.Queue()
            self._waiting[ident] = (stream, queue)
            ended = False
            try:
                try:
                    await self._send(stream, pb.GenerateManyRequest(id=ident, request=request))
                except (StreamTerminatedError, OSError):
                    # The stream broke under the send (a daemon refusing an oversized message
                    # resets it): the reader hears why, and tells every generation on it.
                    pass
                while not ended:
                    update = await queue.get()
                    ended = True
                    if isinstance(update, GRPCError):
                        raise GRPCError(update.status, update.message, update.details)
                    if isinstance(update, BaseException):
                        raise StreamTerminatedError(f"the stream to the daemon ended: {update}") from update
                    if update.error_code:
                        raise GRPCError(Status(update.error_code), update.error_message)
                    ended = bool(update.reply.finish_reason)
                    yield update.reply
            finally:
                del self._waiting[ident]
                if not ended and self._stream is stream:
                    with contextlib.suppress(Exception):   # a broken stream ends the generation anyway
                        await self._send(stream, pb.GenerateManyRequest(id=ident, cancel=True))

    async def _open(self):
        async with self._opening:
            if self._stream is None:
                stream = self._stub.GenerateMany.open()
                await stream.__aenter__()
                try:
                    await stream.send_request()
                except BaseException as e:
                    await stream.__aexit__(type(e), e, e.__traceback__)
                    raise
                self._stream = stream
                self.streams_opened += 1
                self._reader = asyncio.create_task(self._read(stream))
            return self._stream

    async def _send(self, stream, message: pb.GenerateManyRequest) -> None:
        async with self._sending:
            await stream.send_message(message)

    async def _read(self, stream) -> None:
        end: BaseException
        try:
            while True:
                reply = await stream.recv_message()
                if reply is None:
                    async with self._sending:
                        with contextlib.suppress(Exception):
                            await stream.end()
                    await stream.recv_trailing_metadata()   # the daemon's status, when not OK
                    raise StreamTerminatedError("the daemon ended the stream")
                for update in reply.updates:
                    waiting = self._waiting.get(update.id)
                    if waiting is not None:
                        waiting[1].put_nowait(update)
        except BaseException as e:  # noqa: BLE001 - every open generation hears how the stream ended
            end = e
        if self._stream is stream:
            self._stream = None
        cancelled = isinstance(end, asyncio.CancelledError)
        try:
            # A reset stream may still carry the daemon's status (an UNIMPLEMENTED from a daemon
            # older than GenerateMany comes so): grpclib raises it here.
            await stream.__aexit__(type(end), end, end.__traceback__)
        except GRPCError as e:
            end = e
        except BaseException:  # noqa: BLE001 - the end already known is the one to report
            pass
        for its_stream, queue in list(self._waiting.values()):
            if its_stream is stream:   # not those that opened the next stream meanwhile
                queue.put_nowait(end)
        if cancelled:
            raise asyncio.CancelledError

    def close(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
