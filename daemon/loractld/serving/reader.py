"""The engine's tier state as last read, and an event for every change in it.

Owned by :class:`loractld.serving.tiers.Tiers`. Invariants:

- the state reported to users is the engine's as read, never a guess;
- lifecycle events and metrics come from the worker's change journal, so LRU evictions and
  lazy loads that vLLM does inside a step are reported too, each one, in order, however seldom
  the state is read (the difference of two reads only when the journal overflowed);
- nothing on the request path reads: a request only marks activity, and a follower reads at
  most once per ``follow_interval_s`` while there is some. At most one read is in flight;
  callers that need a fresh state share the next one (:meth:`EngineStateReader.sync`).
"""

from __future__ import annotations

import asyncio
import logging
from typing import Callable

from loractld.events import Event, EventBus, Metrics
from loractld.serving.exchange_price import ExchangePrice
from loractld.serving.residency import EngineState, TierEngine

_log = logging.getLogger("loractld.tiers")


class EngineStateReader:
    def __init__(self, engine: TierEngine, label: Callable[[int], str], events: EventBus, metrics: Metrics,
                 *, follow_interval_s: float = 0.2, weights_bytes: Callable[[int], int] = lambda engine_id: 0) -> None:
        self.engine = engine
        self._label = label
        self._weights_bytes = weights_bytes
        self.events = events
        self.metrics = metrics
        self._last = EngineState()
        self._reasons: dict[tuple[int, str], str] = {}   # (id, tier) -> why it is about to leave/arrive
        self._seq = -1                      # the last journal record applied; -1: none read yet
        self._asked = self._answered = 0    # sync tickets handed out / covered by a finished read
        self._read: asyncio.Future | None = None
        self.follow_interval_s = follow_interval_s
        self._activity = asyncio.Event()
        self._follower: asyncio.Task | None = None
        self.price = ExchangePrice()        # what an exchange costs, in steps (the auto policy's measure)

    def expect(self, engine_id: int, tier: str, reason: str) -> None:
        """``engine_id`` is about to arrive in or leave ``tier`` because of ``reason`` (an
        operation's, not vLLM's own "lazy" or "lru"): its event says so."""
        self._reasons[(engine_id, tier)] = reason

    def clear_expected(self) -> None:
        self._reasons.clear()

    async def sync(self) -> EngineState:
        """The engine's state as read by a read that began after this call; publish what
        changed. Concurrent callers share reads: at most one is in flight at any time. While the
        engine sleeps (``--keep-alive``: ``loractld.serving.keep_alive``) nothing asks it: the
        state is the last one read."""
        if getattr(self.engine, "asleep", False):
            return self._last
        self._asked += 1
        ticket = self._asked
        while self._answered < ticket:
            if self._read is None:
                self._read = asyncio.ensure_future(self._read_state(self._asked))
            # Shielded: a caller that goes away must not cancel the read others wait for.
            await asyncio.shield(self._read)
        return self._last

    async def _read_state(self, covers: int) -> None:
        try:
            raw = await self.engine.lora_state(self._seq)
            self._apply(raw)
            self._answered = max(self._answered, covers)
        finally:
            self._read = None

    async def settled(self) -> None:
        """Return once no read is in flight (the engine is about to stop: keep_alive)."""
        while self._read is not None:
            await asyncio.wait({self._read})

    def restart_journal(self) -> None:
        """The engine was started afresh (a wake after a full stop): its worker's change journal
        starts over, so the next read compares with the state last read instead."""
        self._seq = -1

    def _apply(self, raw: dict) -> None:
        now = EngineState.from_worker(raw)
        before, self._last = self._last, now
        if self._seq >= 0 and raw.get("journal_complete", False):
            changes = [(tier, direction, engine_id) for _, tier, direction, engine_id in raw.get("changes", [])]
        else:  # the first read, or a journal that overflowed: fall back to the difference
            changes = [(tier, "out", i) for tier, old, new in (("device", before.device, now.device),
                                                               ("host", before.host, now.host)) for i in old if i not in new]
            changes += [(tier, "in", i) for tier, old, new in (("host", before.host, now.host),
                                                              ("device", before.device, now.device)) for i in new if i not in old]
        self._seq = int(raw.get("seq", -1))
        self.price.observe(raw.get("costs", {}))
        if self.price.price is not None:
            self.metrics.set("loractl_exchange_price_steps", (), round(self.price.price, 4))
            self.metrics.set("loractl_engine_step_seconds", (), round(self.price.step_s, 6))
        for tier, direction, engine_id in changes:
            if direction == "in":
                reason = self._reasons.pop((engine_id, tier), "lazy")
                self.events.publish(Event(f"LOADED_TO_{tier.upper()}", self._label(engine_id), reason=reason))
                self._count_load(tier, engine_id, now)
            else:
                reason = self._reasons.pop((engine_id, tier), "lru")
                kind = "EVICTED_FROM_HOST" if tier == "host" else "UNLOADED_FROM_DEVICE"
                self.events.publish(Event(kind, self._label(engine_id), reason=reason))
                self.metrics.inc("loractl_adapter_evictions_total", (("reason", reason), ("tier", tier)))
        for tier, ids in (("host", now.host), ("device", now.device)):
            self.metrics.set("loractl_tier_adapters", (("tier", tier),), len(ids))
            self.metrics.set("loractl_tier_bytes", (("tier", tier),), sum(now.host_bytes.get(i, 0) for i in ids))

    def _count_load(self, tier: str, engine_id: int, now: EngineState) -> None:
        """An arrival in ``tier``, whoever caused it (an operation, or vLLM within a step): one
        load and its bytes moved: into host RAM, the weights file read from disk; onto the
        device, what the engine holds of it in host RAM (the copy made), or the file's size
        where the engine reports none."""
        moved = now.host_bytes.get(engine_id, 0) if tier == "device" else 0
        self.metrics.inc("loractl_adapter_loads_total", (("tier", tier),))
        self.metrics.inc("loractl_adapter_load_bytes_total", (("tier", tier),),
                         moved or self._weights_bytes(engine_id))

    # -- following the engine while requests run ------------------------------------------
    def note_activity(self) -> None:
        """A request that may load or evict adapters started or ended: read the state soon."""
        self._activity.set()

    def start_following(self) -> None:
        self._follower = asyncio.create_task(self._follow())

    def stop_following(self) -> None:
        if self._follower is not None:
            self._follower.cancel()

    async def _follow(self) -> None:
        while True:
            await self._activity.wait()
            # Coalesce: every request that starts or ends within the interval shares one read.
            await asyncio.sleep(self.follow_interval_s)
            self._activity.clear()
            try:
                await self.sync()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - a dead engine is the watchdog's business
                _log.debug("tier state read failed", exc_info=True)

    @property
    def last_state(self) -> EngineState:
        """The state as of the last read (no read now): for replies right after an operation,
        which ends with a read of its own."""
        return self._last
