"""What adapter exchanges cost the engine, timed in the worker where they happen (issue 58, item 2).

Cumulative, per worker process, read with the tier state (``loractl_lora_state``'s ``costs``):

- ``steps`` / ``step_s``: the steps that ran the model, and their wall time (the worker's
  ``execute_model``, exchanges inside it included);
- ``exchanges`` / ``exchange_s``: copies of an adapter into a device slot (``activate_adapter``
  that did copy), and their time;
- ``loads`` / ``load_s``: loads of an adapter from its files (``_load_adapter``);
- ``in_step_s``: the part of the two above spent inside a step, so that a step's own time is
  ``step_s - in_step_s``.

On a GPU a slot copy is launched, not waited for (a non-blocking copy from pinned memory): its
host time is the launch, and what the copy itself costs shows in the steps. That is the point:
the daemon weighs what the engine could not hide. Two ``perf_counter`` calls per step and per
exchange; no lock (one worker thread).
"""

from __future__ import annotations

import functools
import time

COSTS: dict[str, float] = {"steps": 0, "step_s": 0.0, "exchanges": 0, "exchange_s": 0.0, "loads": 0,
                           "load_s": 0.0, "in_step_s": 0.0}
_in_step = False


def charge(kind: str, seconds: float) -> None:
    """One exchange (``"exchange"``) or load (``"load"``) that took ``seconds``."""
    COSTS[f"{kind}s"] += 1
    COSTS[f"{kind}_s"] += seconds
    if _in_step:
        COSTS["in_step_s"] += seconds


def timed_steps(execute_model):
    """``execute_model`` timed when it runs the model (a step with no scheduled token is not one)."""
    @functools.wraps(execute_model)
    def wrapper(self, scheduler_output, *args, **kwargs):
        global _in_step
        if scheduler_output is None or not getattr(scheduler_output, "total_num_scheduled_tokens", 0):
            return execute_model(self, scheduler_output, *args, **kwargs)
        began, _in_step = time.perf_counter(), True
        try:
            return execute_model(self, scheduler_output, *args, **kwargs)
        finally:
            _in_step = False
            COSTS["steps"] += 1
            COSTS["step_s"] += time.perf_counter() - began

    return wrapper


def snapshot() -> dict[str, float]:
    return dict(COSTS)
