"""The registry entry's adapter list (loractld.publisher) after pulls and removals: equal to the
store's listing every time, without listing the store per event (issue 48: with 10,000 adapters
each pull and rm was followed by a listing of all of them on the cores of the next pull), and a
change by hand shows once the events go quiet.

The publisher runs on the real store, resolver, event bus and registry; the engine is not
started (the entry reads only its settings, its device and the tiers' last state: nothing
loaded here)."""

from __future__ import annotations

import asyncio
import os
import shutil
import time
from types import SimpleNamespace

from loractl.registry import ServiceDiscovery
from loractld.engine.client import EngineSettings
from loractld.events import Event, EventBus
from loractld.lifecycle import DaemonSettings, open_catalog
from loractld.publisher import IDLE_S, NAMESPACE, COMPONENT, Publisher
from loractld.serving.residency import EngineState
from loractld.store.disk import Store


def _install(store: Store, source, name: str) -> None:
    with store.staging() as staged:
        shutil.copytree(source, staged, dirs_exist_ok=True)
        store.install(name, staged, {"files": [{"name": n, "size": (staged / n).stat().st_size,
                                                "sha256": "0" * 64} for n in os.listdir(staged)]})


def test_the_entry_follows_pulls_and_removals_without_listing_the_store(tmp_path, demo):
    # a started engine's settings hold its slots (None in EngineSettings means "chosen at start")
    settings = DaemonSettings(engine=EngineSettings(model=str(demo / "model"), max_loras=2, max_cpu_loras=4))
    catalog = open_catalog(settings, tmp_path / "adapters", str(demo / "model"))
    source = demo / "adapters" / "poet" / "v1"
    for name in ("a", "b"):
        shutil.copytree(source, catalog.store.root / "org" / name)
    core = SimpleNamespace(catalog=catalog, events=EventBus(), http_url="", model_label="tiny",
                           engine=SimpleNamespace(settings=settings.engine, device="cpu"),
                           tiers=SimpleNamespace(last_state=EngineState()))

    async def nothing_checked_in_background() -> bool:   # as Core's, with no listing left to check
        return False
    core.checked_in_background = nothing_checked_in_background
    listings = []
    real_list = catalog.store.list
    catalog.store.list = lambda: listings.append(1) or real_list()   # counts, lists as before

    def entry() -> list[str]:
        (instance,) = ServiceDiscovery(home=str(tmp_path)).list_instances(NAMESPACE, COMPONENT)
        return [a["name"] for a in instance.metadata().get("lora", {}).get("available_loras", [])]

    def stored() -> list[str]:
        return [a.name for a in Store(catalog.store.root).list()]

    async def until(want: list[str], within: float) -> None:
        deadline = time.monotonic() + within
        while entry() != want:
            assert time.monotonic() < deadline, (entry(), want)
            await asyncio.sleep(0.05)

    async def scenario() -> None:
        publisher = Publisher(core, home=str(tmp_path), socket_path=str(tmp_path / "d.sock"))
        await publisher.refresh()   # as loractld.lifecycle does before READY
        publisher.start()
        try:
            await until(["org/a", "org/b"], 30)
            await asyncio.sleep(0.3)
            before = len(listings)
            for i in range(3):                                  # pull, rm, pull, rm, pull
                _install(catalog.store, source, f"pulled/p{i}")
                core.events.publish(Event("DOWNLOADED_TO_DISK", f"pulled/p{i}"))
                await until(stored(), 10)
                if i < 2:
                    catalog.store.remove(f"pulled/p{i}")
                    core.events.publish(Event("DELETED_FROM_DISK", f"pulled/p{i}"))
                    await until(stored(), 10)
            core.events.publish(Event("LOADED_TO_HOST", "org/a"))   # a residency event
            await asyncio.sleep(0.5)
            assert entry() == ["org/a", "org/b", "pulled/p2"]
            assert len(listings) == before, "the store was listed for a pull, an rm or a residency event"
            shutil.copytree(source, catalog.store.root / "org" / "hand")   # placed by hand: no event
            await until(["org/a", "org/b", "org/hand", "pulled/p2"], IDLE_S + 10)
            assert len(listings) > before   # the listing owed once the events went quiet
        finally:
            publisher.close()

    asyncio.run(scenario())
