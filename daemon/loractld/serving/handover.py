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
- **Who closes.** As ``batching``: the active adapter with fewest requests in the engine, a
  proxy for the fewest *victims* (its requests that arrive while it drains and must then wait
  a whole turn); ties go to the one whose drain ends first by the measured service time (the
  largest time left of its requests in the engine), then the oldest turn. Closing the adapter
  whose drain ends first regardless of its load was measured and rejected: it closes the hot
  adapter whenever its youngest request is older than a cold one's, and its clients pay
  (training shape train-c: TTFT p50 4x batching's, p99 no better; docs/benchmarks.md).
- **Who gets the place.** As ``batching``: the adapter waiting longest past the bound, with
  all its waiting requests at once (one batch, one load), else the one with most waiting.

So a waiter's gate wait is bounded by ``H + drain`` where a constant bound gave
``bound + drain``; the drain (one answer's time at most) is what remains, and where several
adapters wait, their turns in order of their oldest request.
"""

from __future__ import annotations

from loractld.serving.admission import DEFAULT_MAX_WAIT_S, AdapterBatching, Gate, Measured


class MeasuredHandover(AdapterBatching):
    """``batching`` whose bound is the measured hand-over cost, ties among closing adapters
    broken by the measured drain (the module's docstring says why)."""

    name = "measured"

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> None:
        super().__init__(max_wait_s)
        self.measured: Measured | None = None
        self.gate: Gate | None = None

    def bind(self, gate: Gate) -> None:
        self.gate, self.measured = gate, gate.measured

    def bound(self) -> float:
        handover = self.measured.handover_s if self.measured is not None else None
        return self.max_wait_s if handover is None else min(self.max_wait_s, handover)

    def closing(self, gate: Gate, now: float) -> int | None:
        def cost(k: int) -> tuple:
            drain = gate.drain_s(k, now)
            return (gate.running[k], drain if drain is not None else 0.0, gate.turn_began[k])
        return min(gate.unpinned_active(), key=cost, default=None)
