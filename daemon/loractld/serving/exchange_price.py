"""What an adapter exchange costs the running engine, in steps: the ``auto`` policy's measure.

From the worker's cumulative clocks (``loractld.worker.exchange_clock``, read with the tier
state): over a window of at least ``MIN_EXCHANGES`` slot copies and ``MIN_STEPS`` steps,

    price = (copy time + disk-load time) per copy / a step's own time (exchanges taken out)

and the price is a moving average of those windows. It is a property of the machine, the model
and the adapters, not of the schedule: a policy that exchanges less sees fewer exchanges, each
costing what it costs, so the price holding measures is the price passthrough would pay
(unlike the share of engine time spent exchanging, which holding itself drives down). Disk
loads count in, per copy: a host-cache miss is part of bringing an adapter in.
"""

from __future__ import annotations

MIN_EXCHANGES = 4
MIN_STEPS = 8
WEIGHT = 0.3   # of each new window in the average


class ExchangePrice:
    def __init__(self) -> None:
        self.price: float | None = None      # steps per exchange; None until a window is complete
        self.step_s: float | None = None     # a step's own time, last window
        self.windows = 0
        self._base: dict | None = None

    def observe(self, costs: dict) -> None:
        """The worker's clocks as just read (cumulative). A restarted engine's start over."""
        if not costs:
            return
        base = self._base
        if base is None or costs.get("steps", 0) < base.get("steps", 0):
            self._base = dict(costs)
            return
        d = {k: costs.get(k, 0) - base.get(k, 0) for k in costs}
        if d.get("exchanges", 0) < MIN_EXCHANGES or d.get("steps", 0) < MIN_STEPS:
            return
        own = (d["step_s"] - d.get("in_step_s", 0.0)) / d["steps"]
        if own > 0:
            sample = (d["exchange_s"] + d.get("load_s", 0.0)) / d["exchanges"] / own
            self.price = sample if self.price is None else self.price + WEIGHT * (sample - self.price)
            self.step_s = own
            self.windows += 1
        self._base = dict(costs)
