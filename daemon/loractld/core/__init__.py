"""The daemon's operations, knowing nothing of gRPC or HTTP.

Both front ends — the gRPC servicer on the Unix socket (``loractld.api.grpc_service``) and the
OpenAI-compatible HTTP app (``loractld.api.http``) — are thin translations over :class:`Core`:
generate, pull, list, show, load, evict, pin, unpin, remove, events, metrics and status are
written here once, and fail only with domain errors (``loractl.errors``), which each door maps
to its own status codes and error schema.

Invariants:
- Nothing on the request path reads the engine's tier state: a generation resolves its adapter
  from the resolver's in-memory index and only marks the tiers busy (``Tiers.note_activity``);
  the tier follower does the reading, off the path.
- Every generation passes the admission gate (``loractld.serving.admission``) before the engine sees
  it, and leaves it when it ends however it ends: the engine never holds requests for more
  distinct adapters than the device slots the pins leave free.
- While draining (shutdown), new work is refused with ``EngineUnavailable``; work still running
  when the grace period ends is cancelled and ends with ``Cancelled``, never left hanging.
- An adapter's content reaches the engine in a request or a load only once the engine's own
  loader accepted it (``store.preflight``: once per content; a set lookup after that).
- An adapter folder a request may still need (vLLM reloads from disk after an eviction) is
  never deleted: a request takes a lease on its folder where it resolves its adapter
  (:meth:`Core.prepare`), held until the request ends however it ends; the store owns the
  leases and its GC (``loractld.store.leases``), and deletes a replaced or removed revision's
  folder once no name and no lease holds it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import difflib
import logging
import os
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loractl import __version__
from loractl.errors import AdapterNotFound, Cancelled, EngineUnavailable, InvalidRequest, LoractlError
from loractld import testhooks
from loractld.serving.admission import WAIT_BUCKETS, Gate, Ticket, TicketLabel
from loractld.serving.finishing import Finishing
from loractld.serving.signals import scheduler_series
# The front ends take these from here.
from loractld.engine.sampling import DEFAULT_MAX_TOKENS, Delta, Sampling, Structured, TokenLogprob
from loractld.events import Event, EventBus, Metrics
from loractld.store.preflight import Preflight
from loractld.store import ondemand
from loractld.models.naming import relabel_model
from loractld.startup import StartupProgress
from loractld.generation import GenerationRequest, Prepared, UnknownModel, fitted  # noqa: F401 - the doors take them from here
from loractld.core import policy
from loractld.core.disk_ops import DiskOps
from loractld.views import (AdapterQueueView, AdapterView, AdmissionView, CapacityView, EngineConfigView, RequestView,
                            StartupView, StatusView)

if TYPE_CHECKING:
    from loractld.store.identity import AdapterRef, AdapterResolver
    from loractld.store.leases import Lease
    from loractld.models.basemodel import BaseModel
    from loractld.models.naming import ModelName
    from loractld.engine.client import Engine
    from loractld.engine.openai_serving import OpenAISurface
    from loractld.store.pulls import Puller
    from loractld.store.disk import Store, StoredAdapter
    from loractld.serving.residency import EngineState
    from loractld.serving.tiers import Tiers

_log = logging.getLogger("loractld.core")
ROLES = ("system", "user", "assistant")


@dataclass
class Catalog:
    """The disk side, available once the base model is known (before the engine is up)."""

    store: Store
    resolver: AdapterResolver
    puller: Puller
    base_model: BaseModel
    preflight: Preflight = field(default_factory=Preflight)


class Core(DiskOps):
    """The daemon's state (catalog, engine, tiers, events, metrics, work in flight) and its
    operations (the disk tier's in :class:`~loractld.core.disk_ops.DiskOps`); the front ends hold no
    state of their own beyond their connections."""

    def __init__(self, *, socket_path: str, home: str, served_model_name: str = "") -> None:
        self.socket_path = socket_path
        self.home = home
        self.served_model_name = served_model_name
        self.auto_pull = False      # --auto-pull: see loractld.store.ondemand
        self.socket_gid: int | None = None  # --socket-group: its members may change state (core.policy)
        self.http_url = ""          # set by the HTTP front end once it listens
        self.catalog: Catalog | None = None
        self.catalog_ready = asyncio.Event()
        self.engine: Engine | None = None
        self.tiers: Tiers | None = None
        self.gate: Gate | None = None
        self.engine_ready = asyncio.Event()
        self.events = EventBus()
        self.metrics = Metrics()
        self.startup_error: LoractlError | None = None
        self.startup = StartupProgress()   # the start-up stage, for status; lifecycle reports to it
        self.model_name: ModelName | None = None  # the base model as users know it, once resolved
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.draining = False
        self.engine_died = False
        self._inflight: set[asyncio.Task] = set()
        self._serving: collections.Counter[str] = collections.Counter()  # store name -> running requests
        self._after_installs = Finishing("a pull's announcement")   # Core._installed's work, whoever waits
        self._openai: tuple[Engine, OpenAISurface] | None = None  # the HTTP door's serving classes, per engine

    # -- lifecycle, driven by loractld.lifecycle ------------------------------------------
    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.catalog_ready.set()

    def set_engine(self, engine: Engine, tiers: Tiers) -> None:
        self.engine = engine
        self.tiers = tiers
        self.gate = tiers.gate
        self.engine_ready.set()

    def admitted(self, ticket: Ticket) -> None:
        """The gate let ``ticket`` into the engine: observe its wait; tell who waited."""
        if ticket.key is None:
            return
        self.metrics.observe("loractl_admission_wait_seconds", (("adapter", ticket.label),), ticket.wait_s,
                             buckets=WAIT_BUCKETS)
        if ticket.waited:
            self.events.publish(Event("WAITED_FOR_SLOT", ticket.label, reason="admission",
                                      message=f"request {ticket.id} waited {ticket.wait_s:.3f} s for a device slot"))

    def set_failed(self, error: LoractlError) -> None:
        self.startup_error = error
        self.catalog_ready.set()
        self.engine_ready.set()

    @property
    def ready(self) -> bool:
        engine = self.engine
        return engine is not None and not self.draining and not engine.errored and not self.engine_died

    @property
    def requests_in_flight(self) -> int:
        """Generations and pulls running now."""
        return len(self._inflight)

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

    async def _ready(self, event: asyncio.Event) -> None:
        if self.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        await event.wait()
        if self.startup_error is not None:
            raise self.startup_error

    async def _wait_engine(self) -> tuple[Engine, Tiers]:
        await self._ready(self.engine_ready)
        assert self.engine is not None and self.tiers is not None
        self._refuse_if_engine_dead(self.engine)
        return self.engine, self.tiers

    def _refuse_if_engine_dead(self, engine: Engine) -> None:
        """A dead engine is an answer of its own (clients stop waiting), not an internal error."""
        if self.engine_died or engine.errored:
            raise _engine_died()

    async def _wait_catalog(self) -> Catalog:
        await self._ready(self.catalog_ready)
        assert self.catalog is not None
        return self.catalog

    @contextlib.contextmanager
    def _tracked(self, cancel_message: str):
        """Run the body as in-flight work of the current task: drained on shutdown, and a
        cancellation by the drain surfaces as ``Cancelled`` (a client going away stays a
        plain cancellation)."""
        task = asyncio.current_task()
        assert task is not None
        self._inflight.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self.draining:
                raise
            raise Cancelled(cancel_message, "Start the daemon again and rerun the command.") from None
        finally:
            self._inflight.discard(task)

    # -- status ---------------------------------------------------------------------------
    async def status(self) -> StatusView:
        engine, tiers, catalog = self.engine, self.tiers, self.catalog
        config, capacity = EngineConfigView(), CapacityView()
        if engine is not None:
            s = engine.settings
            config = EngineConfigView(model=s.model, device=engine.device, dtype=engine.dtype, max_loras=s.max_loras,
                                      max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank,
                                      max_model_len=engine.max_model_len, vllm_version=engine.vllm_version,
                                      kv_cache_bytes=engine.kv_cache_bytes or 0, max_num_seqs=engine.max_num_seqs,
                                      model_name=self.model_label, model_arg=self.model_name.asked
                                      if self.model_name else "")
        if engine is not None and tiers is not None and catalog is not None:
            self._refuse_if_engine_dead(engine)
            try:
                state = await tiers.sync()
            except Exception as e:
                # vLLM's EngineDeadError (not imported here) can come before its monitor flags
                # the engine as errored.
                if type(e).__name__ == "EngineDeadError" or engine.errored:
                    raise _engine_died() from e
                raise
            stored = await asyncio.to_thread(catalog.store.list)
            capacity = CapacityView(
                device_slots=state.device_capacity, device_used=len(state.device), host_slots=state.host_capacity,
                host_used=len(state.host), pins=len(tiers.state.pins), max_pins=tiers.max_pins,
                device_pins=len(tiers.state.device_pins), max_device_pins=tiers.max_device_pins,
                max_lora_rank=engine.settings.max_lora_rank, disk_adapters=len(stored),
                disk_bytes=sum(a.size_bytes for a in stored))
        return StatusView(version=__version__, pid=os.getpid(), socket=self.socket_path, home=self.home,
                          ready=self.ready, uptime_s=time.monotonic() - self.started,
                          engine_start_s=engine.start_seconds if engine else 0.0, engine=config,
                          requests_in_flight=self.requests_in_flight, capacity=capacity, http=self.http_url,
                          admission=self._admission_view(),
                          startup=self.startup.view() if engine is None and self.startup_error is None else StartupView())

    def _admission_view(self) -> AdmissionView:
        gate = self.gate
        if gate is None:
            return AdmissionView()
        now = gate.clock()
        requests = [RequestView(id=t.id, adapter=t.label, state="running" if t.admitted is not None else "queued",
                                position=gate.position(t), waited_s=t.wait_s if t.admitted is not None else now - t.arrived,
                                age_s=now - t.arrived) for t in gate.tickets.values()]
        measured = gate.measured
        return AdmissionView(policy=gate.policy.name, places=gate.places, pinned=len(gate.pinned),
                             active=len(gate.unpinned_active()), queued=len(gate.queue),
                             max_wait_s=float(gate.policy.bound()) if hasattr(gate.policy, "bound") else 0.0, requests=requests,
                             adapters=[AdapterQueueView(q.label, q.running, q.queued, q.oldest_wait_s)
                                       for q in gate.adapter_queues()],
                             handover_s=measured.handover_s or 0.0, service_s=measured.service_s or 0.0)

    @property
    def model_label(self) -> str:
        """The base model's name in status, the registry and the metrics' ``model_name`` label."""
        if self.model_name is not None:
            return self.model_name.name
        return self.served_model_name or (self.engine.settings.model if self.engine else "")

    # -- generation -----------------------------------------------------------------------
    def base_model_names(self) -> set[str]:
        """Every name that means the base model: the served name, --model, its folder and ids."""
        names = {self.served_model_name} if self.served_model_name else set()
        if self.catalog is not None:
            names |= self.catalog.base_model.names | {self.catalog.base_model.model}
        return names

    async def openai_surface(self) -> OpenAISurface:
        """vLLM's OpenAI serving classes over this daemon's engine (built once per engine): the
        HTTP door's generation routes. Their engine requests pass :meth:`engine_request`."""
        engine, _ = await self._wait_engine()
        if self._openai is None or self._openai[0] is not engine:
            from loractld.engine.openai_serving import OpenAISurface

            surface = OpenAISurface(engine, engine.settings.openai, self.engine_request, self._generated,
                                    [self.served_model_name or self.model_label])
            self._openai = (engine, surface)
        return self._openai[1]

    @staticmethod
    def answer_first_token_ns() -> int | None:
        """When the HTTP request this task serves had its first generated token
        (``time.perf_counter_ns()``), or None before it (or outside one)."""
        from loractld.engine.openai_serving import CURRENT

        scope = CURRENT.get()
        return scope.first_token_ns if scope is not None else None

    def _generated(self, label: tuple, tokens: int) -> None:
        self.metrics.inc("loractl_adapter_generated_tokens_total", label, tokens)
        ticket = getattr(label, "ticket", None)   # a TicketLabel: the gate measures the first token
        if tokens and ticket is not None and self.gate is not None:
            self.gate.first_token(ticket)   # once: it ignores a ticket that had its first token

    async def sampling_defaults(self) -> dict:
        """The model's own defaults for sampling parameters a request leaves out."""
        engine, _ = await self._wait_engine()
        return engine.generation_defaults()

    async def resolve_model(self, lora: str, caller: policy.Caller | None, allow_folders: bool = False, *,
                            ondemand_request: GenerationRequest | None = None
                            ) -> tuple[AdapterRef | None, str | None, Lease | None]:
        """The adapter ``lora`` names ("" is the base model) as (adapter, store name, lease):
        pulled first when missing and allowed (``--auto-pull``), a folder only for a caller the
        policy lets name one, and accepted by the engine's own loader (the preflight). The lease
        holds the adapter's folder until released: the caller releases it when its request ends."""
        catalog = await self._wait_catalog()
        request = ondemand_request or GenerationRequest(prompt=" ", lora=lora, allow_folders=allow_folders,
                                                        caller=caller)
        lora = await ondemand.adapter_name(self, request)  # a missing Hub reference pulled first, when allowed
        if not lora:
            return None, None, None
        # A folder is read with the daemon's rights and takes an engine slot: a state change.
        folder_use = policy.authorized(caller, self.socket_gid, "generate-folder", lora,
                                       refusal="generate from an adapter folder on this daemon",
                                       hint="Name a stored adapter (loractl ls), or ask its owner to pull the folder.") \
            if os.path.isabs(lora) and allow_folders else contextlib.nullcontext()
        async with folder_use:
            adapter = await self._resolve_adapter(catalog, lora, allow_folders)
        name = lora if not os.path.isabs(lora) else None
        # Taken with no await since the resolve: from here on no rm or pull deletes the folder.
        lease = catalog.store.lease(adapter.path)
        try:
            await testhooks.pause("resolved")
            # The engine's own loader has the last word, once per content.
            await catalog.preflight.check(adapter.path, adapter.digest, adapter.label, adapter.engine_id)
            await testhooks.pause("preflighted")
        except BaseException:
            lease.release()
            raise
        return adapter, name, lease

    async def prepare(self, request: GenerationRequest) -> Prepared:
        """Everything that can refuse a request before the engine sees it: the adapter, the
        messages, the prompt's tokens against the context, the sampling parameters."""
        engine, _ = await self._wait_engine()
        given = [request.prompt != "", request.prompt_token_ids is not None, request.messages is not None]
        if sum(given) != 1:
            raise InvalidRequest("send exactly one of prompt, prompt token ids or messages")
        adapter, name, lease = await self.resolve_model(request.lora, request.caller, request.allow_folders,
                                                        ondemand_request=request)
        try:
            if request.messages is not None:
                if not request.messages:
                    raise InvalidRequest("no messages", "Send at least one message.")
                for m in request.messages:
                    if m["role"] not in ROLES:
                        raise InvalidRequest(f"unknown chat role {m['role']!r}", f"Use one of: {', '.join(ROLES)}.")
                prompt_ids = await engine.render_chat(request.messages)
            elif request.prompt_token_ids is not None:
                prompt_ids = list(request.prompt_token_ids)
            else:
                prompt_ids = await engine.encode(request.prompt)
            sampling = fitted(request.sampling, len(prompt_ids), engine)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return Prepared(engine, adapter, name, prompt_ids, sampling, lease)

    async def run(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """Stream a prepared request. Closing or cancelling the iteration aborts it in the engine."""
        adapter, name = prepared.adapter, prepared.name
        # This run's own lease: the prepared one is shared by every copy of ``prepared``.
        lease = prepared.lease.share() if prepared.lease is not None else None
        try:
            async with self.engine_request(adapter, name) as label:
                async with contextlib.aclosing(prepared.engine.generate(
                        prepared.prompt_ids, prepared.sampling, adapter)) as deltas:
                    async for delta in deltas:
                        self._generated(label, len(delta.token_ids))
                        yield delta
        finally:
            if lease is not None:
                # Both: the prepared lease too, now rather than when the last copy of ``prepared``
                # is dropped (an exception's traceback can hold it for long). A copy that runs
                # later takes its own (``share``), or hears that the adapter went.
                lease.release()
                prepared.lease.release()

    @contextlib.asynccontextmanager
    async def engine_request(self, adapter: AdapterRef | None, name: str | None):
        """The body runs as one engine request for ``adapter`` (None: the base model): drained on
        shutdown, counted as serving ``name``, and behind the admission gate, which it leaves
        however it ends. Yields the metrics label of the adapter (``loractl top``'s tokens/s).
        The caller holds the adapter's lease for at least as long."""
        tiers = self.tiers
        assert tiers is not None and self.catalog is not None
        if self.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        tiers.note_request(name or (adapter.label if adapter else ""))
        if name:
            self._serving[name] += 1
        if adapter:
            tiers.note_activity()  # the tier follower reports the lazy load, if any, soon
        gate, ticket = self.gate, None
        assert gate is not None
        try:
            with self._tracked("the daemon is shutting down; the generation was stopped"):
                ticket = await gate.enter(adapter.engine_id if adapter else None,
                                          name or (adapter.label if adapter else ""))
                label = TicketLabel((("adapter", ticket.label),))
                label.ticket = ticket
                yield label
        finally:
            if ticket is not None:
                gate.finish(ticket)
            if name:
                self._serving[name] -= 1
            if adapter:
                tiers.note_activity()

    async def _resolve_adapter(self, catalog: Catalog, lora: str, allow_folders: bool) -> AdapterRef:
        """The adapter ``lora`` names; new content is hashed and validated off the event loop."""
        if os.path.isabs(lora) and not allow_folders:
            raise UnknownModel(lora, [])  # a network client never names the daemon's folders
        try:
            return await catalog.resolver.resolve_async(lora)
        except (AdapterNotFound, InvalidRequest) as e:
            if os.path.isabs(lora) or (isinstance(e, InvalidRequest) and allow_folders):
                raise  # a missing folder, or a malformed name typed at the CLI: its own message
            raise UnknownModel(lora, await asyncio.to_thread(self.close_matches, lora)) from e

    def close_matches(self, name: str) -> list[str]:
        """Names the user may have meant; reads the store, so only on the error path."""
        stored = {a.name for a in self.catalog.store.list()} if self.catalog is not None else set()
        known = sorted(stored | ({self.served_model_name} if self.served_model_name else set()))
        by_lower = {k.lower(): k for k in known}
        matches = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=0.6)
        return [by_lower[m] for m in matches]

    # -- the engine tiers -----------------------------------------------------------------
    async def load(self, name: str, to: str = "device") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.load(name, to or "device"))

    async def evict(self, name: str, source: str = "device") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.evict(name, source or "device"))

    async def pin(self, name: str, to: str = "host") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.pin(name, to or "host"))

    async def unpin(self, name: str) -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.unpin(name))

    async def _tier_op(self, name: str, op) -> AdapterView:
        _, tiers = await self._wait_engine()
        await self.vet(name)
        await op(tiers)
        catalog = await self._wait_catalog()
        adapter = await asyncio.to_thread(catalog.store.get, name)
        return self._described(catalog, adapter, tiers.last_state)

    async def vet(self, name: str) -> None:
        """Raise unless ``name`` resolves (an unknown name: with close matches) and the engine's
        loader accepts its content (``store.preflight``): before any tier operation, and for
        start-up's pins and preloads, which may name files changed while the daemon was down."""
        catalog = await self._wait_catalog()
        ref = await self._resolve_adapter(catalog, name, allow_folders=True)
        await catalog.preflight.check(ref.path, ref.digest, ref.label, ref.engine_id)

    # -- watching -------------------------------------------------------------------------
    async def watch_events(self, history: int = 0) -> AsyncIterator[Event]:
        """Lifecycle events as they happen (after the last ``history`` ones), until the daemon drains."""
        queue = self.events.subscribe(history)
        try:
            while not self.draining:
                yield await queue.get()
        finally:
            self.events.unsubscribe(queue)

    async def metrics_text(self) -> str:
        """Prometheus text: the tiers' counters and gauges, the disk tier, then vLLM's own."""
        if self.engine is not None:
            # Read before the tier sync below, which can wait for engine steps.
            self.metrics.set("loractl_engine_requests", (), self.engine.unfinished_requests())
        if self.gate is not None:
            depth = self.gate.queued_by_adapter()
            for labels in list(self.metrics.gauges.get("loractl_admission_queue_depth", {})):
                self.metrics.set("loractl_admission_queue_depth", labels, 0)  # drained since the last read
            for label, queued in depth.items():
                self.metrics.set("loractl_admission_queue_depth", (("adapter", label),), queued)
            for labels in list(self.metrics.gauges.get("loractl_admission_oldest_wait_seconds", {})):
                self.metrics.set("loractl_admission_oldest_wait_seconds", labels, 0)  # none waits now
            for q in self.gate.adapter_queues():
                if q.queued:
                    self.metrics.set("loractl_admission_oldest_wait_seconds", (("adapter", q.label),), q.oldest_wait_s)
            measured = self.gate.measured
            for what, value in (("handover", measured.handover_s), ("service", measured.service_s)):
                if value is not None:
                    self.metrics.set("loractl_admission_measured_seconds", (("what", what),), value)
        if self.tiers is not None:
            await self.tiers.sync()
        if self.catalog is not None:
            stored = await asyncio.to_thread(self.catalog.store.list)
            self.metrics.set("loractl_tier_bytes", (("tier", "disk"),), sum(a.size_bytes for a in stored))
            self.metrics.set("loractl_tier_adapters", (("tier", "disk"),), len(stored))
        if self.engine is None:
            return self.metrics.render()
        # What routers score this daemon by, counted at the gate and named as clients name them.
        return self.metrics.render() + scheduler_series(
            self.gate, self.engine.settings.max_loras,
            relabel_model(self.engine.prometheus_text(), self.engine.settings.model, self.model_label),
            self.model_label)

    # -- helpers --------------------------------------------------------------------------
    def _described(self, catalog: Catalog, adapter: StoredAdapter, state: EngineState | None) -> AdapterView:
        view = AdapterView.of(adapter)
        try:
            ref = catalog.resolver.resolve(adapter.name)
        except LoractlError as e:
            view.state, view.error = "failed", f"{e.message} ({e.hint})"
            return view
        refused = catalog.preflight.refusal(ref.digest, ref.engine_id, ref.label)
        if refused is not None:
            view.state, view.error = "failed", f"{refused.message} ({refused.hint})"
        if state is not None:
            residency = state.residency(ref.engine_id)
            view.tier, view.pinned, view.slot, view.pin = residency.tier, residency.pinned, residency.slot, residency.pin
            view.host_bytes = residency.host_bytes
        if self.tiers is not None:
            usage = self.tiers.usage.get(adapter.name)
            if usage is not None:
                view.requests, view.last_used = usage.requests, usage.last_used
                if usage.state != "ready":
                    view.state, view.error = usage.state, usage.error
        return view


def _engine_died() -> EngineUnavailable:
    return EngineUnavailable("the engine died; the daemon is restarting",
                             "Retry in a moment; if it persists, see the daemon's log.")
