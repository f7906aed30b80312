"""The gRPC servicer: messages in, ``Core`` calls, messages out; nothing else.

Invariants:
- Every domain error leaves as a gRPC status whose message carries kind, message and hint
  (``loractl.errors.to_wire``); anything else is logged with its traceback and leaves as
  INTERNAL with a one-line message, never as a bare traceback.
- State-changing RPCs are allowed to root, the daemon's own user and its socket group only,
  as the kernel reports the peer (SO_PEERCRED), and each one is audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import logging
import struct
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from google.protobuf.message import DecodeError
from grpclib.const import Status
from grpclib.exceptions import GRPCError

from loractl.errors import InvalidRequest, LoractlError, PermissionDenied, of_os_error, to_wire
from loractl.message_json import message_json
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlBase
from loractld.trust.audit import audited
from loractld.api.listed_text import ListedText
from loractld.api.multiplexed import Multiplexed
from loractld.trust.peers import may_change_state
from loractld.core import GenerationRequest
from loractld.core import DEFAULT_MAX_TOKENS, Sampling, Structured, TokenLogprob
from loractld.core.policy import Caller
from loractld.core.profiles import combined
from loractld.views import AdapterView

if TYPE_CHECKING:
    from loractld.core import Core

_log = logging.getLogger("loractld.grpc")
DEFAULT_MAX_MESSAGE_BYTES = 4 << 20   # gRPC's usual default; a prompt of a million tokens fits
AUDIT_PEEK_BYTES = 4096               # names and refs are short: enough to audit a refused call


def peer_credentials(stream) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of the Unix socket (SO_PEERCRED).

    grpclib exposes the transport only privately; the socket itself is what the kernel vouches for.
    """
    import socket as socket_module

    sock = stream.peer._transport.get_extra_info("socket")
    raw = sock.getsockopt(socket_module.SOL_SOCKET, socket_module.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def admission_message(fields: dict) -> pb.Admission:
    """An ``AdmissionView``'s fields (``dataclasses.asdict``) as its message."""
    fields["requests"] = [pb.RequestInfo(**r) for r in fields["requests"]]
    fields["adapters"] = [pb.AdapterQueue(**a) for a in fields["adapters"]]
    return pb.Admission(**fields)


def mutating(operation: str, target=lambda request: request.name):
    """Only root, the daemon's own user or its socket group may change state; audit each call.

    The caller is checked before its request is read: a refused caller's message is read only
    when it is small enough to name the target in the audit line (``AUDIT_PEEK_BYTES``). The
    handler receives the request message already read (the audit line names its target)."""

    def decorate(handler):
        @functools.wraps(handler)
        async def wrapper(self, stream):
            pid, uid, gid = peer_credentials(stream)
            principal = f"uid={uid} pid={pid}"
            if not may_change_state(uid, gid, self.socket_gid):
                try:
                    request = await recv_bounded(stream, AUDIT_PEEK_BYTES)
                    named = target(request) or "-"
                except (TooLarge, DecodeError):
                    named = "(request not read)"
                async with audited(principal, operation, named):
                    raise PermissionDenied(f"uid {uid} may not {operation} on this daemon")
            request = await stream.recv_message()
            async with audited(principal, operation, target(request) or "-"):
                await handler(self, stream, request)
        return wrapper

    return decorate


class TooLarge(InvalidRequest):
    """A request message over ``--max-message-size``: RESOURCE_EXHAUSTED on the wire, and an
    ``InvalidRequest`` (exit 2) once the client rebuilds it."""

    grpc_status = Status.RESOURCE_EXHAUSTED


async def recv_bounded(stream, limit: int):
    """``stream.recv_message()``, refusing a message over ``limit`` bytes from its 5-byte
    prefix, before its body is read: HTTP/2 flow control then keeps the rest of it with the
    client (at most one window, 4 MiB, is ever buffered here).

    grpclib reads messages of any size and has no setting for it; this is its
    ``Stream.recv_message`` with the check added (grpclib.stream.recv_message + dispatch)."""
    raw = stream._stream
    prefix = await raw.recv_data(5)
    if not prefix:
        return None
    compressed, size = struct.unpack(">?I", prefix)
    if compressed:
        raise InvalidRequest("compressed gRPC messages are not accepted", "Send messages uncompressed.")
    if size > limit:
        raise TooLarge(f"the request message is {size} bytes, over the daemon's limit of {limit}",
                       "Send a shorter prompt, or raise loractld --max-message-size.")
    message = stream._codec.decode(await raw.recv_data(size), stream._recv_type)
    message, = await stream._dispatch.recv_message(message)
    stream._messages_received += 1  # grpclib's own statistics, kept as its recv_message keeps them
    raw.connection.messages_received += 1
    raw.connection.last_message_received = time.monotonic()
    return message


def domain_errors(handler):
    """Turn domain errors raised by a handler into gRPC statuses the client can rebuild."""

    @functools.wraps(handler)
    async def wrapper(self, stream):
        # Every message read, by the handler or by ``mutating``, is bounded (see recv_bounded).
        stream.recv_message = functools.partial(recv_bounded, stream, self.max_message_bytes)
        try:
            await handler(self, stream)
        except (GRPCError, asyncio.CancelledError):
            raise
        except Exception as e:
            raise as_grpc_error(e, handler.__name__) from e

    return wrapper


def as_grpc_error(error: Exception, operation: str) -> GRPCError:
    """The gRPC status ``error`` leaves as (see the module's invariants); an unexpected error
    is logged with its traceback here."""
    if isinstance(error, GRPCError):
        return error
    error = of_os_error(error)
    if isinstance(error, DecodeError):
        # grpclib parses the request inside the handler (stream.recv_message), so bytes that
        # are no valid message (a wrong wire type, invalid UTF-8 in a string: found by
        # tests/test_fuzz_grpc.py) arrive here; they are the caller's fault, not ours.
        error = InvalidRequest(f"malformed {operation} request: {error}",
                               "Send the message loractl/v1/loractl.proto defines (loractl.Client does).")
    elif not isinstance(error, LoractlError):
        _log.error("unexpected error in %s", operation, exc_info=error)
        error = LoractlError(f"internal error in {operation}: {type(error).__name__}: {error}")
    return GRPCError(error.grpc_status, to_wire(error))


class LoractlService(LoractlBase):
    def __init__(self, core: Core, *, socket_gid: int | None = None,
                 max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> None:
        self.core = core
        self.socket_gid = socket_gid
        self.max_message_bytes = max_message_bytes
        self._listed = ListedMessages()
        self._listed_text = ListedText(lambda view: message_json(adapter_message(view)))
        # One listing at a time: one that arrives while another (or the prewarm) writes the kept
        # replies waits for it, then answers from them instead of writing them again beside it.
        self._listing = asyncio.Lock()

    @contextlib.asynccontextmanager
    async def _foreground(self):
        """The reply's writing too holds the core's background validation (``Core.in_foreground``)."""
        with self.core.in_foreground():
            yield

    async def prewarm(self) -> None:
        """Build what the first ``ls`` would (the views, the kept text and messages), before READY,
        so that the first caller does not: at 10,000 adapters that was 1 s of the call."""
        try:
            await self._listed_reply(json=True)
            await self._listed_reply(json=False)
        except Exception:  # noqa: BLE001 - a listing's failure is the next ls's to report
            _log.debug("prewarming the listing failed", exc_info=True)

    async def _listed_reply(self, *, json: bool) -> pb.ListReply:
        async with self._listing, self._foreground():
            owned = self.core.owned_adapters()   # a weighted profile's merge: listed as what that profile runs
            views = [a for a in await self.core.list_adapters() if a.name not in owned] + \
                await self.core.list_profiles()
            text = self._listed_text.reply(views) if json else None
            return pb.ListReply(json=text) if text is not None else self._listed.reply(views)

    @domain_errors
    async def Status(self, stream) -> None:
        await stream.recv_message()
        view = await self.core.status()
        fields = dataclasses.asdict(view)
        fields["engine"]["choices"] = [pb.EngineChoice(**c) for c in fields["engine"]["choices"]]
        fields["engine"] = pb.EngineConfig(**fields["engine"])
        fields["capacity"] = pb.Capacity(**fields["capacity"])
        fields["admission"] = admission_message(fields["admission"])
        fields["startup"] = pb.Startup(**fields["startup"])
        await stream.send_message(pb.StatusReply(**fields))

    @domain_errors
    async def Generate(self, stream) -> None:
        request: pb.GenerateRequest = await stream.recv_message()
        async with contextlib.aclosing(self.replies(stream, request)) as replies:
            async for reply in replies:
                await stream.send_message(reply)

    @domain_errors
    async def GenerateMany(self, stream) -> None:
        await Multiplexed(self.replies, stream, as_grpc_error).serve()

    async def replies(self, stream, request: pb.GenerateRequest) -> AsyncIterator[pb.GenerateReply]:
        """The replies of one generation, as ``Generate`` sends them; ``stream`` is the caller's
        (its peer is asked for credentials when ``request`` names an adapter folder)."""
        caller = None
        if request.lora:  # only an adapter can change state (a folder, an auto-pull): the core decides
            pid, uid, gid = peer_credentials(stream)
            caller = Caller("socket", uid=uid, gid=gid, pid=pid)
        generation = GenerationRequest(
            prompt=request.prompt,
            messages=[{"role": m.role, "content": m.content} for m in request.messages] if request.messages else None,
            lora=request.lora, sampling=_sampling_from(request.sampling), caller=caller,
            given_sampling=_given(request.sampling),
        )
        prepared = await self.core.prepare(generation)
        produced = 0
        async with contextlib.aclosing(self.core.run(prepared)) as deltas:
            async for delta in deltas:
                produced += len(delta.token_ids)
                reply = pb.GenerateReply(text=delta.text, token_ids=delta.token_ids)
                if delta.prompt_token_ids is not None:
                    reply.prompt_token_ids.extend(delta.prompt_token_ids)
                    reply.adapter = prepared.adapter.engine_name if prepared.adapter else ""
                if delta.finish_reason:
                    reply.finish_reason = delta.finish_reason
                    reply.usage.prompt_tokens = len(prepared.prompt_ids)
                    reply.usage.completion_tokens = produced
                if delta.logprobs:
                    reply.logprobs.extend(_logprob_messages(delta.logprobs))
                yield reply

    @domain_errors
    @mutating("pull", target=lambda r: f"{r.ref} as {r.name or '(default name)'}")
    async def Pull(self, stream, request: pb.PullRequest) -> None:
        async for event in self.core.pull(request.ref, name=request.name, revision=request.revision,
                                          force=request.force, token=request.hf_token or None,
                                          endpoint=request.hf_endpoint or None):
            reply = pb.PullProgress(stage=event.stage, file=event.file, done_bytes=event.done,
                                    total_bytes=event.total, message=event.message)
            if event.adapter is not None:
                reply.adapter.CopyFrom(adapter_message(AdapterView.of(event.adapter)))
            await stream.send_message(reply)

    @domain_errors
    async def List(self, stream) -> None:
        request: pb.ListRequest = await stream.recv_message()
        await stream.send_message(await self._listed_reply(json=request.json))

    @domain_errors
    async def Show(self, stream) -> None:
        request: pb.ShowRequest = await stream.recv_message()
        await stream.send_message(adapter_message(await self.core.show(request.name)))

    @domain_errors
    @mutating("load")
    async def Load(self, stream, request: pb.LoadRequest) -> None:
        await stream.send_message(adapter_message(await self.core.load(request.name, request.to)))

    @domain_errors
    @mutating("evict")
    async def Evict(self, stream, request: pb.EvictRequest) -> None:
        await stream.send_message(adapter_message(await self.core.evict(request.name, getattr(request, "from"))))

    @domain_errors
    @mutating("pin")
    async def Pin(self, stream, request: pb.PinRequest) -> None:
        await stream.send_message(adapter_message(await self.core.pin(request.name, request.to)))

    @domain_errors
    @mutating("unpin")
    async def Unpin(self, stream, request: pb.NameRequest) -> None:
        await stream.send_message(adapter_message(await self.core.unpin(request.name)))

    @domain_errors
    @mutating("admission", target=lambda request: request.policy)
    async def SetAdmission(self, stream, request: pb.AdmissionRequest) -> None:
        max_wait = request.max_wait_s if request.HasField("max_wait_s") else None
        view = await self.core.set_admission(request.policy, max_wait)
        await stream.send_message(admission_message(dataclasses.asdict(view)))

    @domain_errors
    @mutating("rm")
    async def Remove(self, stream, request: pb.RemoveRequest) -> None:
        removed = await self.core.remove(request.name, force=request.force)
        await stream.send_message(pb.RemoveReply(adapter=adapter_message(removed.adapter), unloaded=removed.unloaded))

    @domain_errors
    @mutating("create")
    async def Create(self, stream, request: pb.CreateRequest) -> None:
        modelfile = combined(
            request.modelfile, base=getattr(request, "from"), adapters=list(request.adapters),
            system=request.system if request.HasField("system") else None,
            template=request.template if request.HasField("template") else None,
            parameters=list(request.parameters), messages=[{"role": m.role, "content": m.content}
                                                           for m in request.messages],
            license=list(request.license))
        await stream.send_message(adapter_message(await self.core.create(request.name, modelfile,
                                                                         force=request.force)))

    @domain_errors
    @mutating("copy", target=lambda r: f"{r.source} to {r.destination}")
    async def Copy(self, stream, request: pb.CopyRequest) -> None:
        await stream.send_message(adapter_message(await self.core.copy(request.source, request.destination,
                                                                       force=request.force)))

    @domain_errors
    @mutating("merge", target=lambda r: f"{' '.join(f'{s.name}={s.weight:g}' for s in r.sources)} as {r.name}")
    async def Merge(self, stream, request: pb.MergeRequest) -> None:
        view = await self.core.merge(request.name, [(s.name, s.weight) for s in request.sources],
                                     method=request.method or "cat", svd_rank=request.svd_rank or None,
                                     force=request.force)
        await stream.send_message(adapter_message(view))

    @domain_errors
    async def Events(self, stream) -> None:
        request: pb.EventsRequest = await stream.recv_message()
        async for event in self.core.watch_events(request.history):
            await stream.send_message(pb.LifecycleEvent(kind=event.kind, adapter=event.adapter, reason=event.reason,
                                                        message=event.message, time=event.time))

    @domain_errors
    async def Metrics(self, stream) -> None:
        await stream.recv_message()
        await stream.send_message(pb.MetricsReply(text=await self.core.metrics_text()))


_ADAPTER_FIELDS = tuple(f.name for f in dataclasses.fields(AdapterView))
_SCALARS = (str, int, float, bool)


class ListedMessages:
    """``ListReply``s of listings made from wire bytes kept per adapter: each adapter's message
    is serialized once from its manifest's view (``AdapterView.base``, the same object while its
    store entry is unchanged) and a listing's copy adds the bytes of only the fields it holds
    other values in. Protobuf merges concatenated encodings of a message field by field, the
    last value of a scalar winning, so base + delta decodes as the listing's message; a delta
    whose field is its proto default (not encoded) or not a scalar takes the whole message
    instead. The reply is one parse of the joined bytes (C): at 10,000 adapters copying and
    setting 10,000 messages in Python was most of the reply's cost. Holds the bytes of the last
    listing only."""

    def __init__(self) -> None:
        self._made: dict[int, tuple[AdapterView, bytes]] = {}   # id(base): (base, its framed bytes)

    def reply(self, views: list[AdapterView]) -> pb.ListReply:
        return pb.ListReply.FromString(self.reply_bytes(views))

    def reply_bytes(self, views: list[AdapterView]) -> bytes:
        """The encoded ``ListReply`` of ``views``."""
        parts, made, held_before = [], {}, self._made
        for view in views:
            changed = view.changes()
            if changed is None:
                parts.append(_framed(adapter_message(view).SerializeToString()))
                continue
            base = view.base
            held = held_before.get(id(base))
            if held is None or held[0] is not base:   # id() is a key only while the view lives: kept
                held = (base, _framed(adapter_message(base).SerializeToString()))
            made[id(base)] = held
            if not changed:
                parts.append(held[1])
            elif all(type(v) in _SCALARS and v for v in changed.values()):   # the base's bytes unframed, then these
                parts.append(_framed(_unframed(held[1]) + pb.Adapter(**changed).SerializeToString()))
            else:
                parts.append(_framed(adapter_message(view).SerializeToString()))
        self._made = made
        return b"".join(parts)


def _unframed(framed: bytes) -> bytes:
    """The message in ``framed`` (:func:`_framed`): after its tag and its size's varint bytes.
    Only the framed bytes are kept (10,000 adapters' twice was 4.7 MB more of RSS)."""
    start = 1
    while framed[start] & 0x80:
        start += 1
    return framed[start + 1:]


def _framed(encoded: bytes) -> bytes:
    """``encoded`` as one element of ``ListReply.adapters`` (field 1, length-delimited)."""
    size, prefix = len(encoded), bytearray(b"\x0a")
    while size >= 0x80:
        prefix.append(size & 0x7F | 0x80)
        size >>= 7
    prefix.append(size)
    return bytes(prefix) + encoded


def adapter_message(view: AdapterView) -> pb.Adapter:
    # Field by field, not dataclasses.asdict (a deep copy): ls of 10,000 adapters spent 0.5 s in it.
    fields = {name: getattr(view, name) for name in _ADAPTER_FIELDS}   # files: dicts, as FileRecord takes
    profile = fields.pop("profile")
    merge = fields.pop("merge")
    if merge is not None:
        fields["merge"] = dataclasses.asdict(merge)
    if profile is not None:
        profile = dataclasses.asdict(profile)
        profile["adapters"] = [pb.WeightedAdapter(**a) for a in profile["adapters"]]
        profile["messages"] = [pb.ChatMessage(**m) for m in profile["messages"]]
        fields["profile"] = pb.Profile(**profile)
    return pb.Adapter(**fields)


def _sampling_from(params: pb.SamplingParams) -> Sampling:
    """Proto sampling params over the defaults; unset optional fields keep the default."""
    sampling = Sampling(default_max_tokens=DEFAULT_MAX_TOKENS)  # run/chat: 512 unless the context ends first
    for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed", "min_p", "presence_penalty",
                 "frequency_penalty", "repetition_penalty", "logprobs"):
        if params.HasField(name):
            setattr(sampling, name, getattr(params, name))
    sampling.stop = list(params.stop)
    sampling.logit_bias = dict(params.logit_bias)
    sampling.stop_token_ids = list(params.stop_token_ids)
    sampling.ignore_eos = params.ignore_eos
    if params.HasField("structured"):
        given = params.structured
        sampling.structured = Structured(
            json_schema=given.json_schema if given.HasField("json_schema") else None, json_object=given.json_object,
            regex=given.regex if given.HasField("regex") else None, choice=list(given.choice) or None,
            grammar=given.grammar if given.HasField("grammar") else None)
    return sampling


def _given(params: pb.SamplingParams) -> frozenset[str]:
    """The sampling fields a request set itself (a profile's defaults fill the others)."""
    given = {f.name for f, _ in params.ListFields()}
    return frozenset(given - {"structured"})


def _logprob_messages(logprobs: list[TokenLogprob]) -> list[pb.TokenLogprob]:
    return [pb.TokenLogprob(token_id=t.token_id, logprob=t.logprob, text=t.text,
                            top=[pb.Logprob(token_id=i, logprob=p, text=text) for i, p, text in t.top])
            for t in logprobs]
