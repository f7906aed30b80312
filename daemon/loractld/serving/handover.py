"""The hand-over rule from measurement: loractld's default admission policy (``measured``).

A hand-over is a device slot changing adapters: the adapter that holds it stops taking new
requests (it *closes*), its requests in the engine finish (the *drain*), and the waiting adapter
gets the place, loads and answers its first token (the *hand-over cost*, ``H``). The gate
measures both as it serves (:class:`~loractld.serving.admission.Measured`): ``H`` from a turn's
first request (grant to first token), the drain from the service time (grant to end) less how
long each request of the closing adapter has run.

The rule, for the oldest request waiting for an adapter that holds no place:

- **When.** Hand over once it has waited as long as a hand-over costs: ``W >= H`` (capped by
  ``--admission-max-wait``, the bound before ``H`` is measured). This is ski rental with the
  engine's time as the price: waiting (renting) costs the waiter, a hand-over (buying) costs
  the engine about ``H`` (the load and prefill in the step every stream shares on a CPU; a
  smaller batch on a GPU). Waiting as long as one hand-over costs, then buying, never pays
  more than twice the better of the two choices made with hindsight (in this cost model). A
  constant bound (``batching``, 0.1 s) is the same rule with a guessed price: about 5x the
  ``H`` measured on this CPU (about 20 ms), more on a GPU (docs/benchmarks.md, on paper).
- **How many close.** One per adapter starving (waited past the bound; a device pin waiting
  counts as one), keeping the busiest active adapter open while more than one is active. With
  ``k`` adapters starving, ``batching`` closes one adapter at a time, so the ``k``-th waits
  ``k`` drains in turn; here the ``k`` drains run at once and each waits about one. On the
  first drawn shapes the rule was run on, the longest gate wait was about three drains under
  both rules (drawn-0: 1.7-2.8 s against a measured service time of 0.53-0.89 s), which is what
  this changes (docs/benchmarks.md).
- **Who closes.** As ``batching``: the active adapters with fewest requests in the engine, a
  proxy for the fewest *victims* (their requests that arrive while they drain and must then
  wait a whole turn); ties go to the one whose drain ends first by the measured service time
  (the largest time left of its requests in the engine), then the oldest turn. Closing the
  adapter whose drain ends first regardless of its load was tried first and dropped: it
  closes the hot adapter whenever its youngest request is older than a cold one's, and its
  clients pay a turn each; on the training shapes its p99 was no better than batching's
  (train-a: 2260 and 2138 ms against 1892 and 1898 ms) and its one train-c round had TTFT p50
  227 ms against batching's 57 and 192 ms (docs/benchmarks.md).
- **Who gets the place.** As ``batching``: the adapter waiting longest past the bound, with
  all its waiting requests at once (one batch, one load), else the one with most waiting.

So a waiter's gate wait is about ``H + drain`` where ``batching`` gave ``bound + k drains``
(with one slot, or more adapters starving than can close, turns still come in order of the
oldest request: a rotation no rule shortens, only more slots).
"""

from __future__ import annotations

from loractld.serving.admission import DEFAULT_MAX_WAIT_S, AdapterBatching, Gate, Measured


class MeasuredHandover(AdapterBatching):
    """``batching`` whose bound is the measured hand-over cost, which closes one adapter per
    starving adapter at once, ties broken by the measured drain (the module's docstring says
    why)."""

    name = "measured"

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        super().__init__(max_wait_s)
        self.measured: Measured | None = None

    def bind(self, gate: Gate) -> None:
        self.measured = gate.measured

    def bound(self) -> float:
        handover = self.measured.handover_s if self.measured is not None else None
        return self.max_wait_s if handover is None else min(self.max_wait_s, handover)

    def closing_set(self, gate: Gate, now: float, starving: int) -> list[int]:
        """One each for the ``starving`` adapters that free places will not take anyway, the
        busiest kept open while more than one is active."""
        short = starving - max(0, gate.free)
        if short <= 0:
            return []
        active = sorted(gate.unpinned_active(), key=lambda k: self._cost(gate, k, now))
        return active[:max(1, min(short, len(active) - 1))]

    def closing(self, gate: Gate, now: float) -> int | None:
        return min(gate.unpinned_active(), key=lambda k: self._cost(gate, k, now), default=None)

    @staticmethod
    def _cost(gate: Gate, key: int, now: float) -> tuple:
        drain = gate.drain_s(key, now)
        return (gate.running[key], drain if drain is not None else 0.0, gate.turn_began[key])
