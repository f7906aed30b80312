"""``auto``: hold only what the engine cannot hide (issue 58, item 2).

The gate is ``passthrough`` (vLLM's own schedule) while an adapter exchange is cheap against a
step, and ``measured`` (loractl's hand-over rule) while it is not, with hysteresis so that it
does not flap: it starts holding; it passes once the measured exchange price
(:mod:`loractld.serving.exchange_price`: copy + disk-load time per copy, in steps) is at most
``RELEASE``, and holds again once it reaches ``ENGAGE``. A device pin holds under every mode
(the gate's invariant), and the hand-over rule's starvation bound holds while holding.

Where mixing adapters in one step is itself costly, the price of a copy says nothing: loractl's
CPU LoRA ops (``worker/cpu_fixes``) run a step of one adapter as one matmul and a mixed step on
vLLM's per-token path, so on the CPU with its fixes on ``auto`` holds for good (the CPU lead in
docs/benchmarks.md is that). The thresholds are the exchange sweep's (``bench/exchange_sweep.py``,
docs/benchmarks.md "The GPU's regime on a CPU"): passthrough at or ahead of holding at
exchange/step 0.05 and 0.3, holding ahead at 3.
"""

from __future__ import annotations

from collections.abc import Callable

from loractld.serving.admission import DEFAULT_MAX_WAIT_S
from loractld.serving.handover import MeasuredHandover

ENGAGE = 1.0    # steps per exchange: hold from here
RELEASE = 0.5   # and pass again from here down


class Auto(MeasuredHandover):
    name = "auto"

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S, *, price: Callable[[], float | None] = lambda: None,
                 mixing_costly: bool = False) -> None:
        super().__init__(max_wait_s)
        self.price = price
        self.mixing_costly = mixing_costly
        self.engaged = True

    @property
    def holds(self) -> bool:  # type: ignore[override]  (a class attribute on the others)
        if self.mixing_costly:
            return True
        price = self.price()
        if price is not None:
            if self.engaged and price <= RELEASE:
                self.engaged = False
            elif not self.engaged and price >= ENGAGE:
                self.engaged = True
        return self.engaged

    def why(self) -> str:
        """For ``status`` and ``top``: what ``auto`` decided from."""
        if self.mixing_costly:
            return "auto: loractl's CPU LoRA ops make a mixed step cost more than one of one adapter"
        price = self.price()
        if price is None:
            return f"auto: exchange price not measured yet (holding until it is at most {RELEASE} steps)"
        return (f"auto: an exchange costs {price:.2f} steps (passthrough at {RELEASE} or less, "
                f"holding at {ENGAGE} or more)")
