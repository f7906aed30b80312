"""``auto``: hold only what the engine cannot hide (issue 58, item 2).

Holding requests in front of the engine pays where mixing adapters in one step costs more than
a step of one: loractl's CPU LoRA ops (``worker/cpu_fixes``) run a step of one adapter as one
matmul and a mixed step on vLLM's per-token path (the CPU lead in docs/benchmarks.md is that).
There ``auto`` holds as ``measured``. Everywhere else it is ``passthrough`` (vLLM's own
schedule): in the exchange sweep (``bench/exchange_sweep.py``, docs/benchmarks.md "The GPU's
regime on a CPU": steps padded so that mixing is free, a slot copy costing 0.05-3 steps, a disk
load 0.5-10 steps; measured prices 0.4-10 steps), holding never beat passthrough: at 16 streams
it gave 0.88-0.97x the server's tokens/s where passthrough gave 1.01-1.09x. So the measured
exchange price (:mod:`loractld.serving.exchange_price`) is shown with the mode and exported,
and decides nothing until a run shows a price at which holding pays. A device pin holds under
every mode (the gate's invariant).
"""

from __future__ import annotations

from collections.abc import Callable

from loractld.serving.admission import DEFAULT_MAX_WAIT_S
from loractld.serving.handover import MeasuredHandover


class Auto(MeasuredHandover):
    name = "auto"

    def __init__(self, max_wait_s: float = DEFAULT_MAX_WAIT_S, *, price: Callable[[], float | None] = lambda: None,
                 mixing_costly: bool = False) -> None:
        super().__init__(max_wait_s)
        self.price = price
        self.mixing_costly = mixing_costly

    @property
    def holds(self) -> bool:  # type: ignore[override]  (a class attribute on the others)
        return self.mixing_costly

    def why(self) -> str:
        """For ``status`` and ``top``: what ``auto`` decided from."""
        if self.mixing_costly:
            return "auto: loractl's CPU LoRA ops make a mixed step cost more than one of one adapter"
        price = self.price()
        measured = "not measured yet" if price is None else f"{price:.2f} steps"
        return f"auto: mixing adapters in a step costs nothing extra here; an exchange costs {measured}"
