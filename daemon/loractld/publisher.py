"""Keeps this daemon's service-registry entry current.

The entry's metadata speaks the seeds' LoRA schema (``lora.enabled``, ``max_loras``,
``max_lora_rank``, ``available_loras`` with their state, ``loaded_loras``,
``capacity.loaded_count`` and ``available_slots``), which is what a router reads to send a
request to the instance that already holds the adapter on device. It is rewritten when a
lifecycle event changes it, from the engine's true state.

Its cost stays off the store's operations at 10,000 adapters (issue 48: pull number 10,001 took
1.4-1.9x the first while the entry was rewritten from a listing of every adapter after each pull
and rm, on the same cores as the next pull). Invariants: a pull or rm (``DOWNLOADED_TO_DISK``,
``DELETED_FROM_DISK``) changes only the names it names in the adapters' list (read with
``Store.get``, dropped where the store no longer has them), a residency event only their states
(the engine's state is read afresh every time); the store is listed again (``Store.list``) at
start-up, after validation, once the events have been quiet for :data:`IDLE_S` after such a
change, and on the next event once the list is :data:`FULL_EVERY_S` behind, so the entry ends
equal to a full listing, and an adapter placed or removed by hand shows as before, within
seconds of an event. An entry equal to the one last written is not written again, and a burst
of events waits twice what the last write took (a burst of pulls gets at least two thirds of
the daemon's time), or a dropped event (a full queue) lists the store again.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import TYPE_CHECKING

from loractl import __version__
from loractl.errors import LoractlError
from loractl.registry import InstanceHandle, ServiceRegistry
from loractld.events import REQUEST_KINDS

if TYPE_CHECKING:
    from loractld.core import Core

_log = logging.getLogger("loractld.publisher")
NAMESPACE, COMPONENT = "loractl", "loractld"
STORE_KINDS = ("DOWNLOADED_TO_DISK", "DELETED_FROM_DISK")   # events that name what the store changed
IDLE_S = 2.0          # quiet this long after changes by name: list the store again
FULL_EVERY_S = 30.0   # changes by name for longer than this: the next event lists the store


class Publisher:
    def __init__(self, core: Core, *, home: str | None, socket_path: str) -> None:
        self.core = core
        self.socket_path = socket_path
        self.handle: InstanceHandle = ServiceRegistry(home=home).register_instance(
            NAMESPACE, COMPONENT, metadata=self._base())
        self._task: asyncio.Task | None = None
        self._warming: asyncio.Task | None = None
        self._stored: list | None = None   # the store's adapters as the entry last listed them, by name
        self._owed_since: float | None = None   # changed by name since this time, not listed since
        self._written: dict | None = None  # the metadata last written
        self._cost = 0.0                   # seconds the last refresh took
        self._one_at_a_time = asyncio.Lock()   # the warm-up's and the events' refreshes: in order

    def _base(self) -> dict:
        data = {"socket": self.socket_path, "pid": os.getpid(), "version": __version__, "lora": {"enabled": True}}
        if self.core.http_url:
            data["http"] = self.core.http_url  # where OpenAI clients reach this instance
        return data

    def _listing(self, changed: set[str] | None) -> list:
        """The store's adapters, by name: listed afresh (``changed`` None, nothing kept, or changes
        by name for :data:`FULL_EVERY_S` already), else the kept list with only ``changed`` read
        again (see the module)."""
        store = self.core.catalog.store
        now = time.monotonic()
        if changed is not None and self._stored is not None and \
                (self._owed_since is None or now - self._owed_since < FULL_EVERY_S):
            by_name = {a.name: a for a in self._stored}
            try:
                for name in changed:
                    if store.has(name):
                        by_name[name] = store.get(name)
                    else:
                        by_name.pop(name, None)
            except LoractlError:   # damaged or refused: the listing says how (listed as failed)
                pass
            else:
                self._stored = sorted(by_name.values(), key=lambda a: a.name)
                self._owed_since = self._owed_since or now
                return self._stored
        self._owed_since = None
        self._stored = store.list()
        return self._stored

    async def metadata(self, changed: set[str] | None = None) -> dict:
        """This instance's entry; ``changed``: the store names the events since the last entry
        named (None: list the store)."""
        core, data = self.core, self._base()
        engine, tiers, catalog = core.engine, core.tiers, core.catalog
        if engine is None or tiers is None or catalog is None:
            return data
        state = tiers.last_state
        stored = await asyncio.to_thread(self._listing, changed)
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

    async def refresh(self, changed: set[str] | None = None) -> None:
        async with self._one_at_a_time:   # else an older entry could be written last
            began = time.monotonic()
            try:
                data = await self.metadata(changed)
                if data != self._written:
                    # The registry write fsyncs the file and its folder: off the event loop, or a
                    # slow disk would stall every stream the daemon is serving.
                    await asyncio.to_thread(self.handle.set_metadata, data)
                    self._written = data
            except Exception:  # noqa: BLE001 - a registry hiccup must never take serving down
                _log.exception("could not update the registry entry")
            self._cost = time.monotonic() - began

    def start(self) -> None:
        self._task = asyncio.create_task(self._follow())
        self._warming = asyncio.create_task(self._warm())

    async def _warm(self) -> None:
        """The entry written before READY lists adapters not validated yet by their content's id
        (``resolver.known``): once the background validation that start-up's listing left
        (``DiskOps.warm_in_background``; 10,000 new adapters take 6 s) is done, it is written
        again with any that failed."""
        if await self.core.checked_in_background():
            await self.refresh()

    async def _follow(self) -> None:
        queue = self.core.events.subscribe()
        try:
            while True:
                try:
                    event = await asyncio.wait_for(queue.get(), IDLE_S if self._owed_since is not None else None)
                except TimeoutError:
                    await self.refresh()   # quiet now: the full listing owed (see the module)
                    continue
                if event.kind in REQUEST_KINDS:
                    continue
                # Coalesce a burst of events into one write, and bound its share of the daemon.
                await asyncio.sleep(max(0.05, 2 * self._cost))
                events = [event]
                while not queue.empty():
                    events.append(queue.get_nowait())
                full = len(events) >= queue.maxsize - 1   # the queue may have dropped some
                await self.refresh(None if full else {e.adapter for e in events if e.kind in STORE_KINDS})
        finally:
            self.core.events.unsubscribe(queue)

    def set_ready(self, ready: bool) -> None:
        self.handle.set_ready(ready)

    def close(self) -> None:
        for task in (self._task, self._warming):
            if task is not None:
                task.cancel()
        self.handle.close()
