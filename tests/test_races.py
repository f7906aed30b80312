"""Races between commands and requests, each held open at its racy point by a test-only pause
(``loractld.testhooks``) rather than left to timing.

The tier races run the real ``Tiers`` and ``Gate`` in front of an engine double (the real
engine cannot be stopped between two awaits of the daemon on demand); the store races run the
real ``Store`` and GC on disk; the request races run a real daemon with a real engine.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from pathlib import Path

import pytest

from loractl.errors import InvalidRequest
from loractld import testhooks
from loractld.events import EventBus, Metrics
from loractld.serving.admission import FirstCome, Gate
from loractld.serving.tiers import PersistentState, Tiers


@dataclass(frozen=True)
class _Ref:
    label: str
    engine_id: int


class _Resolver:
    def __init__(self, names: list[str]) -> None:
        self.refs = {n: _Ref(n, i + 1) for i, n in enumerate(names)}

    def resolve(self, name: str) -> _Ref:
        return self.refs[name]

    def label_of(self, engine_id: int) -> str | None:
        return next((n for n, r in self.refs.items() if r.engine_id == engine_id), None)


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
        (self.pinned_device if device else self.pinned_host).add(engine_id)
        return True

    async def unpin_adapter(self, engine_id: int) -> bool:
        self.pinned_host.discard(engine_id)
        self.pinned_device.discard(engine_id)
        return True

    async def deactivate_adapter(self, engine_id: int) -> bool:
        if engine_id in self.device:
            self.device.remove(engine_id)
        return True

    async def remove_adapter(self, engine_id: int) -> bool:
        await self.deactivate_adapter(engine_id)
        if engine_id in self.host:
            self.host.remove(engine_id)
        return True


def _tiers(tmp_path: Path, *, max_loras: int, max_cpu_loras: int, names=("a", "b", "c")) -> Tiers:
    return Tiers(EngineDouble(max_loras, max_cpu_loras), _Resolver(list(names)),
                 PersistentState(tmp_path / "state.json"), EventBus(), Metrics(), Gate(max_loras, FirstCome()),
                 max_loras=max_loras, max_cpu_loras=max_cpu_loras)


@pytest.mark.parametrize("to", ["host", "device"])
def test_of_two_concurrent_pins_for_the_last_place_exactly_one_wins(tmp_path, to):
    """One host-pin place (max_cpu_loras - max_loras = 1) or one device-pin place (max_loras - 1
    = 1): the first pin is held between its cap check and its record, the second runs into the
    gap. Before the fix both succeeded (a host full of pins kills the engine; two device pins
    left no place for unpinned adapters)."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with testhooks.armed("pin-claimed") as point:
            first = asyncio.ensure_future(tiers.pin("a", to))
            await point.until_reached()
            with pytest.raises(InvalidRequest, match=f"of at most 1 {to if to == 'host' else 'device'} pins"):
                await tiers.pin("b", to)
            point.release()
            await first
        pins = tiers.state.pins if to == "host" else tiers.state.device_pins
        assert pins == ["a"]
        assert PersistentState(tmp_path / "state.json").pin_of("a") == to
        if to == "device":
            assert tiers.gate.pinned == {1} and tiers.gate.free == 1
    asyncio.run(go())


def test_saved_pins_beyond_the_caps_are_dropped_at_start_and_ready_comes(tmp_path):
    """state.json from a daemon with larger caps: the start keeps the first pins that fit, drops
    the rest with a warning and an event, and never waits in the gate (before the fix,
    apply_startup waited in gate.reserve for ever with more device pins than places)."""
    state = PersistentState(tmp_path / "state.json")
    state.device_pins, state.pins = ["a", "b", "c"], ["d"]   # 3 device pins: more than the 2 places
    state.save()

    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=2, names=("a", "b", "c", "d"))  # caps: 1 device, 0 host
        events = tiers.events.subscribe()
        failures = await asyncio.wait_for(tiers.apply_startup([]), timeout=10)
        assert tiers.state.device_pins == ["a"] and tiers.state.pins == []
        assert [f.split(":")[0] for f in failures] == ["pin b", "pin c", "pin d"]
        assert all("dropped" in f for f in failures)
        dropped = [events.get_nowait() for _ in range(events.qsize())]
        assert {(e.kind, e.adapter) for e in dropped} >= {("FAILED", "b"), ("FAILED", "c"), ("FAILED", "d")}
        assert tiers.gate.pinned == {1} and tiers.gate.free == 1
        saved = PersistentState(tmp_path / "state.json")
        assert (saved.device_pins, saved.pins) == (["a"], [])
    asyncio.run(go())


def test_a_cancelled_load_does_not_stay_loading(tmp_path):
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        started = asyncio.Event()

        async def slow_add(adapter):
            started.set()
            await asyncio.sleep(30)
        tiers.engine.add_adapter = slow_add
        load = asyncio.ensure_future(tiers.load("a"))
        await started.wait()
        load.cancel()
        with pytest.raises(asyncio.CancelledError):
            await load
        assert tiers.usage["a"].state == "ready"
    asyncio.run(go())
