"""loractl's methods on vLLM's worker, reached by name through ``collective_rpc``.

vLLM keeps the two upper tiers itself — ``_registered_adapters`` (host LRU, ``max_cpu_loras``)
and ``_active_adapters`` (device slots, ``max_loras``) in ``LRUCacheLoRAModelManager`` — but
its public API reports only the host tier and cannot move an adapter off the device while
keeping it in host RAM, nor unpin. These methods read and steer the manager directly. They
are attached to ``WorkerBase`` by the ``vllm.general_plugins`` entry point (see
``vllm_plugin``), so the engine calls them by name and no pickled callable ever crosses the
process boundary (no ``VLLM_ALLOW_INSECURE_SERIALIZATION``).

Invariant: every method runs in the engine-core loop between steps (that is how vLLM serves
utility calls), so it never races a forward pass.
"""

from __future__ import annotations

from typing import Any


def _manager(worker: Any):
    runner = getattr(worker, "model_runner", None)
    lora = getattr(runner, "lora_manager", None)
    return getattr(lora, "_adapter_manager", None)


def loractl_lora_state(self) -> dict[str, Any]:
    """The true tier state: host and device ids in LRU order (oldest first), slots, pins."""
    mgr = _manager(self)
    if mgr is None:
        return {"enabled": False}
    host, device = mgr._registered_adapters, mgr._active_adapters
    return {
        "enabled": True,
        "host": list(host.order),
        "device": list(device.order),
        "slots": list(mgr.lora_index_to_id),
        "pinned_host": sorted(host.pinned_items),
        "pinned_device": sorted(device.pinned_items),
        "host_capacity": int(mgr.capacity),
        "device_capacity": int(mgr.lora_slots),
        "host_bytes": {int(i): _lora_bytes(host.cache[i]) for i in host.order},
    }


def _lora_bytes(lora_model: Any) -> int:
    total = 0
    for layer in getattr(lora_model, "loras", {}).values():
        for name in ("lora_a", "lora_b"):
            tensor = getattr(layer, name, None)
            tensors = tensor if isinstance(tensor, (list, tuple)) else [tensor]
            for t in tensors:
                if t is not None and hasattr(t, "element_size"):
                    total += t.element_size() * t.nelement()
    return total


def loractl_deactivate(self, lora_id: int) -> bool:
    """Move an adapter off the device, keeping its host copy. False if it was not on device."""
    mgr = _manager(self)
    if mgr is None:
        return False
    return bool(mgr.deactivate_adapter(lora_id))


def loractl_pin_host(self, lora_id: int) -> bool:
    """Pin an adapter in host RAM only; False if it is not loaded there.

    Not on the device: vLLM's scheduler admits up to max_loras distinct adapters per step
    whatever is pinned, so a device slot held by a pin lets a step of max_loras other
    adapters evict one of its own adapters mid-step and the engine dies (KeyError in
    punica's convert_mapping; seen with max_loras=2 and one device pin). A host pin keeps
    the adapter in RAM, one copy away from a slot, and never blocks a step.
    """
    mgr = _manager(self)
    if mgr is None or lora_id not in mgr._registered_adapters:
        return False
    mgr._registered_adapters.pin(lora_id)
    return True


def loractl_unpin(self, lora_id: int) -> bool:
    """Unpin an adapter in both tiers (vLLM has pin_lora but no unpin)."""
    mgr = _manager(self)
    if mgr is None:
        return False
    changed = False
    for cache in (mgr._registered_adapters, mgr._active_adapters):
        if lora_id in cache.pinned_items:
            cache._unpin(lora_id)
            changed = True
    return changed


METHODS = {f.__name__: f for f in (loractl_lora_state, loractl_deactivate, loractl_pin_host, loractl_unpin)}


def install() -> None:
    from vllm.v1.worker.worker_base import WorkerBase

    for name, method in METHODS.items():
        setattr(WorkerBase, name, method)
