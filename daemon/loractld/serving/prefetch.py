"""Prefetch at the gate (issue 48, item 3): while a request waits at the admission gate for an
adapter that is on disk, load that adapter into host RAM, so that its turn starts with a
host -> device copy instead of a disk read inside an engine step.

The load is ``loractl load --to host``'s own (:meth:`Tiers.load` with ``to="host"``: vLLM's
``add_lora``, then the slot given back), so it is journaled, counted and evented as every load
is (reason ``prefetch``). vLLM V1 runs ``add_lora`` in the engine core between two steps, so a
prefetch's read still delays one step of everyone: it moves the read off the waiter's turn, it
does not hide it (docs/benchmarks.md, "Prefetch at the gate").

Invariants:

- A prefetch never evicts an adapter that an admitted or waiting request needs, nor one in
  flight or pinned: it starts only when the engine's host tier, as read just before, has a free
  entry, or an unpinned entry that no request at the gate needs, which it removes first (the
  oldest such: vLLM's own LRU victim is often the adapter of a request just admitted, which no
  step has touched yet). A step's own lazy load between that read and the load can still take the freed entry;
  vLLM then evicts its LRU entry, as for any lazy load.
- It never pins, and never holds the gate: the gate's bookkeeping is untouched and admission
  goes on as if there were no prefetch; a prefetch that fails is logged and counted as a load
  failure, and the request loads its adapter in its step as before.
- At most ``max_in_flight`` prefetches run at once, one per adapter; with no request waiting
  nothing is read.
- Counting (``loractl_adapter_prefetch_total{result}``), once per turn (the first request of
  an adapter admitted while none of its requests ran), for requests that waited at the gate,
  by where its adapter was as last read: ``hit`` (a prefetch brought it to host RAM and it is
  still there, or already on the device), ``miss`` (on disk: the step loads it), ``late``
  (a prefetch of it was still in flight); ``wasted`` counts prefetched adapters that left host
  RAM before any request of theirs was admitted; ``loaded`` the prefetches that completed.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from loractld.serving.admission import Gate, Ticket
from loractld.serving.residency import EngineState

if TYPE_CHECKING:
    from loractld.serving.tiers import Tiers

_log = logging.getLogger("loractld.prefetch")

METRIC = "loractl_adapter_prefetch_total"
DEFAULT_IN_FLIGHT = 1   # vLLM loads one adapter per utility call anyway; a second only queues behind it


class Prefetcher:
    """Watches the gate (``Gate.watchers``) and loads waiting adapters to host RAM."""

    def __init__(self, tiers: Tiers, gate: Gate, *, max_in_flight: int = DEFAULT_IN_FLIGHT) -> None:
        self.tiers = tiers
        self.gate = gate
        self.max_in_flight = max_in_flight
        self.in_flight: dict[int, asyncio.Task] = {}
        self.fetched: set[int] = set()   # brought to host by a prefetch, no turn of theirs admitted since
        self._pass: asyncio.Task | None = None
        self._again = False
        self._blocked = False            # the last pass found no entry it may take: wait for one to free
        gate.watchers.append(self._watch)

    def _count(self, result: str) -> None:
        self.tiers.metrics.inc(METRIC, (("result", result),))

    # -- the gate's news ----------------------------------------------------------------------
    def _watch(self, what: str, ticket: Ticket) -> None:
        """Called inside the gate's pump: never raises into it."""
        if ticket.key is None:
            return
        try:
            self._news(what, ticket)
        except Exception:   # noqa: BLE001 - the gate's bookkeeping must go on whatever happens here
            _log.exception("prefetch: watching the gate failed")

    def _news(self, what: str, ticket: Ticket) -> None:
        if what == "admitted":
            self._admitted(ticket)
        elif what == "finished":
            self._blocked = False   # a request ended: an entry it needed may be free to take now
        if self.gate.queue and not self._blocked:
            self.poke()

    def _admitted(self, ticket: Ticket) -> None:
        key = ticket.key
        if self.gate.running.get(key) != 1:
            return   # not the first of its turn: the turn was counted
        tier = self.tiers.last_state.residency(key).tier
        fetched = key in self.fetched
        self.fetched.discard(key)
        if fetched and tier == "disk":
            self._count("wasted")
        if not ticket.waited:
            return   # admitted on arrival: no prefetch could have run
        if key in self.in_flight:
            self._count("late")
        elif tier == "disk":
            self._count("miss")
        elif fetched:
            self._count("hit")

    # -- passes ---------------------------------------------------------------------------
    def poke(self) -> None:
        """Look for an adapter to prefetch soon (off the caller's path: the gate's pump)."""
        if self._pass is not None and not self._pass.done():
            self._again = True
            return
        self._again = True
        self._pass = asyncio.get_running_loop().create_task(self._passes())

    async def _passes(self) -> None:
        while self._again:
            self._again = False
            try:
                await self._one_pass()
            except Exception:   # noqa: BLE001 - a prefetch is an optimisation: never the daemon's failure
                _log.exception("prefetch pass failed")

    def _wanted(self, state: EngineState) -> list[Ticket]:
        """Waiting requests, oldest first, one per adapter, whose adapter is in neither tier
        (as ``state`` says), not active and not being prefetched."""
        seen: set[int] = set()
        out = []
        for t in self.gate.queue:
            key = t.key
            if key is None or key in seen or key in self.gate.running or key in self.in_flight:
                continue
            seen.add(key)
            if key not in state.host and key not in state.device and t.ref is not None:
                out.append(t)
        return out

    def _needed(self) -> set[int | None]:
        """The adapters of every request at the gate, admitted or waiting."""
        return {t.key for t in self.gate.tickets.values()}

    def room(self, state: EngineState) -> int | None:
        """Where one more adapter may go in host RAM without evicting anything a request needs:
        0 for a free entry, else the engine id of the oldest unpinned entry that no request at
        the gate needs and no prefetch is loading (removed first); None: nowhere, wait."""
        if len(state.host) + len(self.in_flight) < state.host_capacity:
            return 0
        needed = self._needed() | set(self.in_flight)
        pinned = state.pinned | state.pinned_device
        return next((i for i in state.host if i not in pinned and i not in needed), None)

    async def _one_pass(self) -> None:
        while len(self.in_flight) < self.max_in_flight:
            if not self._wanted(self.tiers.last_state):
                return   # as last read, nothing waits for an adapter off the tiers: no read
            state = await self.tiers.sync()
            self._note_wasted(state)
            wanted = self._wanted(state)
            if not wanted:
                return
            victim = self.room(state)
            if victim is None:
                self._blocked = True
                return
            ticket = wanted[0]
            self.in_flight[ticket.key] = asyncio.get_running_loop().create_task(self._fetch(ticket, victim))

    def _note_wasted(self, state: EngineState) -> None:
        """Count (and forget) the prefetched adapters that left host RAM before their turn."""
        for key in [k for k in self.fetched if k not in state.host and k not in state.device]:
            self._count("wasted")
            self.fetched.discard(key)

    async def _fetch(self, ticket: Ticket, victim: int) -> None:
        key = ticket.key
        try:
            # An entry vLLM's LRU would not pick (it evicts the oldest, which a request may need):
            # taken out first, so that the load finds it free.
            if victim and (victim in self._needed()   # asked for meanwhile
                           or not await self.tiers.drop(victim, reason="prefetch")):
                return
            await self.tiers.load(ticket.label, "host", reason="prefetch", adapter=ticket.ref)
        except Exception as e:   # noqa: BLE001 - Tiers.load counted and evented it; the step loads it as before
            _log.info("prefetch of %s failed: %s", ticket.label, e)
        else:
            if self.gate.running.get(key) is None:   # not admitted meanwhile (then it was counted late)
                self.fetched.add(key)
            self._count("loaded")
        finally:
            del self.in_flight[key]
            self._blocked = False
            if self.gate.queue:
                self.poke()
