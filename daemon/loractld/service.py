"""The gRPC servicer: thin. It maps RPCs to the store, the puller and the engine, and domain
errors to status codes.

Invariants:
- Every domain error leaves as a gRPC status whose message carries kind, message and hint
  (``loractl.errors.to_wire``); anything else is logged with its traceback and leaves as
  INTERNAL with a one-line message, never as a bare traceback.
- While draining (shutdown), new work is refused; generations still running when the grace
  period ends are cancelled with a CANCELLED status, never left hanging.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import logging
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from grpclib.exceptions import GRPCError

from loractl import __version__
from loractl.errors import Cancelled, EngineUnavailable, InvalidRequest, LoractlError, PermissionDenied, to_wire
from loractld.events import Event, EventBus, Metrics
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlBase

if TYPE_CHECKING:
    from loractld.adapters import AdapterRef, AdapterResolver
    from loractld.basemodel import BaseModel
    from loractld.engine import Engine
    from loractld.pulls import Puller
    from loractld.store import Store, StoredAdapter
    from loractld.tiers import Tiers

_log = logging.getLogger("loractld.service")
ROLES = ("system", "user", "assistant")


_audit = logging.getLogger("loractld.audit")


def peer_credentials(stream) -> tuple[int, int, int]:
    """(pid, uid, gid) of the process at the other end of the Unix socket (SO_PEERCRED).

    grpclib exposes the transport only privately; the socket itself is what the kernel vouches for.
    """
    import socket as socket_module
    import struct

    sock = stream.peer._transport.get_extra_info("socket")
    raw = sock.getsockopt(socket_module.SOL_SOCKET, socket_module.SO_PEERCRED, struct.calcsize("3i"))
    return struct.unpack("3i", raw)


def mutating(operation: str):
    """Only root, the daemon's own user or its socket group may change state; audit each call."""

    def decorate(handler):
        @functools.wraps(handler)
        async def wrapper(self, stream):
            pid, uid, gid = peer_credentials(stream)
            allowed = uid in (0, os.getuid()) or (self.socket_gid is not None and self._in_group(uid, gid))
            outcome = "denied" if not allowed else "error"  # anything but a clean return is an error
            try:
                if not allowed:
                    request = await stream.recv_message()  # only to name the target in the audit line
                    stream._loractl_target = getattr(request, "name", "") or getattr(request, "ref", "") or "-"
                    raise PermissionDenied(f"uid {uid} may not {operation} on this daemon")
                await handler(self, stream)
                outcome = "ok"
            except LoractlError as e:
                outcome = outcome if outcome == "denied" else f"error: {e.kind}"
                raise
            finally:
                _audit.info("audit uid=%d pid=%d op=%s target=%s result=%s", uid, pid, operation,
                            getattr(stream, "_loractl_target", "-"), outcome)
        return wrapper

    return decorate


def domain_errors(handler):
    """Turn domain errors raised by a handler into gRPC statuses the client can rebuild."""

    @functools.wraps(handler)
    async def wrapper(self, stream):
        try:
            await handler(self, stream)
        except LoractlError as e:
            raise GRPCError(e.grpc_status, to_wire(e)) from e
        except (GRPCError, asyncio.CancelledError):
            raise
        except Exception as e:
            _log.exception("unexpected error in %s", handler.__name__)
            error = LoractlError(f"internal error in {handler.__name__}: {type(e).__name__}: {e}")
            raise GRPCError(error.grpc_status, to_wire(error)) from e

    return wrapper


@dataclass
class Catalog:
    """The disk side, available once the base model is known (before the engine is up)."""

    store: Store
    resolver: AdapterResolver
    puller: Puller
    base_model: BaseModel


class LoractlService(LoractlBase):
    def __init__(self, *, socket_path: str, home: str, socket_gid: int | None = None) -> None:
        self.socket_path = socket_path
        self.socket_gid = socket_gid
        self.home = home
        self.catalog: Catalog | None = None
        self.catalog_ready = asyncio.Event()
        self.engine: Engine | None = None
        self.tiers: Tiers | None = None
        self.engine_ready = asyncio.Event()
        self.events = EventBus()
        self.metrics = Metrics()
        self.startup_error: LoractlError | None = None
        self.started = time.monotonic()
        self.draining = False
        self.engine_died = False
        self._inflight: set[asyncio.Task] = set()
        self._serving: collections.Counter[str] = collections.Counter()  # store name -> running requests
        # Adapter folders running requests may still need (vLLM reloads from disk after an
        # eviction): a replaced revision's folder is deleted only once none uses it.
        self._paths_in_use: collections.Counter[str] = collections.Counter()
        self._retired: set[str] = set()  # replaced revisions' folders, deleted once unused

    def _in_group(self, uid: int, gid: int) -> bool:
        import grp
        import pwd

        if gid == self.socket_gid:
            return True
        try:
            return pwd.getpwuid(uid).pw_name in grp.getgrgid(self.socket_gid).gr_mem
        except KeyError:
            return False

    # -- lifecycle, driven by loractld.server ------------------------------------------
    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.catalog_ready.set()

    def set_engine(self, engine: Engine, tiers: Tiers) -> None:
        self.engine = engine
        self.tiers = tiers
        self.engine_ready.set()

    def set_failed(self, error: LoractlError) -> None:
        self.startup_error = error
        self.catalog_ready.set()
        self.engine_ready.set()

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new work, wait up to ``grace_seconds``, cancel the rest; return how many."""
        self.draining = True
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_seconds)
        leftover = [t for t in self._inflight if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.wait(leftover, timeout=5)
        return len(leftover)

    async def _ready(self, event: asyncio.Event):
        if self.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        await event.wait()
        if self.startup_error is not None:
            raise self.startup_error

    async def _wait_engine(self) -> Engine:
        await self._ready(self.engine_ready)
        assert self.engine is not None
        self._refuse_if_engine_dead(self.engine)
        return self.engine

    def _refuse_if_engine_dead(self, engine: Engine) -> None:
        """A dead engine is an answer of its own (clients stop waiting), not an internal error."""
        if self.engine_died or engine.errored:
            raise _engine_died()

    async def _wait_tiers(self) -> Tiers:
        await self._ready(self.engine_ready)
        assert self.tiers is not None
        return self.tiers

    async def _wait_catalog(self) -> Catalog:
        await self._ready(self.catalog_ready)
        assert self.catalog is not None
        return self.catalog

    async def _tracked(self, stream, body, cancel_message: str) -> None:
        """Run ``body`` as in-flight work: drained on shutdown, cancelled with a clear status."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            await body()
        except asyncio.CancelledError:
            if not self.draining:
                raise  # the client went away
            error = Cancelled(cancel_message, "Start the daemon again and rerun the command.")
            await stream.send_trailing_metadata(status=error.grpc_status, status_message=to_wire(error))
        finally:
            self._inflight.discard(task)

    # -- RPCs --------------------------------------------------------------------------
    @domain_errors
    async def Status(self, stream) -> None:
        await stream.recv_message()
        engine = self.engine
        config = pb.EngineConfig()
        if engine is not None:
            s = engine.settings
            config = pb.EngineConfig(
                model=s.model, device=engine.device, dtype=engine.dtype, max_loras=s.max_loras,
                max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank, max_model_len=engine.max_model_len,
                vllm_version=engine.vllm_version,
            )
        capacity = pb.Capacity()
        if engine is not None and self.tiers is not None and self.catalog is not None:
            self._refuse_if_engine_dead(engine)
            try:
                state = await self.tiers.sync()
            except Exception as e:
                # vLLM's EngineDeadError (not imported here) can come before its monitor flags
                # the engine as errored.
                if type(e).__name__ == "EngineDeadError" or engine.errored:
                    raise _engine_died() from e
                raise
            stored = await asyncio.to_thread(self.catalog.store.list)
            capacity = pb.Capacity(
                device_slots=state.device_capacity, device_used=len(state.device), host_slots=state.host_capacity,
                host_used=len(state.host), pins=len(self.tiers.pinned_names()), max_pins=self.tiers.max_pins,
                max_lora_rank=engine.settings.max_lora_rank, disk_adapters=len(stored),
                disk_bytes=sum(a.size_bytes for a in stored),
            )
        await stream.send_message(pb.StatusReply(
            capacity=capacity,
            version=__version__,
            pid=os.getpid(),
            socket=self.socket_path,
            home=self.home,
            ready=engine is not None and not self.draining and not engine.errored and not self.engine_died,
            uptime_s=time.monotonic() - self.started,
            engine_start_s=engine.start_seconds if engine else 0.0,
            engine=config,
            requests_in_flight=len(self._inflight),
        ))

    @domain_errors
    async def Generate(self, stream) -> None:
        request: pb.GenerateRequest = await stream.recv_message()
        engine = await self._wait_engine()
        catalog = await self._wait_catalog()
        tiers = await self._wait_tiers()
        adapter = catalog.resolver.resolve(request.lora) if request.lora else None
        name = request.lora if adapter and not os.path.isabs(request.lora) else None
        tiers.note_request(name or (adapter.label if adapter else ""))
        if name:
            self._serving[name] += 1
        if adapter:
            self._paths_in_use[str(adapter.path)] += 1
            tiers.note_activity()  # the tier follower reports the lazy load, if any, soon
        try:
            await self._tracked(stream, lambda: self._generate(engine, request, adapter, stream),
                                "the daemon is shutting down; the generation was stopped")
        finally:
            if name:
                self._serving[name] -= 1
            if adapter:
                path = str(adapter.path)
                self._paths_in_use[path] -= 1
                if path in self._retired and not self._paths_in_use[path]:
                    await self._collect_garbage(catalog)
                tiers.note_activity()

    async def _generate(self, engine: Engine, request: pb.GenerateRequest, adapter: AdapterRef | None,
                        stream) -> None:
        from loractld.engine import Sampling

        if bool(request.prompt) == bool(request.messages):
            raise InvalidRequest("send exactly one of prompt or messages")
        for m in request.messages:
            if m.role not in ROLES:
                raise InvalidRequest(f"unknown chat role {m.role!r}", f"Use one of: {', '.join(ROLES)}.")
        sampling = _sampling_from(request.sampling, Sampling())
        if request.messages:
            prompt_ids = await engine.render_chat([{"role": m.role, "content": m.content} for m in request.messages])
        else:
            prompt_ids = await engine.encode(request.prompt)
        produced = 0
        async for delta in engine.generate(prompt_ids, sampling, adapter):
            produced += len(delta.token_ids)
            reply = pb.GenerateReply(text=delta.text, token_ids=delta.token_ids)
            if delta.prompt_token_ids is not None:
                reply.prompt_token_ids.extend(delta.prompt_token_ids)
                reply.adapter = adapter.engine_name if adapter else ""
            if delta.finish_reason:
                reply.finish_reason = delta.finish_reason
                reply.usage.prompt_tokens = len(prompt_ids)
                reply.usage.completion_tokens = produced
            await stream.send_message(reply)

    @domain_errors
    @mutating("pull")
    async def Pull(self, stream) -> None:
        request: pb.PullRequest = await stream.recv_message()
        stream._loractl_target = f"{request.ref} as {request.name or '(default name)'}"
        catalog = await self._wait_catalog()
        if not request.ref:
            raise InvalidRequest("nothing to pull", "Give a Hub id (org/repo), hf://org/repo, or a folder.")

        async def body() -> None:
            async for event in catalog.puller.pull(
                request.ref, name=request.name, revision=request.revision, force=request.force,
                token=request.hf_token or None, endpoint=request.hf_endpoint or None,
            ):
                reply = pb.PullProgress(stage=event.stage, file=event.file, done_bytes=event.done,
                                        total_bytes=event.total, message=event.message)
                if event.adapter is not None:
                    reply.adapter.CopyFrom(adapter_message(event.adapter))
                    _log.info("pull %s: %s", event.stage, event.message)
                if event.stage == "done":
                    self.events.publish(Event("DOWNLOADED_TO_DISK", event.adapter.name, message=event.message))
                    await self._replaced(catalog, event.adapter.name, event.previous)
                await stream.send_message(reply)

        await self._tracked(stream, body, "the daemon is shutting down; the pull was stopped (nothing was installed)")

    @domain_errors
    async def List(self, stream) -> None:
        await stream.recv_message()
        catalog = await self._wait_catalog()
        adapters = await asyncio.to_thread(catalog.store.list)
        state = await self.tiers.sync() if self.tiers else None
        await stream.send_message(pb.ListReply(adapters=[self._described(catalog, a, state) for a in adapters]))

    @domain_errors
    async def Show(self, stream) -> None:
        request: pb.ShowRequest = await stream.recv_message()
        catalog = await self._wait_catalog()
        adapter = await asyncio.to_thread(catalog.store.get, request.name)
        state = await self.tiers.sync() if self.tiers else None
        await stream.send_message(self._described(catalog, adapter, state))

    async def _tier_op(self, stream, op) -> None:
        request = await stream.recv_message()
        stream._loractl_target = request.name
        catalog = await self._wait_catalog()
        tiers = await self._wait_tiers()
        await op(tiers, request)
        adapter = await asyncio.to_thread(catalog.store.get, request.name)
        await stream.send_message(self._described(catalog, adapter, tiers._last))

    @domain_errors
    @mutating("load")
    async def Load(self, stream) -> None:
        await self._tier_op(stream, lambda tiers, r: tiers.load(r.name, r.to or "device"))

    @domain_errors
    @mutating("evict")
    async def Evict(self, stream) -> None:
        await self._tier_op(stream, lambda tiers, r: tiers.evict(r.name, getattr(r, "from") or "device"))

    @domain_errors
    @mutating("pin")
    async def Pin(self, stream) -> None:
        await self._tier_op(stream, lambda tiers, r: tiers.pin(r.name))

    @domain_errors
    @mutating("unpin")
    async def Unpin(self, stream) -> None:
        await self._tier_op(stream, lambda tiers, r: tiers.unpin(r.name))

    @domain_errors
    async def Events(self, stream) -> None:
        await stream.recv_message()
        queue = self.events.subscribe()
        try:
            while not self.draining:
                event = await queue.get()
                await stream.send_message(pb.LifecycleEvent(kind=event.kind, adapter=event.adapter,
                                                            reason=event.reason, message=event.message,
                                                            time=event.time))
        finally:
            self.events.unsubscribe(queue)

    @domain_errors
    async def Metrics(self, stream) -> None:
        await stream.recv_message()
        if self.tiers is not None:
            await self.tiers.sync()
        if self.catalog is not None:
            stored = await asyncio.to_thread(self.catalog.store.list)
            self.metrics.set("loractl_tier_bytes", (("tier", "disk"),), sum(a.size_bytes for a in stored))
            self.metrics.set("loractl_tier_adapters", (("tier", "disk"),), len(stored))
        await stream.send_message(pb.MetricsReply(text=self.metrics.render()))

    # -- helpers ------------------------------------------------------------------------
    @staticmethod
    def _resolve_quietly(catalog: Catalog, name: str) -> AdapterRef | None:
        try:
            return catalog.resolver.resolve(name)
        except LoractlError:
            return None

    async def _replaced(self, catalog: Catalog, name: str, previous: StoredAdapter | None) -> None:
        """After a new revision of ``name`` is installed: move its pin over, drop the old
        revision from the engine unless a running request still uses it, delete its folder
        once nothing uses it."""
        from loractld.store import files_digest

        if previous is not None and self.tiers is not None and self.engine is not None:
            old_id = catalog.resolver.id_for(files_digest(previous.manifest["files"]))
            if name in self.tiers.pinned_names():
                await self.engine.unpin_adapter(old_id)
                await self.tiers.pin(name, reason="new revision")
            if not self._paths_in_use[str(previous.path)]:
                await self.engine.remove_adapter(old_id)
        if previous is not None:
            self._retired.add(str(previous.path))
        await self._collect_garbage(catalog)

    async def _collect_garbage(self, catalog: Catalog) -> None:
        keep = {path for path, count in self._paths_in_use.items() if count > 0}
        await asyncio.to_thread(catalog.store.collect_garbage, keep)
        self._retired &= keep

    @domain_errors
    @mutating("rm")
    async def Remove(self, stream) -> None:
        request: pb.RemoveRequest = await stream.recv_message()
        stream._loractl_target = request.name
        catalog = await self._wait_catalog()
        stored = catalog.store.get(request.name)
        del stored
        if self._serving[request.name] > 0:
            raise InvalidRequest(f"{request.name!r} is serving {self._serving[request.name]} request(s)",
                                 "Wait for them to finish, then remove it.")
        tiers = await self._wait_tiers()
        if request.name in tiers.pinned_names() and not request.force:
            raise InvalidRequest(f"{request.name!r} is pinned", f"Unpin it first (loractl unpin {request.name}), "
                                 "or remove it anyway with --force.")
        unloaded = False
        ref = self._resolve_quietly(catalog, request.name)
        if ref is not None:
            unloaded = await tiers.forget(request.name, ref)
        removed = await asyncio.to_thread(catalog.store.remove, request.name)
        self.events.publish(Event("DELETED_FROM_DISK", request.name))
        _log.info("removed %s (%s)", request.name, removed.path)
        await stream.send_message(pb.RemoveReply(adapter=adapter_message(removed), unloaded=unloaded))

    def _described(self, catalog: Catalog, adapter: StoredAdapter, state) -> pb.Adapter:
        message = adapter_message(adapter)
        try:
            ref = catalog.resolver.resolve(adapter.name)
        except LoractlError as e:
            message.state, message.error = "failed", f"{e.message} ({e.hint})"
            return message
        if state is not None:
            residency = state.residency(ref.engine_id)
            message.tier, message.pinned, message.slot = residency.tier, residency.pinned, residency.slot
            message.host_bytes = residency.host_bytes
        if self.tiers is not None:
            usage = self.tiers.usage.get(adapter.name)
            if usage is not None:
                message.requests, message.last_used = usage.requests, usage.last_used
                if usage.state != "ready":
                    message.state, message.error = usage.state, usage.error
        return message


def _engine_died() -> EngineUnavailable:
    return EngineUnavailable("the engine died; the daemon is restarting",
                             "Retry in a moment; if it persists, see the daemon's log.")


def adapter_message(adapter: StoredAdapter) -> pb.Adapter:
    m = adapter.manifest
    targets = m.get("target_modules") or []
    return pb.Adapter(
        name=adapter.name, source=m.get("source", ""), ref=m.get("ref", ""), revision=m.get("revision", ""),
        base_model=m.get("base_model") or "", rank=int(m.get("rank") or 0), alpha=float(m.get("alpha") or 0),
        target_modules=targets if isinstance(targets, list) else [str(targets)],
        size_bytes=adapter.size_bytes, pulled_at=float(m.get("pulled_at") or 0),
        files=[pb.FileRecord(name=f["name"], size=f["size"], sha256=f["sha256"]) for f in m.get("files", [])],
        path=str(adapter.path), hand_placed=adapter.hand_placed, state="ready", tier="disk", slot=-1,
    )


def _sampling_from(params: pb.SamplingParams, defaults):
    """Proto sampling params over defaults; unset optional fields keep the default."""
    for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed"):
        if params.HasField(name):
            setattr(defaults, name, getattr(params, name))
    defaults.stop = list(params.stop)
    if defaults.max_tokens is not None and defaults.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {defaults.max_tokens}")
    if defaults.min_tokens < 0 or defaults.min_tokens > (defaults.max_tokens or defaults.min_tokens):
        raise InvalidRequest(f"min_tokens must be between 0 and max_tokens, got {defaults.min_tokens}")
    if defaults.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {defaults.temperature}")
    if not 0 < defaults.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {defaults.top_p}")
    return defaults
