"""Every engine request's way in and out: the drain, the engine's keep-alive hold, the admission
gate, the tiers' activity marks, and what is measured as it runs (its wait, its tokens, its first
token). The engine's serving surface (``engine.openai_serving``) runs each engine request inside
:meth:`Admission.request` and reports its tokens to :meth:`Admission.generated`.

Invariants:
- A request enters the gate only while the daemon is not draining, as in-flight work (drained
  on shutdown) and inside the engine's keep-alive hold (woken if asleep; no sleep until it
  ends); it leaves the gate however it ends.
- Nothing here calls the core: the core builds an :class:`Admission` from parts it owns (the
  gate, the tiers, the metrics and events, the work in flight) and hands it down; a request's
  calls flow down from the door (tests/test_layout.py checks the wiring).
- Single-threaded: every method runs on the daemon's event loop.
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from loractl.errors import EngineUnavailable
from loractld.events import Event, EventBus, Metrics
from loractld.serving.admission import WAIT_BUCKETS, Gate, Ticket, TicketLabel

if TYPE_CHECKING:
    from loractld.serving.inflight import InFlight
    from loractld.serving.keep_alive import KeepAlive
    from loractld.serving.tiers import Tiers


class Admission:
    def __init__(self, gate: Gate, tiers: Tiers, metrics: Metrics, events: EventBus, work: InFlight) -> None:
        self.gate = gate
        self.tiers = tiers
        self.metrics = metrics
        self.events = events
        self.work = work
        self.keep_alive: KeepAlive | None = None   # --keep-alive's, once started (the daemon sets it)
        self.serving: collections.Counter[str] = collections.Counter()   # store name -> its requests running
        gate.on_admit = self.admitted

    def hold(self):
        """``async with``: the body uses the engine, which is awake for it and does not fall
        asleep (``--keep-alive``) before it ends."""
        return self.keep_alive.hold() if self.keep_alive is not None else contextlib.nullcontext()

    @contextlib.asynccontextmanager
    async def request(self, adapter, name: str | None) -> AsyncIterator[TicketLabel]:
        """The body runs as one engine request for ``adapter`` (an ``AdapterRef``; None: the base
        model), counted as serving ``name``: drained on shutdown and behind the admission gate,
        which it leaves however it ends. Yields the metrics label of the adapter (``loractl
        top``'s tokens/s). The caller holds the adapter's lease for at least as long."""
        if self.work.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        tiers, gate = self.tiers, self.gate
        label_name = name or (adapter.label if adapter else "")
        tiers.note_request(label_name)
        if name:
            self.serving[name] += 1   # an rm of the name waits for it (Core.remove)
        if adapter:
            tiers.note_activity()  # the tier follower reports the lazy load, if any, soon
        ticket = None
        try:
            with self.work.tracked("the daemon is shutting down; the generation was stopped"):
                async with self.hold():
                    ticket = await gate.enter(adapter.engine_id if adapter else None, label_name, adapter)
                    label = TicketLabel((("adapter", ticket.label),))
                    label.ticket = ticket
                    yield label
        finally:
            if ticket is not None:
                gate.finish(ticket)
            if name:
                self.serving[name] -= 1
            if adapter:
                tiers.note_activity()

    def admitted(self, ticket: Ticket) -> None:
        """The gate let ``ticket`` into the engine: observe its wait; tell who waited; note where
        its adapter is (as last read, no read now), so its first token says how long it then
        waited for the adapter's load (:meth:`generated`)."""
        if ticket.key is None:
            return
        tier = self.tiers.last_state.residency(ticket.key).tier
        ticket.load_from = "" if tier == "device" else tier
        self.metrics.observe("loractl_admission_wait_seconds", (("adapter", ticket.label),), ticket.wait_s,
                             buckets=WAIT_BUCKETS)
        if ticket.waited:
            self.events.publish(Event("WAITED_FOR_SLOT", ticket.label, reason="admission",
                                      message=f"request {ticket.id} waited {ticket.wait_s:.3f} s for a device slot"))

    def generated(self, label: tuple, tokens: int) -> None:
        """``tokens`` more were generated under ``label``; the first tells the gate when its
        request's first token came."""
        self.metrics.inc("loractl_adapter_generated_tokens_total", label, tokens)
        ticket = getattr(label, "ticket", None)   # a TicketLabel: the gate measures the first token
        if tokens and ticket is not None:
            first = ticket.first_token is None
            self.gate.first_token(ticket)   # once: it ignores a ticket that had its first token
            if first and ticket.load_from and ticket.first_token is not None:
                # Admission to first token of a request whose adapter had to come to the device:
                # its load (and its prefill), what thrash costs a request past the gate.
                self.metrics.observe("loractl_adapter_load_wait_seconds", (("from", ticket.load_from),),
                                     ticket.first_token - ticket.admitted, buckets=WAIT_BUCKETS)
