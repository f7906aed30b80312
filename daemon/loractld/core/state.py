"""The core's state and its waiting: the catalog, the engine, the tiers, the events and metrics, the
work in flight, and how an operation waits for the part it needs (:class:`CoreState`, the base of
:class:`loractld.core.core.Core`).

Invariants:
- While draining (shutdown), new work is refused with ``EngineUnavailable``; work still running
  when the grace period ends is cancelled and ends with ``Cancelled``, never left hanging.
- A dead engine is an answer of its own (``EngineUnavailable``), never an internal error.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from loractl.errors import EngineUnavailable, LoractlError
from loractld.events import Event, EventBus, Metrics
from loractld.serving.admitted import Admission
from loractld.serving.finishing import Finishing
from loractld.serving.inflight import InFlight
from loractld.startup import StartupProgress
from loractld.store.preflight import Preflight
from loractld.store.profiles import Profiles

if TYPE_CHECKING:
    from loractld.engine.client import Engine
    from loractld.engine.openai_serving import OpenAISurface
    from loractld.models.basemodel import BaseModel
    from loractld.models.naming import ModelName
    from loractld.serving.admission import Gate
    from loractld.serving.keep_alive import KeepAlive
    from loractld.serving.policies import PolicyContext
    from loractld.serving.tiers import Tiers
    from loractld.store.blobs import Blobs
    from loractld.store.disk import Store
    from loractld.store.identity import AdapterResolver
    from loractld.store.pulls import Puller


@dataclass
class Catalog:
    """The disk side, available once the base model is known (before the engine is up)."""

    store: Store
    resolver: AdapterResolver
    puller: Puller
    base_model: BaseModel
    preflight: Preflight = field(default_factory=Preflight)
    profiles: Profiles = None   # type: ignore[assignment]  # the store's (set from it)
    # The engine's rank limit: --max-lora-rank, or chosen from the store at start (store/rank_limit.py).
    max_lora_rank: int = 16

    def __post_init__(self) -> None:
        if self.profiles is None:
            self.profiles = Profiles(self.store.root)
        # One name space: a pull (or a merge, a copy) of a profile's name is refused, by name.
        if self.puller is not None:
            self.puller.other_holder = lambda name: \
                f"profile {name!r}" if self.profiles.get(name) is not None else None


class CoreState:
    """What the daemon holds (set by ``loractld.lifecycle``) and how its operations wait for it;
    the operations themselves are :class:`~loractld.core.core.Core`'s other bases."""

    def __init__(self, *, socket_path: str, home: str, served_model_name: str = "") -> None:
        self.socket_path = socket_path
        self.home = home
        self.served_model_name = served_model_name
        self.auto_pull = False      # --auto-pull: see loractld.core.ondemand
        self.socket_gid: int | None = None  # --socket-group: its members may change state (core.policy)
        self.http_url = ""          # set by the HTTP front end once it listens
        self.catalog: Catalog | None = None
        self.catalog_ready = asyncio.Event()
        self.engine: Engine | None = None
        self.tiers: Tiers | None = None
        self.gate: Gate | None = None
        self.policy_context: PolicyContext | None = None   # what ``auto`` reads (lifecycle sets it)
        self.engine_ready = asyncio.Event()
        self.events = EventBus()
        self.metrics = Metrics()
        self.startup_error: LoractlError | None = None
        self.startup = StartupProgress()   # the start-up stage, for status; lifecycle reports to it
        self.model_name: ModelName | None = None  # the base model as users know it, once resolved
        self.started = time.monotonic()
        self.started_wall = time.time()
        self.work = InFlight()      # generations, pulls and merges running: drained at shutdown
        self.admission: Admission | None = None   # every engine request's way in (set_engine)
        self.engine_died = False
        self._after_installs = Finishing("a pull's announcement")   # Core._installed's work, whoever waits
        self._openai: tuple[Engine, OpenAISurface] | None = None  # the HTTP door's serving classes, per engine
        self._blobs: Blobs | None = None           # Ollama's uploads, opened at the first (ProfileOps.blob_store)
        self.started_up = False   # set_started: the engine, its surface and the listing are up
        self._unchecked: list[str] = []             # names start-up's listing left to check after READY
        self._foreground = 0                        # listings running now (DiskOps.in_foreground)
        self._warming: asyncio.Task | None = None   # a listing's background validation (DiskOps.warm_in_background)
        self._manifest_views: dict = {}            # id(StoredAdapter) -> (it, its view): DiskOps.list_adapters
        self._blobs_opening = asyncio.Lock()
        self._keep_alive: KeepAlive | None = None   # --keep-alive: the engine's sleep (loractld.serving.keep_alive)

    # -- lifecycle, driven by loractld.lifecycle ------------------------------------------
    def set_catalog(self, catalog: Catalog) -> None:
        self.catalog = catalog
        self.catalog_ready.set()

    def set_engine(self, engine: Engine, tiers: Tiers) -> None:
        self.engine = engine
        self.tiers = tiers
        self.gate = tiers.gate
        self.admission = Admission(tiers.gate, tiers, self.metrics, self.events, self.work)
        self.admission.keep_alive = self._keep_alive
        self.engine_ready.set()

    @property
    def keep_alive(self) -> KeepAlive | None:
        return self._keep_alive

    @keep_alive.setter
    def keep_alive(self, keeper: KeepAlive | None) -> None:
        """--keep-alive's, once started: the core's waits and every engine request hold it."""
        self._keep_alive = keeper
        if self.admission is not None:
            self.admission.keep_alive = keeper

    @property
    def draining(self) -> bool:
        """Shutting down: new work is refused (see :class:`~loractld.serving.inflight.InFlight`)."""
        return self.work.draining

    def set_started(self) -> None:
        """Start-up is over (READY=1): :attr:`ready` from now on, while the engine serves."""
        self.started_up = True

    def set_failed(self, error: LoractlError) -> None:
        self.startup_error = error
        self.catalog_ready.set()
        self.engine_ready.set()

    @property
    def ready(self) -> bool:
        engine = self.engine
        return self.started_up and engine is not None and not self.draining and not engine.errored and \
            not self.engine_died

    @property
    def requests_in_flight(self) -> int:
        """Generations and pulls running now."""
        return len(self.work)

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new work, wait up to ``grace_seconds``, cancel the rest; return how many."""
        return await self.work.drain(grace_seconds)

    async def _ready(self, event: asyncio.Event) -> None:
        if self.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        await event.wait()
        if self.startup_error is not None:
            raise self.startup_error

    async def _wait_engine(self, *, wake: bool = True) -> tuple[Engine, Tiers]:
        """The engine and its tiers once the engine is up, and awake: a sleeping engine
        (``--keep-alive``) is woken first, and this waits for it (``wake`` False: not woken)."""
        await self._ready(self.engine_ready)
        assert self.engine is not None and self.tiers is not None
        if self.keep_alive is not None and wake:
            await self.keep_alive.awake()
        self._refuse_if_engine_dead(self.engine)
        return self.engine, self.tiers

    def _refuse_if_engine_dead(self, engine: Engine) -> None:
        """A dead engine is an answer of its own (clients stop waiting), not an internal error."""
        if self.engine_died or engine.errored:
            raise engine_died()

    def _engine_stopped_asleep(self) -> bool:
        """The engine sleeps as a full stop (``--keep-alive`` on the CPU): it holds nothing."""
        engine = self.engine
        return self.keep_alive is not None and engine is not None and engine.stopped_asleep

    def engine_hold(self):
        """``async with``: the body uses the engine, which is awake for it and does not fall asleep
        (``--keep-alive``) before it ends."""
        return self._keep_alive.hold() if self._keep_alive is not None else contextlib.nullcontext()

    async def _wait_catalog(self) -> Catalog:
        await self._ready(self.catalog_ready)
        assert self.catalog is not None
        return self.catalog

    def _tracked(self, cancel_message: str):
        """``with``: the body is in-flight work of the current task (:meth:`InFlight.tracked`)."""
        return self.work.tracked(cancel_message)

    @property
    def model_label(self) -> str:
        """The base model's name in status, the registry and the metrics' ``model_name`` label."""
        if self.model_name is not None:
            return self.model_name.name
        return self.served_model_name or (self.engine.settings.model if self.engine else "")

    # -- watching -------------------------------------------------------------------------
    async def watch_events(self, history: int = 0) -> AsyncIterator[Event]:
        """Lifecycle events as they happen (after the last ``history`` ones), until the daemon drains."""
        queue = self.events.subscribe(history)
        try:
            while not self.draining:
                yield await queue.get()
        finally:
            self.events.unsubscribe(queue)


def engine_died() -> EngineUnavailable:
    return EngineUnavailable("the engine died; the daemon is restarting",
                             "Retry in a moment; if it persists, see the daemon's log.")
