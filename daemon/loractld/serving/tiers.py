"""The tiers: load, evict, pin and preload across disk -> host -> device, on vLLM's own caches.

vLLM already keeps the two upper tiers (``max_cpu_loras`` host LRU, ``max_loras`` device
slots) and pins in both; this module is the policy and the bookkeeping around them, never a
parallel cache:

- every operation acts on the engine, then re-reads the engine's true state (``sync``, through
  :mod:`loractld.serving.reader`, which owns the state as read and the events of its changes);
- a host pin keeps an adapter in host RAM, never evicted there; host pins are capped at
  ``max_cpu_loras - max_loras`` so that every step of up to ``max_loras`` adapters still finds
  room in RAM (a host full of pins, or a step that must evict one of its own adapters, kills
  vLLM's engine);
- a device pin keeps an adapter in a device slot (and in RAM) for good. It is safe only
  because the admission gate (``loractld.serving.admission``) holds the slot: the gate's place is
  taken before the engine pins, and given back only after the engine unpinned. Device pins
  are capped at ``max_loras - 1``, so other adapters always have a slot;
- pins persist (``state.json``) and, with the preload list, are applied before the daemon
  reports ready;
- the engine's and the gate's pin of an engine id are what the names' recorded pins, and pins
  in progress (:mod:`loractld.serving.claims`), want of it: names may share an id (the same
  content), and a name's pin may hold an older revision than the name resolves to now;
- a pin change that has asked the engine runs to its end and is recorded even if its caller
  goes away (:meth:`Tiers.to_the_end`).

The engine is passed in, so the policy can be driven by a fault-injecting stand-in in tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Awaitable

from loractl.errors import InvalidRequest, LoractlError
from loractld.store.identity import AdapterRef, AdapterResolver
from loractld.serving.admission import Gate
from loractld.worker import hooks
from loractld.events import Event, EventBus, Metrics
from loractld.serving.claims import Claim, PinClaims
from loractld.serving.finishing import Finishing
from loractld.serving.pins import PersistentState
from loractld.serving.reader import EngineStateReader
from loractld.serving.residency import EngineState, Residency, TierEngine, Usage

if TYPE_CHECKING:
    from loractld.store.preflight import Preflight

_log = logging.getLogger("loractld.tiers")


class Tiers:
    def __init__(self, engine: TierEngine, resolver: AdapterResolver, state: PersistentState, events: EventBus,
                 metrics: Metrics, gate: Gate, *, max_loras: int, max_cpu_loras: int,
                 follow_interval_s: float = 0.2) -> None:
        self.engine = engine
        self.resolver = resolver
        self.state = state
        self.events = events
        self.metrics = metrics
        self.gate = gate
        self.max_loras = max_loras
        self.max_pins = max(0, max_cpu_loras - max_loras)
        self.max_device_pins = max(0, max_loras - 1)
        self.usage: dict[str, Usage] = {}
        self._lock = asyncio.Lock()
        self.claims = PinClaims(state, max_pins=self.max_pins, max_device_pins=self.max_device_pins)
        self._finishing = Finishing("a pin change")   # pin changes whose caller went away
        # name -> the engine id its pin holds (in the engine, and at the gate for a device pin):
        # the revision pinned, which a new revision or a pin racing a pull can make differ from
        # what the name resolves to now. Unpins release this id, never a re-resolved one.
        self._pinned_ids: dict[str, int] = {}
        self.reader = EngineStateReader(engine, self._label, events, metrics, follow_interval_s=follow_interval_s,
                                        weights_bytes=resolver.weights_bytes)

    # -- the engine's state, read by the reader -------------------------------------------
    async def sync(self) -> EngineState:
        """The engine's state as read by a read that began after this call (shared reads)."""
        return await self.reader.sync()

    @property
    def last_state(self) -> EngineState:
        """The state as of the last read (no read now)."""
        return self.reader.last_state

    def note_activity(self) -> None:
        self.reader.note_activity()

    def start_following(self) -> None:
        self.reader.start_following()

    def stop_following(self) -> None:
        self.reader.stop_following()

    def _label(self, engine_id: int) -> str:
        return self.resolver.label_of(engine_id) or f"#{engine_id}"

    async def residency(self, adapter: AdapterRef) -> Residency:
        return (await self.sync()).residency(adapter.engine_id)

    def pinned_names(self) -> list[str]:
        """Every pinned adapter, host and device."""
        return list(self.state.pins) + list(self.state.device_pins)

    @property
    def lock(self) -> asyncio.Lock:
        """Held by every tier operation (load, evict, pin, unpin, an install's follow-up): whoever
        must run with no tier operation between its check and its change (keep_alive) takes it."""
        return self._lock

    def held_pins(self) -> dict[str, tuple[str, int]]:
        """name -> (pin, the engine id it holds), for every recorded pin applied in the engine."""
        return {n: (self.state.pin_of(n), i) for n, i in self._pinned_ids.items()}

    def pin_of(self, name: str) -> str:
        return self.state.pin_of(name)

    def _pin_holders(self, engine_id: int, kind: str = "") -> list[str]:
        """The names whose applied pin holds ``engine_id`` (of ``kind``, device or host, if given),
        sorted: several names of the same content share its weights and its pin."""
        return sorted(n for n, i in self._pinned_ids.items()
                      if i == engine_id and (not kind or self.state.pin_of(n) == kind))

    # -- usage, from the service ----------------------------------------------------------
    def note_request(self, name: str) -> None:
        usage = self.usage.setdefault(name, Usage())
        usage.requests += 1
        usage.last_used = time.time()
        self.metrics.inc("loractl_adapter_requests_total", (("adapter", name),))

    # -- operations -----------------------------------------------------------------------
    async def load(self, name: str, to: str = "device", *, reason: str = "explicit",
                   adapter: AdapterRef | None = None) -> Residency:
        """Load ``name`` (or the revision of it already resolved: ``adapter``) to a tier."""
        if to not in ("device", "host"):
            raise InvalidRequest(f"cannot load to {to!r}", "Use --to device or --to host.")
        adapter = adapter or self.resolver.resolve(name)
        lease = self._lease(adapter)
        try:
            if to == "host" and self.state.pin_of(name) == "device":
                raise _pinned_to_device(name, "move it to host RAM")
            async with self._lock:
                if to == "host":
                    self._refuse_if_held_on_device(name, adapter.engine_id, "move it to host RAM")
                usage = self.usage.setdefault(name, Usage())
                usage.state, usage.error = "loading", ""
                before = self.reader.last_state.residency(adapter.engine_id)
                began = time.perf_counter()
                try:
                    for tier in ("host", "device"):
                        self.reader.expect(adapter.engine_id, tier, reason)
                    await self.engine.add_adapter(adapter)
                    if to == "host":
                        await self.engine.deactivate_adapter(adapter.engine_id)
                except asyncio.CancelledError:
                    usage.state, usage.error = "ready", ""   # the caller went away: nothing failed
                    raise
                except Exception as e:
                    usage.state, usage.error = "failed", str(e)
                    self.metrics.inc("loractl_adapter_load_failures_total")
                    self.events.publish(Event("FAILED", name, message=str(e), reason=reason))
                    raise LoractlError(f"loading {name!r} failed: {e}", "See the daemon's log; loractl show NAME.") from e
                elapsed = time.perf_counter() - began
                usage.state = "ready"
                if before.tier != to:   # counted as loads (and bytes) by the reader, per tier it arrived in
                    self.metrics.observe("loractl_adapter_load_seconds", (("tier", to),), elapsed)
                state = await self.sync()
                self.reader.clear_expected()
                return state.residency(adapter.engine_id)
        finally:
            lease.release()

    async def evict(self, name: str, source: str = "device") -> Residency:
        if source not in ("device", "host"):
            raise InvalidRequest(f"cannot evict from {source!r}", "Use --from device or --from host.")
        adapter = self.resolver.resolve(name)
        if self.state.pin_of(name) == "device":
            raise _pinned_to_device(name, "evict it")
        async with self._lock:
            if source == "device":
                self._refuse_if_held_on_device(name, adapter.engine_id, "evict it")
            current = (await self.sync()).residency(adapter.engine_id)
            if current.pinned and source == "host":
                holders = self._pin_holders(adapter.engine_id)
                if holders and name not in holders:   # the pin is another name's, of the same content
                    raise InvalidRequest(f"{name!r} has the same content as {holders[0]!r}, which is pinned",
                                         f"To evict it, unpin that first: loractl unpin {holders[0]}")
                raise InvalidRequest(f"{name!r} is pinned in host RAM", f"Unpin it first: loractl unpin {name}")
            if source == "device" and current.tier == "device":
                self.reader.expect(adapter.engine_id, "device", "explicit")
                await self.engine.deactivate_adapter(adapter.engine_id)
            elif source == "host" and current.tier != "disk":
                for tier in ("host", "device"):
                    self.reader.expect(adapter.engine_id, tier, "explicit")
                await self.engine.remove_adapter(adapter.engine_id)
            state = await self.sync()
            self.reader.clear_expected()
            return state.residency(adapter.engine_id)

    async def drop(self, engine_id: int, reason: str) -> bool:
        """Remove ``engine_id`` from both tiers unless a pin holds it (room in host RAM for a
        prefetch, serving/prefetch.py, which checked that no request needs it). True if removed."""
        async with self._lock:
            if self.holds_pin(engine_id):
                return False
            for tier in ("host", "device"):
                self.reader.expect(engine_id, tier, reason)
            removed = await self.engine.remove_adapter(engine_id)
            await self.sync()
            self.reader.clear_expected()
            return removed

    def _refuse_if_held_on_device(self, name: str, engine_id: int, action: str) -> None:
        """Refuse to take ``engine_id`` off the device while a device pin holds it: vLLM drops a
        pinned adapter's pin without a word when it is deactivated, and the gate would keep its
        place for a pin the engine no longer has. The pin may be another name's (the same
        content), or in progress. Called under the lock, which every pin's commit takes."""
        if self._wanted(engine_id) != "device":
            return
        holders = self._pin_holders(engine_id, "device")
        if name in holders:
            raise _pinned_to_device(name, action)
        if holders:
            raise InvalidRequest(f"{name!r} has the same content as {holders[0]!r}, which is pinned to the device",
                                 f"To {action}, unpin that first: loractl unpin {holders[0]}")
        raise InvalidRequest(f"{name!r} is being pinned to the device by another command",
                             "Wait for it to finish, then retry.")

    async def pin(self, name: str, to: str = "host", *, reason: str = "explicit") -> Residency:
        """Pin ``name`` in host RAM or in a device slot, for good (until unpinned); persisted.

        A device pin first takes a place at the admission gate, which can wait for the
        adapters now running to finish their requests (new ones queue meanwhile).

        The caps are checked and a claim recorded with no await between (:meth:`PinClaims.take`):
        of two pins racing for the last place, exactly one gets it, the other a clear error.
        Until the engine is asked, a caller that goes away cancels the pin (its gate place goes
        back); from then on the pin is finished and recorded whatever the caller does
        (:meth:`_commit_pin`). A pin that held another revision, or the other tier, gives that up
        once the new pin is recorded (:meth:`_settle_locked`); a host pin moving to a new
        revision gives the old one up just before (the host-pin cap), and takes it back if the
        new one fails. The name's claim is this pin's until it ends, and no other command's.
        """
        if to not in ("device", "host"):
            raise InvalidRequest(f"cannot pin to {to!r}", "Use --to host or --to device.")
        adapter = self.resolver.resolve(name)
        lease = self._lease(adapter)
        try:
            claim = self.claims.take(name, to, self.state.pin_of(name), adapter.engine_id)
        except BaseException:
            lease.release()
            raise
        handed_over = False   # to the commit, which then releases the claim and the lease
        try:
            try:
                await hooks.reached_async("pin-claimed")
                if to == "device":
                    # Given back by the settle below if cancelled: another name may share the place.
                    await self.gate.reserve(adapter.engine_id, give_back=False)
                await self.load(name, "device", reason=reason, adapter=adapter)  # this revision
            except BaseException:
                self.claims.end(claim)
                await self.to_the_end(self._settle(adapter.engine_id))  # a place taken above goes back
                raise
            handed_over = True
            return await self.to_the_end(self._commit_pin(name, to, adapter, reason, lease, claim))
        finally:
            if not handed_over:
                self.claims.end(claim)
                lease.release()

    async def _commit_pin(self, name: str, to: str, adapter: AdapterRef, reason: str, lease,
                          claim: Claim) -> Residency:
        """Pin in the engine and record the pin, under the lock: no other tier operation sees
        the engine pinned and the records not, or the other way round."""
        engine_id = adapter.engine_id
        try:
            async with self._lock:
                previous, was = self._pinned_ids.get(name), self.state.pin_of(name)
                # A host pin moving to another id (a new revision) gives the old one up first: with
                # both pinned for an engine call, host pins are one over their cap, and a step of
                # max_loras unpinned adapters must evict one of its own. (A device pin's move is
                # covered by the second gate place it reserved; a move between tiers by the caps.)
                release_first = to == was == "host" and previous is not None and previous != engine_id
                try:
                    if release_first:
                        del self._pinned_ids[name]
                        await self._settle_locked(previous)
                    if not await self.engine.pin_adapter(engine_id, device=to == "device"):
                        # Evicted again between the load and the pin (a step's lazy load): once more.
                        await self.engine.add_adapter(adapter)
                        if not await self.engine.pin_adapter(engine_id, device=to == "device"):
                            raise LoractlError(f"pinning {name!r} failed: the engine no longer holds it",
                                               "Retry; if it persists, see the daemon's log.")
                    if was != to:   # a pin that cannot be recorded (a full disk) is taken back out
                        self.state.set_pin(name, to)
                except BaseException:
                    self.claims.end(claim)
                    await self._settle_locked(engine_id)
                    if release_first and name not in self._pinned_ids:
                        await self._restore_host_pin(name, previous)
                    raise
                self._pinned_ids[name] = engine_id
                self.claims.end(claim)
                self.events.publish(Event("PINNED", name, message=f"pinned to {to}", reason=reason))
                if previous is not None and (previous != engine_id or was != to) and not release_first:
                    await self._settle_locked(previous)   # the old revision, or the device pin left for host
                return (await self.sync()).residency(engine_id)
        finally:
            self.claims.end(claim)
            lease.release()

    async def _restore_host_pin(self, name: str, engine_id: int) -> None:
        """A host pin's move to a new revision failed after the old one was given up: pin the old
        one again; if the engine no longer holds it, the name is recorded unpinned (one event)."""
        if await self.engine.pin_adapter(engine_id, device=False):
            self._pinned_ids[name] = engine_id
            return
        self.state.set_pin(name, "")
        self.events.publish(Event("UNPINNED", name, reason="new revision",
                                  message="the old revision left host RAM while the pin moved to the new one, which failed"))

    def _lease(self, adapter: AdapterRef):
        """Lease ``adapter``'s folder while an operation may load it into the engine: an ``rm`` or
        a new revision meanwhile must not delete what vLLM is about to read."""
        return self.resolver.store.lease(adapter.path)

    @contextlib.contextmanager
    def claimed(self, name: str):
        """Hold ``name`` against pins and unpins for the body (``rm``): a pin in progress would
        otherwise record a pin of a name that is gone."""
        claim = self.claims.take(name, "", self.state.pin_of(name))
        try:
            yield
        finally:
            self.claims.end(claim)

    def holds_pin(self, engine_id: int) -> bool:
        """Whether a name's pin, recorded or in progress, holds ``engine_id`` (which must then
        stay in the engine)."""
        return self._wanted(engine_id) != ""

    def _wanted(self, engine_id: int) -> str:
        """The pin the names want of ``engine_id``: "device", "host" or "". Names may share an
        engine id (same content), and a name's pin may hold an older revision than it resolves
        to, so this is asked of the records by id, never of one name."""
        kinds = {self.state.pin_of(n) for n, i in self._pinned_ids.items() if i == engine_id}
        kinds |= self.claims.pins_of(engine_id)
        return "device" if "device" in kinds else "host" if "host" in kinds else ""

    async def _settle(self, engine_id: int) -> None:
        async with self._lock:
            await self._settle_locked(engine_id)

    async def _settle_locked(self, engine_id: int) -> None:
        """Bring the engine's and the gate's pin of ``engine_id`` down to what the names want of
        it: drop a device pin no name holds (keeping the host pin if one holds that), and the
        host pin if none. The engine first, then the gate's place: in the other order the gate
        could admit an adapter that the pinned slot leaves no room for. The caller holds the lock."""
        want = self._wanted(engine_id)
        if want == "device":
            return
        await self.engine.unpin_adapter(engine_id, keep_host=want == "host")
        if self._wanted(engine_id) != "device":   # a device pin of it claimed meanwhile keeps the place
            self.gate.unreserve(engine_id)

    def to_the_end(self, work: Awaitable):
        """Await ``work`` so that a caller that goes away (a cancelled RPC) cannot stop it halfway:
        a change to the engine's pins and to their records (or an rm, ``Core.remove``) is made
        whole, never in part."""
        return self._finishing(work)

    async def unpin(self, name: str) -> Residency:
        adapter = self.resolver.resolve(name)
        current = self.state.pin_of(name)
        if not current:
            holders = [n for n in self._pin_holders(adapter.engine_id) if n != name]
            if holders:   # the same bytes under another name: ls shows the weights pinned
                raise InvalidRequest(f"{name!r} is not pinned itself; its weights are pinned by {holders[0]!r} "
                                     "(the same content)", f"loractl unpin {holders[0]} releases them.")
            raise InvalidRequest(f"{name!r} is not pinned", "loractl ls shows which adapters are pinned.")
        claim = self.claims.take(name, "", current)
        return await self.to_the_end(self._commit_unpin(name, adapter.engine_id, claim))

    async def _commit_unpin(self, name: str, engine_id: int, claim: Claim) -> Residency:
        try:
            async with self._lock:
                await self._drop_pin_locked(name, engine_id)
                return (await self.sync()).residency(engine_id)
        finally:
            self.claims.end(claim)

    async def _drop_pin_locked(self, name: str, engine_id: int, reason: str = "") -> None:
        """Record ``name`` unpinned, then settle the id its pin held (``engine_id`` if none is
        recorded: a saved pin that was never applied)."""
        self.state.set_pin(name, "")   # first: an unpin that cannot be recorded (a full disk) changes nothing
        held = self._pinned_ids.pop(name, engine_id)
        self.events.publish(Event("UNPINNED", name, reason=reason))
        await self._settle_locked(held)

    async def repin(self, name: str) -> None:
        """A new revision of a pinned adapter was installed: move the pin over to it (the old
        revision's pin is given up once the new one is recorded)."""
        to = self.state.pin_of(name)
        if to:
            if self.claims.busy(name):  # before anything moves: the pin stays on the old revision
                raise InvalidRequest(f"{name!r} is busy with another command (pin, unpin or rm)",
                                     f"Pin it again once that is done: loractl pin {name} --to {to}")
            # The old revision's pin, if applied, is in _pinned_ids (= old_id); a saved pin never
            # applied (it failed at start) held nothing, and gives nothing up.
            await self.pin(name, to, reason="new revision")

    async def forget(self, name: str, adapter: AdapterRef, *, unload: bool = True) -> bool:
        """Before ``rm`` (which holds the name's claim): unpin and drop ``adapter`` from the
        engine. True if it was loaded. ``unload`` False: another name has the same content (the
        same adapter in the engine), which stays loaded. So does an id another name's pin holds:
        a pin that stayed on an old revision may hold this content with no other name of it on
        disk, and vLLM drops a removed entry's pin without a word."""
        if self.state.pin_of(name):
            await self.to_the_end(self._unpin_for_rm(name, adapter.engine_id))
        if not unload:
            self.usage.pop(name, None)
            return False
        async with self._lock:
            if self.holds_pin(adapter.engine_id):   # asked under the lock: no pin commits meanwhile
                self.usage.pop(name, None)
                return False
            for tier in ("host", "device"):
                self.reader.expect(adapter.engine_id, tier, "rm")
            removed = await self.engine.remove_adapter(adapter.engine_id)
            await self.sync()
            self.reader.clear_expected()
            self.usage.pop(name, None)
            return removed

    async def _unpin_for_rm(self, name: str, engine_id: int) -> None:
        async with self._lock:
            await self._drop_pin_locked(name, engine_id, reason="rm")

    def fit_saved_pins(self) -> list[str]:
        """Drop the saved pins beyond the caps (after a restart with a lower --max-loras or
        --max-cpu-loras), the last pinned first; return a warning for each, also published as
        a FAILED event. Run before any pin is applied: with more device pins than places,
        re-pinning would wait in the gate for ever, and the daemon would never become ready."""
        dropped = []
        for to, pins, cap in (("device", self.state.device_pins, self.max_device_pins),
                              ("host", self.state.pins, self.max_pins)):
            for name in pins[cap:]:
                dropped.append(f"pin {name}: dropped, more {to} pins were saved than the {cap} allowed now")
                self.events.publish(Event("FAILED", name, reason="restart",
                                          message=f"{to} pin dropped: over the cap of {cap} {to} pins"))
            del pins[cap:]
        if dropped:
            self.state.save()
        return dropped

    async def apply_startup(self, preload: list[str], preflight: Preflight | None = None) -> list[str]:
        """Re-pin the persisted pins, then load the preload list; return the failures.

        ``preflight`` (``store.preflight``: the engine's own loader) checks each one's content
        first, where the daemon passes it: a file placed or changed while the daemon was down
        reaches the engine only through it.
        A pin or preload that fails (the adapter was removed, or no longer validates) is
        reported and skipped: it never keeps the daemon from serving the others.
        """
        failures = self.fit_saved_pins()
        for name in self.pinned_names():
            try:
                await self._preflighted(name, preflight)
                await self.pin(name, self.state.pin_of(name), reason="restart")
            except LoractlError as e:
                failures.append(f"pin {name}: {e.message}")
                self.events.publish(Event("FAILED", name, message=e.message, reason="restart"))
        for name in preload:
            if self.state.pin_of(name):
                continue
            try:
                await self._preflighted(name, preflight)
                await self.load(name, "device", reason="preload")
            except LoractlError as e:
                failures.append(f"preload {name}: {e.message}")
                self.events.publish(Event("FAILED", name, message=e.message, reason="preload"))
        return failures

    async def _preflighted(self, name: str, preflight: Preflight | None) -> None:
        if preflight is not None:
            ref = await self.resolver.resolve_async(name)
            await preflight.check(ref.path, ref.digest, ref.label, ref.engine_id)


def _pinned_to_device(name: str, action: str) -> InvalidRequest:
    return InvalidRequest(f"{name!r} is pinned to the device", f"To {action}, unpin it first: loractl unpin {name}")
