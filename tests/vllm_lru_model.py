"""An independent model of vLLM 0.32's LoRA tiers, written from its source
(lora/worker_manager.py LRUCacheWorkerLoRAManager.add_adapter, lora/model_manager.py
LRUCacheLoRAModelManager, utils/cache.py LRUCache), used as the oracle for residency.

Host tier: an LRU of ``host_slots``; device tier: an LRU of ``device_slots``; evicting from
host also leaves the device. loractl's host pin pins the host tier only; its device pin is
vLLM's pin_lora (both tiers).
"""

from __future__ import annotations


class LruTier:
    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.order: list[str] = []   # oldest first
        self.pinned: set[str] = set()

    def touch(self, x: str) -> None:
        self.order.remove(x)
        self.order.append(x)

    def pop_oldest(self) -> str:
        victim = next(x for x in self.order if x not in self.pinned)
        self.order.remove(victim)
        return victim

    def discard(self, x: str) -> None:
        if x in self.order:
            self.order.remove(x)
        self.pinned.discard(x)


class VllmTiers:
    def __init__(self, device_slots: int, host_slots: int) -> None:
        self.host = LruTier(host_slots)
        self.device = LruTier(device_slots)

    def add(self, x: str) -> None:
        """add_lora, and what each engine step does for a request's adapter."""
        if x not in self.host.order:
            if len(self.host.order) + 1 > self.host.capacity:
                self.device.discard(self.host.pop_oldest())
            self.host.order.append(x)
        else:
            self.host.touch(x)
        self.activate(x)

    def activate(self, x: str) -> None:
        if x not in self.device.order and len(self.device.order) >= self.device.capacity:
            self.device.pop_oldest()
        if x not in self.device.order:
            self.device.order.append(x)
        self.device.touch(x)

    def deactivate(self, x: str) -> None:
        if x in self.device.order and x not in self.device.pinned:
            self.device.order.remove(x)

    def remove(self, x: str) -> None:
        self.device.discard(x)
        self.host.discard(x)

    def pin_host(self, x: str) -> None:
        """loractl's pin: host RAM only (vLLM's pin_lora would also pin the device slot)."""
        self.host.pinned.add(x)

    def pin_device(self, x: str) -> None:
        """vLLM's pin_adapter: pin in host, activate if needed, pin in the device tier."""
        self.host.pinned.add(x)
        self.activate(x)
        self.device.pinned.add(x)

    def unpin(self, x: str) -> None:
        self.host.pinned.discard(x)
        self.device.pinned.discard(x)

    def tier(self, x: str) -> str:
        return "device" if x in self.device.order else "host" if x in self.host.order else "disk"
