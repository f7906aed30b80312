"""Adapter-aware admission: which requests the engine may hold, so that no engine step can
need more device slots than there are, and device pins are safe.

vLLM's scheduler takes up to ``max_loras`` distinct adapters into a step, first come first
served, whatever is pinned: with a slot held by a device pin, a step of ``max_loras`` other
adapters evicts one of its own adapters mid-step and the engine dies (``KeyError`` in
punica's ``convert_mapping``). And under adapter thrash its first-come order lets requests for
the adapters already running join step after step while a request for another adapter waits
for all of them to end. loractl sees every request before vLLM does; this gate holds the ones
the engine must not have yet, and a policy chooses which adapter a freed place goes to.

Terms: a *place* is a device slot's worth of admission. ``places`` = ``max_loras``. An adapter
is *active* while the engine holds at least one of its requests; every active adapter that is
not device-pinned takes one place, and every device pin takes one for good.

Invariants:
- active unpinned adapters + device pins <= places, at every moment, under every policy that
  holds; so every step's adapters fit in the device slots next to the pinned ones. The one
  policy that does not hold, ``passthrough`` (issue 58), admits every request at once while no
  device pin is held or waiting: vLLM's scheduler then keeps each step within ``max_loras``
  itself (a request that would exceed it is skipped and stays first in line), and loractl's
  schedule is vLLM's. Once a device pin is asked for, it holds as ``batching`` does: the pin
  waits until the adapters active then drain to a free place.
- A base-model request, or one for a device-pinned adapter, never waits.
- A waiter that goes away (client gone, deadline, drain) leaves its queue at once; a place
  granted to it that it did not take is handed on at once. This holds for device pins too: a
  pin whose caller was cancelled is never granted, and one granted in the same loop turn as
  its cancel gives its place back (tests/test_admission.py) - through its caller where the
  place may be shared (``give_back``: Tiers, two names of one content).
- A pin of an adapter already pinned or active takes no new place, so it never waits for one;
  nor does a queued request of an adapter pinned meanwhile.
- A device pin waiting for a place goes first: while one waits, no adapter becomes active and
  active ones take no new requests (they drain, and free the place).
- The policy only chooses; the bookkeeping above is the gate's, the same for every policy.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

POLICIES = ("measured", "batching", "adaptive", "first-come", "passthrough", "auto")
DEFAULT_POLICY = "measured"
DEFAULT_MAX_WAIT_S = 0.1  # bench/thrash_bench.py: 1 s let cold adapters starve and halved tokens/s
# Wait-time histogram buckets (seconds): from "did not wait" to "starved".
WAIT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)


@dataclass(eq=False)
class Ticket:
    """One request, from arrival to its end: queued (``admitted`` None), then in the engine."""

    id: str
    key: int | None                 # the adapter's engine id; None for the base model
    label: str                      # what ``ps`` and the metrics call it
    arrived: float
    admitted: float | None = None
    waited: bool = False            # it was queued (not admitted on arrival)
    opened_turn: bool = False       # its grant made its adapter active (a hand-over, if one was closing)
    first_token: float | None = None
    grant: asyncio.Future | None = field(default=None, repr=False)
    load_from: str = ""             # host or disk: where its adapter was when admitted, if not on the device
    ref: object = field(default=None, repr=False)   # its AdapterRef, for a prefetch (serving/prefetch.py)

    @property
    def wait_s(self) -> float:
        return (self.admitted if self.admitted is not None else time.monotonic()) - self.arrived


class TicketLabel(tuple):
    """An admitted request's metrics label, carrying its ticket: the core counts generated
    tokens under it, and the first count tells the gate when the first token came
    (:meth:`Gate.first_token`)."""

    ticket: Ticket


@dataclass
class Measured:
    """What the gate measures as it serves, as running means (EWMA, ``weight`` per sample):

    - ``handover_s``: a turn's first request, from its place's grant to its first token: the
      adapter's load (disk, host, device) and prefill, what a hand-over costs the waiter
      beyond the drain;
    - ``service_s``: a request, from its grant to its end: what an adapter still running needs
      to drain, given how long its requests have run.

    None until the first sample."""

    handover_s: float | None = None
    service_s: float | None = None
    handovers: int = 0
    weight: float = 0.2

    def note(self, what: str, sample: float) -> None:
        old = getattr(self, what)
        setattr(self, what, sample if old is None else old + self.weight * (sample - old))
        if what == "handover_s":
            self.handovers += 1


@dataclass
class AdapterQueue:
    """One adapter at the gate: its requests in the engine and waiting, and how long the oldest
    waiting one has waited (0 if none waits)."""

    label: str
    running: int = 0
    queued: int = 0
    oldest_wait_s: float = 0.0


class Policy(Protocol):
    """Chooses; never counts. Called by the gate with the gate's state, after every change."""

    name: str
    batch_on_grant: bool    # a freed place admits every waiting request of its adapter at once
    holds: bool             # False: admit everything while no device pin is held or waiting (passthrough)

    def why(self) -> str | None:
        """What the policy decided its mode from, where that is more than its name (``auto``)."""

    def may_join(self, gate: Gate, key: int, now: float) -> bool:
        """May a waiting request for ``key``, already active, enter the engine now?"""

    def next_adapter(self, gate: Gate, now: float) -> int | None:
        """Which waiting adapter (not active) gets a free place now; None: leave it free."""


class FirstCome:
    """Strict arrival order: a request enters when everything that came before it has; it takes
    a free place, or joins its adapter if active. No request waits behind a later one, and no
    hot adapter batches past a request for another: the baseline."""

    name = "first-come"
    batch_on_grant = False
    holds = True

    def why(self) -> str | None:
        return None

    def may_join(self, gate: Gate, key: int, now: float) -> bool:
        return gate.queue[0].key == key   # only the head of the line moves

    def next_adapter(self, gate: Gate, now: float) -> int | None:
        return gate.queue[0].key if gate.queue else None


class AdapterBatching:
    """Batch by adapter, with a bound on waiting (in the spirit of LoRAX's exchange scheduler).

    - An active adapter takes its waiting requests as they come (one engine batch serves them
      all, and no slot changes hands), until another adapter has waited ``max_wait_s``: then
      the active adapter quickest to drain (fewest requests in the engine) stops taking new
      requests, drains, and frees its place.
    - A free place goes to the adapter that has waited longest past ``max_wait_s``, else to the
      one with the most waiting requests (the biggest batch), ties to the oldest request.
    A request's wait is thus bounded by ``max_wait_s`` plus the time the adapter ahead of it
    takes to finish what it already runs.
    """

    name = "batching"
    batch_on_grant = True
    holds = True

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        self.max_wait_s = max_wait_s

    def bound(self) -> float:
        """How long a request for an inactive adapter waits before an active one hands over."""
        return self.max_wait_s

    def why(self) -> str | None:
        return None

    def may_join(self, gate: Gate, key: int, now: float) -> bool:
        bound = self.bound()
        starving = {t.key for t in gate.queue if t.key not in gate.running and now - t.arrived >= bound}
        if not starving and not gate.pins_waiting:
            return True
        return key not in self.closing_set(gate, now, len(starving) + gate.pins_waiting)

    def closing_set(self, gate: Gate, now: float, starving: int) -> list[int]:
        """The active adapters that stop taking requests while ``starving`` adapters (a waiting
        device pin counts as one) wait past the bound: here one at a time, :meth:`closing`."""
        closing = self.closing(gate, now)
        return [] if closing is None else [closing]

    def closing(self, gate: Gate, now: float) -> int | None:
        """Someone has waited too long: which active adapter hands its place over. The one
        quickest to drain (fewest requests in the engine; ties: the oldest turn). Not simply
        the oldest turn: that is the hot adapter, and closing it stalls every client waiting
        on it (bench/thrash_bench.py: TTFT p99 doubled at 4 streams)."""
        return min(gate.unpinned_active(), key=lambda k: (gate.running[k], gate.turn_began[k]), default=None)

    def next_adapter(self, gate: Gate, now: float) -> int | None:
        waiting: dict[int, list[Ticket]] = {}
        for t in gate.queue:
            if t.key not in gate.running:
                waiting.setdefault(t.key, []).append(t)
        if not waiting:
            return None

        bound = self.bound()

        def priority(key: int) -> tuple:
            first = waiting[key][0].arrived
            starved = now - first >= bound
            return (not starved, first if starved else 0.0, -len(waiting[key]), first)

        return min(waiting, key=priority)


class AdaptiveBatching(AdapterBatching):
    """Batching whose hand-over bound is the measured cost of a hand-over (rent or buy).

    A hand-over costs the waiter the drain: from the moment it starved (waited the bound) until
    a place is free for it, while the adapter handing over finishes what it runs. Ski rental
    says: wait (rent) as long as one such drain costs, then hand over (buy); a waiter then
    waits about twice a drain at most, and never longer than under the fixed bound. So the
    bound is the running mean of measured drains (EWMA, ``weight`` per sample) capped by
    ``max_wait_s``; before any drain was measured it is ``max_wait_s``, which makes this policy
    :class:`AdapterBatching` until the first hand-over. Short drains (few requests in the
    engine, short outputs, a fast engine) give short waits; long ones leave ``max_wait_s`` in
    charge. A drain is measured when a starved adapter gets its place: its oldest request's
    wait past the bound then in force.
    """

    name = "adaptive"
    weight = 0.2

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        super().__init__(max_wait_s)
        self.drain_s: float | None = None

    def bound(self) -> float:
        return self.max_wait_s if self.drain_s is None else min(self.max_wait_s, self.drain_s)

    def next_adapter(self, gate: Gate, now: float) -> int | None:
        bound = self.bound()
        key = super().next_adapter(gate, now)
        if key is not None:
            drain = now - next(t.arrived for t in gate.queue if t.key == key) - bound
            if drain >= 0:   # it starved, then waited this long for a place
                self.drain_s = drain if self.drain_s is None else self.drain_s + self.weight * (drain - self.drain_s)
        return key


class Passthrough(AdapterBatching):
    """vLLM's own schedule: no request waits at the gate while no device pin is held or waiting.

    vLLM's scheduler already keeps a step within ``max_loras`` distinct adapters: a waiting
    request that would exceed it is skipped and stays at the head of its queue, so a freed slot
    goes to the oldest waiter in the next step, with no hop through the daemon. Where a slot
    change costs microseconds (a GPU: a copy from pinned host memory against a ~3 ms step) a
    hold in front of the engine can only add waiting (issue 58: zipf@16 at 0.83x the server's
    tokens/s under ``batching`` on an H200). The gate still counts, times and publishes every
    request. A device pin is the exception: vLLM admits ``max_loras`` adapters per step whatever
    is pinned, which kills the engine, so while one is held or waiting this policy holds as
    ``batching`` (the slot invariant, and its starvation bound ``max_wait_s``).
    """

    name = "passthrough"
    holds = False


class Gate:
    """The admission gate. Single-threaded: every method runs on the daemon's event loop.

    ``on_admit`` is called with each ticket when it is admitted (``serving.admitted.Admission``
    sets it: it publishes an event and observes the wait); ``clock`` is injectable for tests.
    """

    def __init__(self, places: int, policy: Policy, *, on_admit: Callable[[Ticket], None] | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if places < 1:
            raise ValueError("the gate needs at least one place")
        self.places = places
        self.policy = policy
        self.on_admit = on_admit
        self.clock = clock
        self.running: dict[int, int] = {}       # adapter -> requests the engine holds (pinned ones too)
        self.turn_began: dict[int, float] = {}  # active adapter -> when it became active
        self.pinned: set[int] = set()           # device pins: a place each, for good
        self.queue: list[Ticket] = []           # waiting requests, in arrival order
        self.tickets: dict[str, Ticket] = {}    # every request from arrival to end (loractl ps)
        self._pin_waiters: list[tuple[int, asyncio.Future]] = []
        self._ids = itertools.count(1)
        self.measured = Measured()
        # Told ("queued" | "admitted" | "finished", ticket) after the gate's own bookkeeping: they
        # only watch (the prefetch, serving/prefetch.py), never change what the gate decided.
        self.watchers: list[Callable[[str, Ticket], None]] = []
        if hasattr(policy, "bind"):
            policy.bind(self)   # a policy that decides from what the gate measures

    # -- the state, for policies and status ------------------------------------------------
    def unpinned_active(self) -> list[int]:
        return [k for k in self.running if k not in self.pinned]

    @property
    def used(self) -> int:
        return len(self.unpinned_active()) + len(self.pinned)

    @property
    def free(self) -> int:
        return self.places - self.used

    @property
    def pins_waiting(self) -> bool:
        return bool(self._pin_waiters)

    @property
    def passing(self) -> bool:
        """Every request enters at once: the policy does not hold and no device pin needs a place."""
        return not self.policy.holds and not self.pinned and not self._pin_waiters

    def mode(self) -> tuple[str, str]:
        """What the gate does now and why, for ``status``, ``top`` and the metrics:
        ("passthrough", why) or ("holding", why)."""
        why = self.policy.why()
        if self.passing:
            return "passthrough", why or "vLLM's scheduler keeps each step within max_loras"
        if not self.policy.holds:
            pins = len(self.pinned)
            held = f"{pins} device pin{'s' if pins != 1 else ''}" if pins else "a device pin waiting for a place"
            return "holding", f"{held}: vLLM alone would evict it mid-step"
        return "holding", why or f"policy {self.policy.name}: at most {self.places} adapters in the engine, pins included"

    def set_policy(self, policy: Policy) -> None:
        """Change the policy while serving (``loractl admission POLICY``). Requests in the engine
        stay; a holding policy taken after ``passthrough`` admits no new adapter until the ones
        active drain below the places."""
        self.policy = policy
        if hasattr(policy, "bind"):
            policy.bind(self)
        self._pump()

    def position(self, ticket: Ticket) -> int:
        """1-based place in the waiting line; 0 once admitted."""
        return 0 if ticket.admitted is not None else self.queue.index(ticket) + 1

    def queued_by_adapter(self) -> dict[str, int]:
        depth: dict[str, int] = {}
        for t in self.queue:
            depth[t.label] = depth.get(t.label, 0) + 1
        return depth

    def adapter_queues(self) -> list[AdapterQueue]:
        """Every adapter with a request at the gate (not the base model), oldest waiter first."""
        now = self.clock()
        out: dict[str, AdapterQueue] = {}
        for t in self.tickets.values():
            if t.key is None:
                continue
            q = out.setdefault(t.label, AdapterQueue(t.label))
            if t.admitted is None:
                q.queued += 1
                q.oldest_wait_s = max(q.oldest_wait_s, now - t.arrived)
            else:
                q.running += 1
        return sorted(out.values(), key=lambda q: (-q.oldest_wait_s, q.label))

    def drain_s(self, key: int, now: float) -> float | None:
        """How long ``key``'s requests in the engine still need, by the measured service time
        (the longest of them); None before a service time was measured."""
        service = self.measured.service_s
        if service is None:
            return None
        ages = [now - t.admitted for t in self.tickets.values() if t.key == key and t.admitted is not None]
        return max((max(0.0, service - age) for age in ages), default=0.0)

    def first_token(self, ticket: Ticket) -> None:
        """The engine gave ``ticket`` its first token (called once, by the core)."""
        if ticket.first_token is None and ticket.admitted is not None:
            ticket.first_token = self.clock()
            if ticket.opened_turn and ticket.waited:
                self.measured.note("handover_s", ticket.first_token - ticket.admitted)

    # -- requests ----------------------------------------------------------------------------
    async def enter(self, key: int | None, label: str, ref: object = None) -> Ticket:
        """Wait until the request may enter the engine; the ticket must be given to :meth:`finish`
        when the request ends (finished, aborted or failed). ``ref``: the adapter, for watchers."""
        ticket = Ticket(f"r{next(self._ids)}", key, label, self.clock(), ref=ref)
        self.tickets[ticket.id] = ticket
        if key is None or key in self.pinned or self.passing:
            self._admit(ticket)
            return ticket
        self.queue.append(ticket)
        self._pump()
        if ticket.admitted is not None:
            return ticket
        ticket.waited = True
        ticket.grant = asyncio.get_running_loop().create_future()
        self._tell("queued", ticket)
        try:
            await ticket.grant
        except asyncio.CancelledError:
            self.finish(ticket)   # queued: out of the line; granted meanwhile: the place goes on
            raise
        return ticket

    def finish(self, ticket: Ticket) -> None:
        """The request ended (or gave up waiting). Idempotent."""
        if self.tickets.pop(ticket.id, None) is None:
            return
        if ticket.admitted is None:
            self.queue.remove(ticket)
        elif ticket.key is not None:
            if ticket.first_token is not None:   # served, not failed or cut off before its answer
                self.measured.note("service_s", self.clock() - ticket.admitted)
            self.running[ticket.key] -= 1
            if not self.running[ticket.key]:
                del self.running[ticket.key]
                self.turn_began.pop(ticket.key, None)
        self._pump()
        self._tell("finished", ticket)

    # -- device pins -------------------------------------------------------------------------
    async def reserve(self, key: int, *, give_back: bool = True) -> None:
        """Hold a place for ``key`` for good (a device pin); waits for one to free up. An
        adapter already active keeps its place, now as a pin.

        ``give_back`` False: a caller cancelled after its place was granted gives it back itself
        (:class:`~loractld.serving.tiers.Tiers` does, by what every name wants of ``key``): two
        names of the same content share one place, and one's cancel must not take it from the
        other's pin, which the gate cannot see."""
        if key in self.pinned:
            return
        # An active adapter keeps its place as the pin's, unless passthrough let more adapters in
        # than there are places: then the pin waits until they drain (vLLM would evict it).
        if (key in self.running and self.used <= self.places) or (self.free > 0 and not self._pin_waiters):
            self.pinned.add(key)
            self._pump()
            return
        waiter = asyncio.get_running_loop().create_future()
        self._pin_waiters.append((key, waiter))
        try:
            await waiter
        except asyncio.CancelledError:
            # Granted (the pump set the result) before the cancel reached us: the place was taken
            # for us, so give it back. Not granted: the pump skips cancelled waiters, so ours may
            # still be queued, or already dropped by the pump; either way it holds no place.
            if waiter.done() and not waiter.cancelled():
                if give_back:
                    self.unreserve(key)
            else:
                with contextlib.suppress(ValueError):
                    self._pin_waiters.remove((key, waiter))
                self._pump()
            raise

    def unreserve(self, key: int) -> None:
        """Drop a device pin's place (after the engine unpinned it). Requests of ``key`` still
        running keep it active, on an ordinary place."""
        self.pinned.discard(key)
        self._pump()

    # -- the pump: every change ends here --------------------------------------------------
    def _pump(self) -> None:
        now = self.clock()
        # A pin of an adapter already pinned (another name of the same content) or active takes
        # no new place: granted at once, never left waiting (and holding every admission) for one.
        over = self.used > self.places   # passthrough's adapters still draining: no pin lands yet
        for key, waiter in [w for w in self._pin_waiters
                            if w[0] in self.pinned or (w[0] in self.running and not over)]:
            self._pin_waiters.remove((key, waiter))
            if not waiter.done():
                self.pinned.add(key)
                waiter.set_result(None)
        while self._pin_waiters and self.free > 0:
            key, waiter = self._pin_waiters.pop(0)
            if waiter.done():
                continue  # its caller was cancelled: a place granted now would never come back
            self.pinned.add(key)
            waiter.set_result(None)
            for other in [w for w in self._pin_waiters if w[0] == key]:   # the same content: no place more
                self._pin_waiters.remove(other)
                if not other[1].done():
                    other[1].set_result(None)
        if self.passing:   # the last pin went: what it held back goes in, in arrival order
            for ticket in list(self.queue):
                self._admit(ticket)
        progress = True
        while progress and self.queue:
            progress = False
            # A pinned adapter's requests go in even while a pin waits: they take no place.
            for ticket in [t for t in self.queue if t.key in self.running or t.key in self.pinned]:
                if ticket.key in self.pinned or (not self._pin_waiters and self.policy.may_join(self, ticket.key, now)):
                    self._admit(ticket)
                    progress = True
            if self.free > 0 and not self._pin_waiters:
                key = self.policy.next_adapter(self, now)
                if key is not None and key not in self.running:
                    self.turn_began[key] = now
                    for i, ticket in enumerate([t for t in self.queue if t.key == key]):
                        ticket.opened_turn = i == 0
                        self._admit(ticket)
                        if not self.policy.batch_on_grant:
                            break  # the others follow through may_join, in their order
                    progress = True

    def _admit(self, ticket: Ticket) -> None:
        ticket.admitted = self.clock()
        if ticket in self.queue:
            self.queue.remove(ticket)
        if ticket.key is not None:
            if ticket.key not in self.running:
                self.turn_began.setdefault(ticket.key, ticket.admitted)
            self.running[ticket.key] = self.running.get(ticket.key, 0) + 1
        if ticket.grant is not None and not ticket.grant.done():
            ticket.grant.set_result(None)
        if self.on_admit is not None:
            self.on_admit(ticket)
        self._tell("admitted", ticket)

    def _tell(self, what: str, ticket: Ticket) -> None:
        for watch in self.watchers:
            watch(what, ticket)
