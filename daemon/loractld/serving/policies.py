"""The admission policies by name (``loractld --admission``): :func:`make_policy`.

Apart from ``admission`` (the gate and the simple policies) and ``handover`` (the measured
rule, built on them), so that each of those imports only what is below it.
"""

from __future__ import annotations

from loractld.serving.admission import (DEFAULT_MAX_WAIT_S, POLICIES, AdapterBatching, AdaptiveBatching, FirstCome,
                                        Passthrough, Policy)
from loractld.serving.handover import MeasuredHandover


def make_policy(name: str, max_wait_s: float = DEFAULT_MAX_WAIT_S) -> Policy:
    if name == "first-come":
        return FirstCome()
    if name == "batching":
        return AdapterBatching(max_wait_s)
    if name == "adaptive":
        return AdaptiveBatching(max_wait_s)
    if name == "measured":
        return MeasuredHandover(max_wait_s)
    if name == "passthrough":
        return Passthrough(max_wait_s)
    raise ValueError(f"unknown admission policy {name!r}; choose one of {', '.join(POLICIES)}")
