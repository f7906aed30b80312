"""Keeps this daemon's service-registry entry current.

The entry's metadata speaks the seeds' LoRA schema (``lora.enabled``, ``max_loras``,
``max_lora_rank``, ``available_loras`` with their state, ``loaded_loras``,
``capacity.loaded_count`` and ``available_slots``), which is what a router reads to send a
request to the instance that already holds the adapter on device. It is rewritten whenever a
lifecycle event fires, from the engine's true state.
"""

from __future__ import annotations

import asyncio
import logging
import os
from typing import TYPE_CHECKING

from loractl import __version__
from loractl.registry import InstanceHandle, ServiceRegistry
from loractld.events import REQUEST_KINDS

if TYPE_CHECKING:
    from loractld.core import Core

_log = logging.getLogger("loractld.publisher")
NAMESPACE, COMPONENT = "loractl", "loractld"


class Publisher:
    def __init__(self, core: Core, *, home: str | None, socket_path: str) -> None:
        self.core = core
        self.socket_path = socket_path
        self.handle: InstanceHandle = ServiceRegistry(home=home).register_instance(
            NAMESPACE, COMPONENT, metadata=self._base())
        self._task: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None

    def _base(self) -> dict:
        data = {"socket": self.socket_path, "pid": os.getpid(), "version": __version__, "lora": {"enabled": True}}
        if self.core.http_url:
            data["http"] = self.core.http_url  # where OpenAI clients reach this instance
        return data

    async def metadata(self) -> dict:
        core, data = self.core, self._base()
        engine, tiers, catalog = core.engine, core.tiers, core.catalog
        if engine is None or tiers is None or catalog is None:
            return data
        state = tiers.last_state
        stored = await asyncio.to_thread(catalog.store.list)
        # Validated adapters as resolved, the others by their content's id (the background warm-up
        # started with the entry, _warm, validates them and writes the entry again).
        known = catalog.resolver.known(stored)
        available, loaded = [], []
        for adapter in stored:
            ref = known.get(adapter.name)
            if ref is None or isinstance(ref, Exception):   # an invalid adapter is listed as failed
                available.append({"name": adapter.name, "state": "failed", "pinned": False})
                continue
            residency = state.residency(ref if isinstance(ref, int) else ref.engine_id)
            available.append({"name": adapter.name, "state": residency.tier, "pinned": residency.pinned,
                              "pinned_to": residency.pin})
            if residency.tier == "device":
                loaded.append(adapter.name)
        settings = engine.settings
        data.update(model=core.model_label, model_path=settings.model, device=engine.device)
        data["lora"] = {
            "enabled": True, "max_loras": settings.max_loras, "max_cpu_loras": settings.max_cpu_loras,
            "max_lora_rank": settings.max_lora_rank, "available_loras": available, "loaded_loras": loaded,
            "capacity": {"loaded_count": len(state.device), "available_slots": settings.max_loras - len(state.device),
                         "device_pins": len(state.pinned_device)},
        }
        return data

    async def refresh(self) -> None:
        try:
            # The registry write fsyncs the file and its folder: off the event loop, or a slow
            # disk would stall every stream the daemon is serving.
            await asyncio.to_thread(self.handle.set_metadata, await self.metadata())
        except Exception:  # noqa: BLE001 - a registry hiccup must never take serving down
            _log.exception("could not update the registry entry")

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())
        self._warming = asyncio.create_task(self._warm())

    async def _warm(self) -> None:
        """Validate every stored adapter off the loop after READY, not before (10,000 took 6 s of
        start-up), then write the entry again with any that failed."""
        catalog = self.core.catalog
        if catalog is not None:
            stored = await asyncio.to_thread(catalog.store.list)
            await asyncio.to_thread(catalog.resolver.warm, [a.name for a in stored])
            await self.refresh()

    async def _follow(self) -> None:
        queue = self.core.events.subscribe()
        try:
            while True:
                if (await queue.get()).kind in REQUEST_KINDS:
                    continue
                await asyncio.sleep(0.05)  # coalesce a burst of events into one write
                while not queue.empty():
                    queue.get_nowait()
                await self.refresh()
        finally:
            self.core.events.unsubscribe(queue)

    def set_ready(self, ready: bool) -> None:
        self.handle.set_ready(ready)

    def close(self) -> None:
        for task in (self._task, self._warming):
            if task is not None:
                task.cancel()
        self.handle.close()
