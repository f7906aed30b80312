"""``GenerateMany``: a client's concurrent generations over one gRPC stream.

Over ``Generate`` every token is a gRPC message in an HTTP/2 DATA frame, each with grpclib's
and h2's send path in Python, and every request an HTTP/2 stream (headers, HPACK, trailers):
``bench/transport_floor.py`` measured that alone at ~12.6 µs of the daemon's CPU per token
and ~200 µs per request, about a quarter of what the whole daemon spends per token at 64
streams of 32-token answers. Over ``GenerateMany`` what one engine step makes for all of a
client's generations leaves as one message, and a request opens no HTTP/2 stream.

Invariants:
- Each generation runs in its own task, through the path ``Generate`` takes
  (``LoractlService.replies``: the same checks, audit and replies). Its updates leave in the
  order it made them; the last is the one with its finish reason, or its error. Nothing is
  sent for an id after that, nor after the client cancelled it.
- One task sends: grpclib's ``send_message`` is not safe from two tasks (a message split by
  flow control would interleave with another). Each time it runs it sends every update queued
  since, in one message; while a send waits on flow control, updates gather for the next.
- An error of one generation ends that generation only. A malformed message, or the end of
  the stream, ends them all: every task is cancelled, which aborts its request in the engine.
- When the client ends its side, the running generations finish and their updates go out
  before the stream ends (a client may send all its requests and close, as gRPC allows).
- At most ``MAX_GENERATIONS`` run at once on a stream; one more fails at once, as an invalid
  request (``loractl.Client`` never opens more). The updates queued while a send waits are
  bounded by what the running generations produce.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from grpclib.exceptions import GRPCError

from loractl.errors import InvalidRequest
from loractl.v1 import loractl_pb2 as pb

MAX_GENERATIONS = 1024


class Multiplexed:
    """Serve one ``GenerateMany`` stream: read requests, run each generation, send updates.

    ``replies(stream, request)`` is a generation's replies as ``Generate`` sends them;
    ``as_error(exception, operation)`` the ``GRPCError`` an exception leaves as."""

    def __init__(self, replies: Callable[..., AsyncIterator[pb.GenerateReply]], stream,
                 as_error: Callable[[Exception, str], GRPCError]) -> None:
        self._replies = replies
        self._stream = stream
        self._as_error = as_error
        self._running: dict[int, asyncio.Task] = {}
        self._queued: list[pb.GenerationUpdate] = []
        self._wake = asyncio.Event()
        self._closed = False

    async def serve(self) -> None:
        await self._stream.send_initial_metadata()
        sender = asyncio.create_task(self._send_until_closed())
        try:
            async for message in self._stream:
                self._take(message)
                if sender.done():
                    break   # a send failed: its error is raised below
            if self._running and not sender.done():
                finishing = asyncio.ensure_future(asyncio.gather(*self._running.values(), return_exceptions=True))
                await asyncio.wait((finishing, sender), return_when=asyncio.FIRST_COMPLETED)
        except BaseException:
            sender.cancel()   # the stream ends with this error: nothing more may be sent on it
            raise
        finally:
            tasks = list(self._running.values())
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self._closed = True
            self._wake.set()
        await sender

    def _take(self, message: pb.GenerateManyRequest) -> None:
        ident = message.id
        if message.cancel:
            task = self._running.pop(ident, None)
            if task is not None:
                task.cancel()
            return
        if not message.HasField("request"):
            raise InvalidRequest(f"GenerateMany message for generation {ident} has neither request nor cancel",
                                 "Send the message loractl/v1/loractl.proto defines (loractl.Client does).")
        if ident in self._running:
            raise InvalidRequest(f"generation id {ident} is already running on this stream",
                                 "Give every generation on a stream its own id (loractl.Client does).")
        if len(self._running) >= MAX_GENERATIONS:
            self._queue(self._failed(ident, InvalidRequest(
                f"more than {MAX_GENERATIONS} generations at once on one stream",
                "Wait for some to finish, or open another connection.")))
            return
        self._running[ident] = asyncio.create_task(self._generate(ident, message.request))

    async def _generate(self, ident: int, request: pb.GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(self._replies(self._stream, request)) as replies:
                async for reply in replies:
                    self._queue(pb.GenerationUpdate(id=ident, reply=reply))
        except asyncio.CancelledError:
            return   # the client cancelled it, or the stream ended: nothing more is sent for it
        except Exception as e:  # noqa: BLE001 - every error ends this generation only, as a status
            self._queue(self._failed(ident, e))
        finally:
            if self._running.get(ident) is asyncio.current_task():
                del self._running[ident]

    def _failed(self, ident: int, error: Exception) -> pb.GenerationUpdate:
        grpc_error = self._as_error(error, "GenerateMany")
        return pb.GenerationUpdate(id=ident, error_code=grpc_error.status.value, error_message=grpc_error.message or "")

    def _queue(self, update: pb.GenerationUpdate) -> None:
        self._queued.append(update)
        self._wake.set()

    async def _send_until_closed(self) -> None:
        while self._queued or not self._closed:
            if not self._queued:
                await self._wake.wait()
                self._wake.clear()
                continue
            updates, self._queued = self._queued, []
            await self._stream.send_message(pb.GenerateManyReply(updates=updates))
