"""What the tiers hold, as the engine reports it: the engine's protocol for the tier policy
(:class:`loractld.serving.tiers.Tiers`), its state as read from the worker, and one adapter's
residency and usage. Plain data: no policy here."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from loractld.store.identity import AdapterRef

TIERS = ("device", "host", "disk")


class TierEngine(Protocol):
    async def lora_state(self, since: int = -1) -> dict: ...
    async def add_adapter(self, adapter: AdapterRef) -> bool: ...
    async def pin_adapter(self, engine_id: int, *, device: bool = False) -> bool: ...
    async def unpin_adapter(self, engine_id: int, *, keep_host: bool = False) -> bool: ...
    async def deactivate_adapter(self, engine_id: int) -> bool: ...
    async def remove_adapter(self, engine_id: int) -> bool: ...


@dataclass(frozen=True)
class Residency:
    """Where one adapter is; shared, so never changed (:data:`ON_DISK` serves every adapter
    on disk only: a listing of 10,000 asks for 10,000)."""

    tier: str = "disk"
    pinned: bool = False
    slot: int = -1
    host_bytes: int = 0
    pin: str = ""           # "device", "host", or "" (not pinned)


ON_DISK = Residency()


@dataclass
class Usage:
    requests: int = 0
    last_used: float = 0.0
    state: str = "ready"     # loading, ready, failed
    error: str = ""


@dataclass
class EngineState:
    host: list[int] = field(default_factory=list)
    device: list[int] = field(default_factory=list)
    slots: list[int | None] = field(default_factory=list)
    pinned: set[int] = field(default_factory=set)
    pinned_device: set[int] = field(default_factory=set)
    host_bytes: dict[int, int] = field(default_factory=dict)
    host_capacity: int = 0
    device_capacity: int = 0

    @classmethod
    def from_worker(cls, raw: dict) -> EngineState:
        return cls(host=list(raw.get("host", [])), device=list(raw.get("device", [])),
                   slots=list(raw.get("slots", [])), pinned=set(raw.get("pinned_host", [])),
                   pinned_device=set(raw.get("pinned_device", [])),
                   host_bytes={int(k): int(v) for k, v in raw.get("host_bytes", {}).items()},
                   host_capacity=int(raw.get("host_capacity", 0)), device_capacity=int(raw.get("device_capacity", 0)))

    def residency(self, engine_id: int) -> Residency:
        if engine_id in self.device:
            tier = "device"
        elif engine_id in self.host:
            tier = "host"
        else:
            return ON_DISK
        slot = self.slots.index(engine_id) if engine_id in self.slots else -1
        pin = "device" if engine_id in self.pinned_device else "host" if engine_id in self.pinned else ""
        return Residency(tier, bool(pin), slot, self.host_bytes.get(engine_id, 0), pin)
