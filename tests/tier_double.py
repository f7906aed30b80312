"""The tiers' test bench: the real ``Tiers`` and ``Gate`` in front of an engine double that keeps
vLLM's LoRA cache rules (the real engine cannot be stopped between two awaits of the daemon on
demand), and the check that records, gate and engine agree. Used by the race tests."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

from loractld.events import EventBus, Metrics
from loractld.serving.admission import FirstCome, Gate
from loractld.serving.pins import PersistentState
from loractld.serving.tiers import Tiers


@dataclass(frozen=True)
class Ref:
    label: str
    engine_id: int
    path: Path = Path("/nonexistent")


class Lease:
    def release(self) -> None:
        pass


class Folders:
    """No folders: the engine double loads nothing from disk."""

    def lease(self, path: Path) -> Lease:
        return Lease()


class Resolver:
    def __init__(self, names: list[str]) -> None:
        self.refs = {n: Ref(n, i + 1) for i, n in enumerate(names)}
        self.store = Folders()

    def resolve(self, name: str) -> Ref:
        return self.refs[name]

    def label_of(self, engine_id: int) -> str | None:
        return next((n for n, r in self.refs.items() if r.engine_id == engine_id), None)

    def weights_bytes(self, engine_id: int) -> int:
        return 0    # no files: the exchange metrics count no bytes read from disk


class EngineDouble:
    """vLLM's two LoRA caches as the worker reports them, no model: only what Tiers reads."""

    def __init__(self, max_loras: int, max_cpu_loras: int) -> None:
        self.max_loras, self.max_cpu_loras = max_loras, max_cpu_loras
        self.host: list[int] = []
        self.device: list[int] = []
        self.pinned_host: set[int] = set()
        self.pinned_device: set[int] = set()

    async def lora_state(self, since: int = -1) -> dict:
        await asyncio.sleep(0)
        return {"host": list(self.host), "device": list(self.device), "slots": list(self.device),
                "pinned_host": sorted(self.pinned_host), "pinned_device": sorted(self.pinned_device),
                "host_capacity": self.max_cpu_loras, "device_capacity": self.max_loras, "seq": 0}

    async def add_adapter(self, adapter) -> bool:
        await asyncio.sleep(0)
        for tier in (self.host, self.device):
            if adapter.engine_id not in tier:
                tier.append(adapter.engine_id)
        return True

    async def pin_adapter(self, engine_id: int, *, device: bool = False) -> bool:
        await asyncio.sleep(0)
        if engine_id not in self.host:
            return False
        self.pinned_host.add(engine_id)     # vLLM's device pin pins in both tiers
        if device:
            self.pinned_device.add(engine_id)
        return True

    async def unpin_adapter(self, engine_id: int, *, keep_host: bool = False) -> bool:
        await asyncio.sleep(0)
        if not keep_host:
            self.pinned_host.discard(engine_id)
        self.pinned_device.discard(engine_id)
        return True

    async def deactivate_adapter(self, engine_id: int) -> bool:
        if engine_id in self.device:   # vLLM's LRU cache drops a pin with its entry, silently
            self.device.remove(engine_id)
            self.pinned_device.discard(engine_id)
        return True

    async def remove_adapter(self, engine_id: int) -> bool:
        await self.deactivate_adapter(engine_id)
        if engine_id in self.host:
            self.host.remove(engine_id)
            self.pinned_host.discard(engine_id)
        return True


def make_tiers(tmp_path: Path, *, max_loras: int, max_cpu_loras: int, names=("a", "b", "c")) -> Tiers:
    return Tiers(EngineDouble(max_loras, max_cpu_loras), Resolver(list(names)),
                 PersistentState(tmp_path / "state.json"), EventBus(), Metrics(), Gate(max_loras, FirstCome()),
                 max_loras=max_loras, max_cpu_loras=max_cpu_loras)




def assert_pins_agree(tiers: Tiers) -> None:
    """The records (state.json's pins and the id each holds), the gate's places and the
    engine's pins say the same thing, and the caps hold."""
    held = tiers.held_pins()
    assert set(held) == set(tiers.state.pins) | set(tiers.state.device_pins), (held, tiers.state.pins)
    device = {i for pin, i in held.values() if pin == "device"}
    host = {i for pin, i in held.values() if pin == "host"}
    assert tiers.gate.pinned == device, (tiers.gate.pinned, held)
    assert tiers.engine.pinned_device == device, (tiers.engine.pinned_device, held)
    assert tiers.engine.pinned_host == device | host, (tiers.engine.pinned_host, held)
    assert len(tiers.state.device_pins) <= tiers.max_device_pins and len(tiers.state.pins) <= tiers.max_pins


async def new_revision(tiers: Tiers, name: str, engine_id: int) -> None:
    """A pull of ``name`` installed a new revision, with engine id ``engine_id``."""
    tiers.resolver.refs[name] = Ref(name, engine_id)
