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
  request (``loractl.Client`` never opens more).
- Every buffer is bounded, and a reader that lags slows its generations, as a ``Generate``
  stream does (issue 37, finding 7: a client that never read grew the daemon by 466 MiB).
  An update costs its encoded size plus ``UPDATE_OVERHEAD`` (the message that holds it) from
  when it is queued until the message carrying it has been handed to the transport. A stream
  holds at most ``STREAM_PENDING_BYTES`` of such cost; beyond its first
  ``STREAM_RESERVED_BYTES`` that cost is also drawn from a ``Budget`` shared by every
  ``GenerateMany`` stream of the daemon (``SHARED``, ``DAEMON_PENDING_BYTES``). A generation
  whose update does not fit waits before it queues it, and so stops pulling from the engine
  (vLLM merges what it makes meanwhile into its next output, as for a ``Generate`` stream
  that is not read). The reserve keeps a stream whose client reads moving while others that
  do not hold the shared budget. An update always fits a stream with nothing pending, so
  one larger than the bounds still goes out, alone. The refusal of a generation over
  ``MAX_GENERATIONS`` waits for room too, and the stream's requests are not read meanwhile
  (the client's sends then wait on HTTP/2 flow control).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable

from grpclib.exceptions import GRPCError

from loractl.errors import InvalidRequest
from loractl.v1 import loractl_pb2 as pb

MAX_GENERATIONS = 1024
# What an update costs while it waits to be sent, beyond its encoded size: the upb message
# that holds it (~1.1 KB of RSS for a one-token update, CPython 3.11 + protobuf's upb).
UPDATE_OVERHEAD = 1024
# Per stream: ~3,700 one-token updates, three to four engine steps of MAX_GENERATIONS
# generations, so a client that reads is never held back by it.
STREAM_PENDING_BYTES = 4 * 2**20
# The part of a stream's bound that is its own, not drawn from the daemon's budget.
STREAM_RESERVED_BYTES = 64 * 2**10
# Per daemon, all GenerateMany streams together (beyond each one's reserve).
DAEMON_PENDING_BYTES = 64 * 2**20


class Budget:
    """Cost of the updates that wait to be sent, shared by the streams that draw on it.

    Tied to no event loop: a stream that waits for room hands in an ``asyncio.Event`` of its
    own (``wake_on``), set at the next release."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._blocked: set[asyncio.Event] = set()

    def fits(self, more: int) -> bool:
        return more <= 0 or self.used + more <= self.limit

    def change(self, by: int) -> None:
        self.used += by
        if by < 0 and self._blocked:
            blocked, self._blocked = self._blocked, set()
            for event in blocked:
                event.set()

    def wake_on(self, event: asyncio.Event) -> None:
        self._blocked.add(event)

    def forget(self, event: asyncio.Event) -> None:
        self._blocked.discard(event)


SHARED = Budget(DAEMON_PENDING_BYTES)


class Multiplexed:
    """Serve one ``GenerateMany`` stream: read requests, run each generation, send updates.

    ``replies(stream, request)`` is a generation's replies as ``Generate`` sends them;
    ``as_error(exception, operation)`` the ``GRPCError`` an exception leaves as; ``budget``
    the daemon's (``SHARED`` unless given), ``stream_limit`` and ``reserved`` this stream's
    bound and the part of it not drawn from ``budget``."""

    def __init__(self, replies: Callable[..., AsyncIterator[pb.GenerateReply]], stream,
                 as_error: Callable[[Exception, str], GRPCError], *, budget: Budget | None = None,
                 stream_limit: int = STREAM_PENDING_BYTES, reserved: int = STREAM_RESERVED_BYTES) -> None:
        self._replies = replies
        self._stream = stream
        self._as_error = as_error
        self._running: dict[int, asyncio.Task] = {}
        self._queued: list[pb.GenerationUpdate] = []
        self._queued_cost = 0
        self._wake = asyncio.Event()
        self._closed = False
        self._budget = SHARED if budget is None else budget
        self._limit = stream_limit
        self._reserved = reserved
        self._pending = 0          # cost of the updates queued or being sent
        self._drawn = 0            # the part of it drawn from the budget
        self._room = asyncio.Event()   # set when some of it is released
        self._stopped = False      # the sender ended: nothing more goes out
        self._settled = False

    async def serve(self) -> None:
        try:
            await self._serve()
        finally:
            self._settle()

    async def _serve(self) -> None:
        await self._stream.send_initial_metadata()
        sender = asyncio.create_task(self._send_until_closed())
        try:
            async for message in self._stream:
                await self._take(message)
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

    async def _take(self, message: pb.GenerateManyRequest) -> None:
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
            await self._queue(self._failed(ident, InvalidRequest(
                f"more than {MAX_GENERATIONS} generations at once on one stream",
                "Wait for some to finish, or open another connection.")))
            return
        self._running[ident] = asyncio.create_task(self._generate(ident, message.request))

    async def _generate(self, ident: int, request: pb.GenerateRequest) -> None:
        try:
            async with contextlib.aclosing(self._replies(self._stream, request)) as replies:
                async for reply in replies:
                    # Waits while the stream is full: the engine is not read meanwhile.
                    await self._queue(pb.GenerationUpdate(id=ident, reply=reply))
        except asyncio.CancelledError:
            return   # the client cancelled it, or the stream ended: nothing more is sent for it
        except Exception as e:  # noqa: BLE001 - every error ends this generation only, as a status
            await self._queue(self._failed(ident, e))
        finally:
            if self._running.get(ident) is asyncio.current_task():
                del self._running[ident]

    def _failed(self, ident: int, error: Exception) -> pb.GenerationUpdate:
        grpc_error = self._as_error(error, "GenerateMany")
        return pb.GenerationUpdate(id=ident, error_code=grpc_error.status.value, error_message=grpc_error.message or "")

    async def _queue(self, update: pb.GenerationUpdate) -> None:
        """Queue ``update`` for the sender once it fits this stream's bound and the budget."""
        cost = update.ByteSize() + UPDATE_OVERHEAD
        while self._pending and not self._stopped:
            after = self._pending + cost
            if after <= self._limit:
                if self._budget.fits(max(0, after - self._reserved) - self._drawn):
                    break
                self._room.clear()
                self._budget.wake_on(self._room)
            else:
                self._room.clear()
            await self._room.wait()
        if self._stopped:
            return   # the stream is ending with an error: nothing more is sent
        self._account(cost)
        self._queued.append(update)
        self._queued_cost += cost
        self._wake.set()

    def _account(self, by: int) -> None:
        if self._settled:
            return
        self._pending += by
        drawn = max(0, self._pending - self._reserved)
        if drawn != self._drawn:   # within the reserve (a stream that is read), nothing to share
            self._budget.change(drawn - self._drawn)
            self._drawn = drawn
        if by < 0:
            self._room.set()

    def _settle(self) -> None:
        """The stream is over: what it holds of the budget goes back, whatever ended it."""
        self._stopped = True
        self._room.set()
        if not self._settled:
            self._budget.forget(self._room)
            self._budget.change(-self._drawn)
            self._settled = True

    async def _send_until_closed(self) -> None:
        try:
            while self._queued or not self._closed:
                if not self._queued:
                    await self._wake.wait()
                    self._wake.clear()
                    continue
                message = pb.GenerateManyReply(updates=self._queued)   # a copy: the list can go
                cost, self._queued, self._queued_cost = self._queued_cost, [], 0
                await self._stream.send_message(message)
                del message
                self._account(-cost)   # released once the transport has it
        finally:
            self._stopped = True
            self._room.set()
