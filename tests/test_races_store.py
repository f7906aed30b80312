"""Races of the store and of Core's rm and pull: leases, installs in flight and GC on disk (the real
``Store``), and rm/pull whose caller goes away or that meet each other (a Core over the real Store,
in front of ``tier_double.EngineDouble``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from pathlib import Path

import pytest

from loractl.errors import InvalidRequest
from loractld.serving.admission import FirstCome, Gate
from loractld.serving.pins import PersistentState
from loractld.serving.tiers import Tiers

from loractl_test_hooks import armed
from tier_double import EngineDouble, Ref, assert_pins_agree, make_tiers, new_revision


# -- the store: leases, installs in flight and GC, on disk ---------------------------------------
def _stage_and_install(store, name: str, content: bytes):
    """Install an adapter-shaped folder (the store does not validate; the puller does)."""
    import hashlib

    with store.staging() as staged:
        files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": content}
        for fname, data in files.items():
            (staged / fname).write_bytes(data)
        records = [{"name": f, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for f, d in files.items()]
        # Recorded as pulled from the test source (test://NAME), so that a pull of a new revision
        # from there is an update, not another source onto a taken name (refused since issue 60).
        return store.install(name, staged, {"name": name, "source": "test", "ref": f"test://{name}", "revision": "r",
                                            "files": records})


def test_a_gc_during_an_install_leaves_the_new_object_alone(tmp_path):
    """A GC (from an rm, a request ending, another pull) between the install's rename into
    .objects/ and its link swap: before the fix it deleted the object as unreferenced, the pull
    failed with FileNotFoundError and left the name a dangling link."""
    from concurrent.futures import ThreadPoolExecutor

    from loractld.store.disk import Store

    store = Store(tmp_path / "adapters")
    with ThreadPoolExecutor(1) as pool, armed("store-installed") as point:
        installing = pool.submit(_stage_and_install, store, "fresh", b"weights")
        point.wait_reached()
        assert store.collect_garbage() == []
        point.release()
        installed = installing.result(timeout=30)
    assert (installed.path / "adapter_model.safetensors").read_bytes() == b"weights"
    assert [a.name for a in store.list()] == ["fresh"]


def test_rm_and_a_replacing_install_keep_a_leased_folder_until_its_lease_goes(tmp_path):
    """What a request that resolved its adapter holds (its lease) survives an rm and a new
    revision, and goes when the lease does; an unleased one goes at once."""
    from loractld.store.disk import Store

    store = Store(tmp_path / "adapters")
    old = _stage_and_install(store, "a/v1", b"one")
    lease = store.lease(old.path)
    new = _stage_and_install(store, "a/v1", b"two")         # a replacing pull
    store.collect_garbage()
    assert old.path.is_dir() and new.path.is_dir()
    lease.release()
    assert not old.path.exists()                             # retired, unleased: deleted
    lease = store.lease(new.path)
    store.remove("a/v1")                                     # rm between resolve and run
    assert new.path.is_dir()
    store.collect_garbage()
    assert new.path.is_dir()
    del lease                                                # prepared and never run: dropped
    assert not new.path.exists()
    assert list(store.objects.iterdir()) == []


def test_an_unreadable_manifest_costs_that_adapter_only(tmp_path, caplog):
    from loractl.errors import InvalidAdapter
    from loractld.store.disk import MANIFEST_FILE, Store

    store = Store(tmp_path / "adapters")
    good = _stage_and_install(store, "good/v1", b"one")
    bad = _stage_and_install(store, "bad/v1", b"two")
    (bad.path / MANIFEST_FILE).write_text("{not json")
    store = Store(tmp_path / "adapters")                     # a restart
    with caplog.at_level("WARNING", logger="loractld.store"):
        store.recover()
        listed = {a.name: a for a in store.list()}
        store.list()
    assert sorted(listed) == ["bad/v1", "good/v1"] and "damaged" in listed["bad/v1"].manifest
    assert len([r for r in caplog.records if "damaged" in r.getMessage()]) == 1
    assert bad.path.is_dir() and good.path.is_dir()          # set aside, not collected
    with pytest.raises(InvalidAdapter, match="damaged"):
        store.get("bad/v1")
    store.remove("bad/v1")
    assert [a.name for a in store.list()] == ["good/v1"] and not bad.path.exists()


# -- rm and pull on a Core over the real Store, in front of the engine double -----------------------
def _core(tmp_path: Path, sources=()):
    """A Core over a real Store and resolver, with the tiers and gate in front of EngineDouble."""
    from loractld.core import Catalog, Core
    from loractld.store.disk import Store
    from loractld.store.identity import AdapterResolver
    from loractld.store.pulls import Puller
    from loractld.store.validate import AdapterFacts

    store = Store(tmp_path / "adapters")
    validate = lambda path, forced: AdapterFacts(8, 16.0, ["q_proj"], None)  # noqa: E731
    resolver = AdapterResolver(store, validate)
    engine = EngineDouble(2, 3)
    engine.errored = False
    core = Core(socket_path=str(tmp_path / "sock"), home=str(tmp_path))
    tiers = Tiers(engine, resolver, PersistentState(tmp_path / "state.json"), core.events, core.metrics,
                  Gate(2, FirstCome()), max_loras=2, max_cpu_loras=3)
    core.set_catalog(Catalog(store, resolver, Puller(store, list(sources), validate), base_model=None))
    core.set_engine(engine, tiers)
    return core, store, tiers


def _test_source(revision: str):
    """A source whose adapter's content is ``revision``'s (a valid safetensors header)."""
    import struct

    from loractld.store.sources import AdapterSource, RemoteFile, Resolved

    header = json.dumps({"__metadata__": {"revision": revision}}).encode()
    files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": struct.pack("<Q", len(header)) + header}

    class Source(AdapterSource):
        name = "test"

        def accepts(self, ref: str) -> bool:
            return ref.startswith("test://")

        def resolve(self, ref, revision_, *, token, endpoint) -> Resolved:
            return Resolved(source=self.name, ref=ref, revision=revision * 40, default_name="a",
                            files=[RemoteFile(n, len(d)) for n, d in files.items()])

        def download_to_disk(self, resolved, dest: Path, progress, cancel, *, token, endpoint) -> None:
            for n, d in files.items():
                (dest / n).write_bytes(d)
    return Source()


async def _drained(core, tiers) -> None:
    for _ in range(200):
        await asyncio.sleep(0.01)
        if not getattr(core, "_after_installs", None) and not tiers._finishing:
            return


async def _pull_to_the_end(core, name: str) -> None:
    """A client of ``loractl pull``: reads the pull's events until it ends."""
    async with contextlib.aclosing(core.pull(f"test://{name}", name=name)) as stream:
        async for _ in stream:
            pass


def _events(queue) -> list:
    return [(e.kind, e.adapter) for e in (queue.get_nowait() for _ in range(queue.qsize()))]


# -- rm whose caller goes away -----------------------------------------------------------------------
def test_an_rm_whose_caller_goes_away_mid_way_still_unpins_and_announces_it(tmp_path):
    """``rm --force`` of a device-pinned adapter, cancelled (Ctrl-C, a deadline) while the store
    removes its name. Before the fix the name was gone from disk but its device pin stayed
    recorded, with its gate place and engine pin (held for good: one place fewer for every
    other adapter, and a pin of a name that no longer exists), and no DELETED_FROM_DISK was
    published (a router's registry, fed by the events, kept advertising the adapter)."""
    import threading

    async def go():
        core, store, tiers = _core(tmp_path)
        _stage_and_install(store, "a", b"weights")
        await tiers.pin("a", "device")
        events = core.events.subscribe()
        removing, go_on = threading.Event(), threading.Event()
        real_remove = store.remove

        def slow_remove(name, **kwargs):
            removing.set()
            go_on.wait(10)
            return real_remove(name, **kwargs)
        store.remove = slow_remove
        rm = asyncio.ensure_future(core.remove("a", force=True))
        await asyncio.to_thread(removing.wait, 10)
        rm.cancel()                                       # the caller goes away mid-way
        go_on.set()
        with contextlib.suppress(asyncio.CancelledError):
            await rm
        await _drained(core, tiers)
        assert [a.name for a in store.list()] == []
        assert tiers.state.device_pins == [] and tiers.gate.pinned == set() and tiers.gate.free == 2
        assert_pins_agree(tiers)
        assert ("DELETED_FROM_DISK", "a") in _events(events)
    asyncio.run(go())


def test_a_pull_whose_caller_goes_away_during_the_install_still_announces_it_and_moves_the_pin(tmp_path):
    """A new revision of device-pinned "a" is being installed (held at the store's
    "store-installed" point) when the pull's caller goes away. The install stands; before the
    fix nothing that follows an install happened: no DOWNLOADED_TO_DISK (a router's registry
    never heard of it), the pin stayed on the old revision with no 'pin not moved' event, and
    the old revision stayed in the engine."""
    async def go():
        core, store, tiers = _core(tmp_path, [_test_source("2")])
        _stage_and_install(store, "a", b"revision one")
        old_id = tiers.resolver.resolve("a").engine_id
        await tiers.pin("a", "device")
        events = core.events.subscribe()

        with armed("store-installed") as point:
            pull = asyncio.ensure_future(_pull_to_the_end(core, "a"))
            await point.until_reached()
            pull.cancel()                                  # the caller goes away during the install
            await asyncio.sleep(0.05)
            point.release()
            with contextlib.suppress(asyncio.CancelledError):
                await pull
        await _drained(core, tiers)
        new_id = tiers.resolver.resolve("a").engine_id
        assert new_id != old_id
        assert ("DOWNLOADED_TO_DISK", "a") in _events(events)
        assert tiers.held_pins() == {"a": ("device", new_id)}
        assert_pins_agree(tiers)
        assert old_id not in tiers.engine.host
    asyncio.run(go())


def test_an_rm_during_a_pull_of_the_same_name_is_refused_and_the_events_end_as_the_disk_does(tmp_path):
    """A new revision of "a" is between its object's install and its link swap when ``rm a``
    comes. Before the fix the rm went through: it unlinked the old revision, the pull then
    linked the new one and announced it, and the rm, still busy in the engine, announced
    DELETED_FROM_DISK after that: "a" stood on disk while a registry fed by the events
    withdrew it. Now the rm is refused while the name is being pulled (and a pull of a name
    being removed waits for the rm)."""
    async def go():
        core, store, tiers = _core(tmp_path, [_test_source("2")])
        _stage_and_install(store, "a", b"revision one")
        await tiers.load("a")
        events = core.events.subscribe()
        released, hold = asyncio.Event(), asyncio.Event()
        real_remove_adapter = tiers.engine.remove_adapter

        async def remove_adapter(engine_id):                # the rm, busy in the engine for a while
            if not released.is_set():
                await hold.wait()
            return await real_remove_adapter(engine_id)
        tiers.engine.remove_adapter = remove_adapter

        with armed("store-installed") as point:
            pull = asyncio.ensure_future(_pull_to_the_end(core, "a"))
            await point.until_reached()
            rm = asyncio.ensure_future(core.remove("a"))
            await asyncio.wait([rm], timeout=0.5)            # refused at once, or busy in the engine
            released.set()
            point.release()
            await asyncio.wait_for(pull, timeout=10)
        hold.set()
        with contextlib.suppress(InvalidRequest):
            await asyncio.wait_for(rm, timeout=10)
        await _drained(core, tiers)
        on_disk = "a" in [x.name for x in store.list()]
        last = [k for k, n in _events(events) if n == "a" and k in ("DOWNLOADED_TO_DISK", "DELETED_FROM_DISK")][-1]
        assert on_disk == (last == "DOWNLOADED_TO_DISK"), (on_disk, last)
        assert on_disk
    asyncio.run(go())


def test_a_saved_pin_never_applied_claims_no_old_revision_when_its_move_fails(tmp_path):
    """"a" was saved pinned to the device but its pin failed at start (the files changed while
    the daemon was down). A new revision is pulled; its device pin fails too. Before the fix
    the move had first recorded the pin as holding the old revision (id 1), which the engine
    and the gate never held: every other name of that content was then refused 'pinned to the
    device' (load --to host, evict) for nothing."""
    from loractl.errors import LoractlError

    state = PersistentState(tmp_path / "state.json")
    state.device_pins = ["a"]
    state.save()

    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)   # the saved pin, never applied
        tiers.resolver.refs["b"] = Ref("b", 1)                  # b: a's old content
        await new_revision(tiers, "a", 9)
        real_pin = tiers.engine.pin_adapter

        async def pin_adapter(engine_id, *, device=False):
            return False if engine_id == 9 else await real_pin(engine_id, device=device)
        tiers.engine.pin_adapter = pin_adapter
        with pytest.raises(LoractlError, match="the engine no longer holds it"):
            await tiers.repin("a")
        assert tiers.held_pins() == {} and tiers.gate.pinned == set()
        assert (await tiers.load("b", "host")).tier == "host"
    asyncio.run(go())
