"""The admission policies by name (``loractld --admission``): :func:`make_policy`.

Apart from ``admission`` (the gate and the simple policies) and ``handover`` (the measured
rule, built on them), so that each of those imports only what is below it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from loractld.serving.admission import (DEFAULT_MAX_WAIT_S, POLICIES, AdapterBatching, AdaptiveBatching, FirstCome,
                                        Passthrough, Policy)
from loractld.serving.auto import Auto
from loractld.serving.handover import MeasuredHandover


@dataclass
class PolicyContext:
    """What a policy that decides from the engine (``auto``) reads: the measured exchange price
    (steps per exchange, None until measured; set once the tiers' reader exists) and whether a
    mixed step costs more than one of one adapter (loractl's CPU LoRA ops)."""

    mixing_costly: bool = False
    price: Callable[[], float | None] = field(default=lambda: None)


def make_policy(name: str, max_wait_s: float = DEFAULT_MAX_WAIT_S, context: PolicyContext | None = None) -> Policy:
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
    if name == "auto":
        context = context or PolicyContext()
        return Auto(max_wait_s, price=lambda: context.price(), mixing_costly=context.mixing_costly)
    raise ValueError(f"unknown admission policy {name!r}; choose one of {', '.join(POLICIES)}")
