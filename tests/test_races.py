"""Races between commands and requests, each held open at its racy point by a test-only pause
(``loractld.testhooks``) rather than left to timing.

The tier races run the real ``Tiers`` and ``Gate`` in front of an engine double (the real
engine cannot be stopped between two awaits of the daemon on demand); the store races run the
real ``Store`` and GC on disk; the request races run a real daemon with a real engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import dataclass
from pathlib import Path

import pytest

from loractl.errors import InvalidRequest
from loractld import testhooks
from loractld.events import EventBus, Metrics
from loractld.serving.admission import FirstCome, Gate
from loractld.serving.pins import PersistentState
from loractld.serving.tiers import Tiers


@dataclass(frozen=True)
class _Ref:
    label: str
    engine_id: int
    path: Path = Path("/nonexistent")


class _Lease:
    def release(self) -> None:
        pass


class _Folders:
    """No folders: the engine double loads nothing from disk."""

    def lease(self, path: Path) -> _Lease:
        return _Lease()


class _Resolver:
    def __init__(self, names: list[str]) -> None:
        self.refs = {n: _Ref(n, i + 1) for i, n in enumerate(names)}
        self.store = _Folders()

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


# -- the store: leases, installs in flight and GC, on disk ---------------------------------------
def _stage_and_install(store, name: str, content: bytes):
    """Install an adapter-shaped folder (the store does not validate; the puller does)."""
    import hashlib

    with store.staging() as staged:
        files = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": content}
        for fname, data in files.items():
            (staged / fname).write_bytes(data)
        records = [{"name": f, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()} for f, d in files.items()]
        return store.install(name, staged, {"name": name, "source": "local", "ref": name, "revision": "r",
                                            "files": records})


def test_a_gc_during_an_install_leaves_the_new_object_alone(tmp_path):
    """A GC (from an rm, a request ending, another pull) between the install's rename into
    .objects/ and its link swap: before the fix it deleted the object as unreferenced, the pull
    failed with FileNotFoundError and left the name a dangling link."""
    from concurrent.futures import ThreadPoolExecutor

    from loractld.store.disk import Store

    store = Store(tmp_path / "adapters")
    with ThreadPoolExecutor(1) as pool, testhooks.armed("store-installed") as point:
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


# -- requests against rm and replacing pulls, on a real daemon -----------------------------------
@pytest.fixture(scope="module")
def paused(home):
    """A daemon of its own with pause points armable through files (loractld/testhooks.py)."""
    from conftest import start_daemon, sub_home

    root = sub_home(home, "races")
    pauses = root / "pauses"
    pauses.mkdir(exist_ok=True)
    d = start_daemon(root, name="races", env={testhooks.ENV: str(pauses)})
    d.pauses = pauses
    yield d
    d.stop()


def _wait_for(path: Path, proc, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} not reached"
        time.sleep(0.05)


@pytest.mark.parametrize("change", ["rm --force", "replacing pull"])
def test_a_request_resolved_before_an_rm_or_a_new_revision_gets_its_answer(paused, demo, reference, change):
    """The request resolved its adapter, then (held at the "resolved" pause) its name is removed
    or pulled anew before it runs. Before the fix, the rm's GC deleted the folder the request
    then handed vLLM, and the engine died; now the folder stays leased until the request ends,
    the answer is the old content's, the engine lives, and then the folder goes."""
    import subprocess

    from conftest import BIN, run_cli

    name = "raced/v1"
    sock = str(paused.socket)
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", name, "--socket", sock).returncode == 0
    shown = run_cli("show", name, "--json", "--socket", sock)
    folder = Path(json.loads(shown.stdout)["path"])
    # Out of the engine too: the run must load it from its folder again.
    assert run_cli("evict", name, "--from", "host", "--socket", sock).returncode == 0
    arming = paused.pauses / "resolved"
    arming.touch()
    request = subprocess.Popen([str(BIN / "loractl"), "run", "--lora", name, "-t", "0", "-n", "12", "hi",
                                "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused.pauses / "resolved.reached", request)
        if change == "rm --force":
            assert run_cli("rm", name, "--force", "--socket", sock).returncode == 0
        else:
            assert run_cli("pull", str(demo / "adapters" / "translator" / "v1"), "--name", name,
                           "--socket", sock).returncode == 0
        assert folder.is_dir()                               # leased: kept
    finally:
        arming.unlink(missing_ok=True)
        (paused.pauses / "resolved.reached").unlink(missing_ok=True)
    out, err = request.communicate(timeout=120)
    assert request.returncode == 0, (err, paused.log_tail())
    expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "poet" / "v1", 12)
    assert out == reference.text(expected) + "\n"
    status = run_cli("status", "--json", "--socket", sock)
    assert status.returncode == 0 and json.loads(status.stdout)["ready"], paused.log_tail()
    assert not folder.exists()                               # unleased, unnamed: collected
    if change == "replacing pull":
        again = run_cli("run", "--lora", name, "-t", "0", "-n", "12", "hi", "--socket", sock)
        expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "translator" / "v1", 12)
        assert again.stdout == reference.text(expected) + "\n"
        assert run_cli("rm", name, "--socket", sock).returncode == 0


def test_rm_of_one_name_keeps_the_adapter_another_name_has(paused, demo, reference):
    """Two names with the same content are one adapter in the engine: rm of one must not unload
    the other's (before the fix it did, and its next request reloaded it from disk)."""
    from conftest import run_cli

    sock = str(paused.socket)
    folder = demo / "adapters" / "sql-expert" / "v1"
    for name in ("twin/a", "twin/b"):
        assert run_cli("pull", str(folder), "--name", name, "--socket", sock).returncode == 0
    assert run_cli("load", "twin/a", "--socket", sock).returncode == 0
    removed = run_cli("rm", "twin/b", "--socket", sock)
    assert removed.returncode == 0 and "unloaded" not in removed.stdout, removed.stdout
    listed = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", sock).stdout)}
    assert listed["twin/a"]["tier"] == "device", listed["twin/a"]
    out = run_cli("run", "--lora", "twin/a", "-t", "0", "-n", "8", "hi", "--socket", sock)
    assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hi"), folder, 8)) + "\n"
    assert run_cli("rm", "twin/a", "--socket", sock).returncode == 0


def test_rm_during_a_pin_is_refused_and_the_pin_stands(paused, demo):
    """A pin held between its cap check and its record while ``rm --force`` comes: before, the rm
    went through and the pin then recorded a pin of a name that was gone (holding one of the few
    pin places); now the rm is refused in one line, the pin completes, and a later rm works."""
    import subprocess

    from conftest import BIN, run_cli

    sock = str(paused.socket)
    name = "pinned-then-rm/v1"
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", name, "--socket", sock).returncode == 0
    arming = paused.pauses / "pin-claimed"
    arming.touch()
    pin = subprocess.Popen([str(BIN / "loractl"), "pin", name, "--to", "host", "--socket", sock],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused.pauses / "pin-claimed.reached", pin)
        refused = run_cli("rm", name, "--force", "--socket", sock)
    finally:
        arming.unlink(missing_ok=True)
        (paused.pauses / "pin-claimed.reached").unlink(missing_ok=True)
    assert refused.returncode != 0 and "busy with another command" in refused.stderr, refused
    assert pin.wait(60) == 0, pin.communicate()
    listed = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", sock).stdout)}
    assert listed[name]["pin"] == "host"
    assert run_cli("rm", name, "--force", "--socket", sock).returncode == 0
    status = json.loads(run_cli("status", "--json", "--socket", sock).stdout)
    assert status["capacity"]["pins"] == 0


def test_an_unpin_gives_back_the_place_of_the_revision_its_pin_holds(tmp_path):
    """A new revision of the name lands while its device pin is between check and record (the
    storm's leak): the pin holds the revision it resolved. Before the fix the unpin released the
    id the name resolves to now, and the pinned revision kept its gate place for good (the gate
    full of pins: every request for an unpinned adapter waited until its deadline)."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with testhooks.armed("pin-claimed") as point:
            pin = asyncio.ensure_future(tiers.pin("a", "device"))
            await point.until_reached()
            tiers.resolver.refs["a"] = _Ref("a", 9)      # a new revision of "a" installed meanwhile
            point.release()
            await pin
        assert tiers.gate.pinned == {1}
        await tiers.unpin("a")
        assert tiers.gate.pinned == set() and tiers.gate.free == 2
    asyncio.run(go())


def test_a_pin_the_engine_refuses_is_an_error_and_gives_its_place_back(tmp_path):
    """The worker's pin answers False when the adapter left the engine between the load and the
    pin (a step's lazy load evicted it): once is retried; twice is one clear error, no pin is
    recorded and the gate's place goes back (before, the False was ignored and the pin recorded)."""
    from loractl.errors import LoractlError

    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        answers = [False, True]

        async def pin_adapter(engine_id, *, device=False):
            return answers.pop(0) if answers else False
        tiers.engine.pin_adapter = pin_adapter
        await tiers.pin("a", "device")                       # False, then True: pinned
        assert tiers.state.device_pins == ["a"] and tiers.gate.pinned == {1}
        await tiers.unpin("a")
        with pytest.raises(LoractlError, match="the engine no longer holds it"):
            await tiers.pin("b", "device")                   # False twice
        assert tiers.state.device_pins == [] and tiers.gate.pinned == set() and tiers.gate.free == 2
    asyncio.run(go())


# -- a caller that goes away at every await of a pin change ----------------------------------------
def _assert_pins_agree(tiers: Tiers) -> None:
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


async def _new_revision(tiers: Tiers, name: str, engine_id: int) -> None:
    tiers.resolver.refs[name] = _Ref(name, engine_id)


_BESIDE: set[asyncio.Task] = set()   # commands running beside a cancelled one (held: tasks are weakly kept)


async def _pin_beside_loads(tiers: Tiers) -> None:
    """A device pin while other commands keep the tiers' lock busy (the storm's case): only then
    does the pin wait for the lock between asking the engine and recording what it did."""
    async def trickle() -> None:   # a load queued for the lock at every turn, whichever the pin is at
        for turn in range(40):
            task = asyncio.ensure_future(tiers.load("bc"[turn % 2], "host"))
            _BESIDE.add(task)
            task.add_done_callback(_BESIDE.discard)
            await asyncio.sleep(0)
    keep = asyncio.ensure_future(trickle())   # not cancelled with the pin
    _BESIDE.add(keep)
    keep.add_done_callback(_BESIDE.discard)
    await tiers.pin("a", "device")


# (setup, the change cancelled, what follows it): the setup and what follows are never cancelled.
_CHANGES = {
    "pin device": ([], lambda t: t.pin("a", "device")),
    "pin device beside loads": ([], _pin_beside_loads),
    "host to device": ([lambda t: t.pin("a", "host")], lambda t: t.pin("a", "device")),
    "device to host": ([lambda t: t.pin("a", "device")], lambda t: t.pin("a", "host")),
    "new revision": ([lambda t: t.pin("a", "device"), lambda t: _new_revision(t, "a", 9)],
                     lambda t: t.repin("a")),
    "pin again after a refused move": ([lambda t: t.pin("a", "device"), lambda t: _new_revision(t, "a", 9)],
                                       lambda t: t.pin("a", "device")),
    "host pin, new revision": ([lambda t: t.pin("a", "host"), lambda t: _new_revision(t, "a", 9)],
                               lambda t: t.repin("a")),
    "unpin": ([lambda t: t.pin("a", "device")], lambda t: t.unpin("a")),
    "shared content": ([lambda t: _new_revision(t, "b", 1), lambda t: t.pin("a", "device"),
                        lambda t: t.pin("b", "host")], lambda t: t.unpin("b")),
}


@pytest.mark.parametrize("change", list(_CHANGES))
def test_a_pin_change_cancelled_at_any_await_leaves_records_gate_and_engine_agreeing(tmp_path, change):
    """A client that goes away (a deadline, Ctrl-C) at each successive await of a pin, unpin
    or pin move: afterwards the records, the gate and the engine agree, and a pin of another
    adapter then gets the places the caps promise. Before the fix a pin cancelled after the
    engine pinned held its gate place and slot unrecorded (the storm's 'gate holds 2 of 2
    places for pins': the "beside loads" case, where other commands keep the lock busy), and
    pinning a new revision again kept the old one pinned for good."""
    setup, cancelled = _CHANGES[change]

    async def go(steps: int) -> bool:
        tiers = _tiers(tmp_path / f"{change}-{steps}", max_loras=2, max_cpu_loras=4)
        for step in setup:
            await step(tiers)
        task = asyncio.ensure_future(cancelled(tiers))
        for _ in range(steps):
            await asyncio.sleep(0)
        finished_first = task.done()
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        for _ in range(200):   # work a cancelled caller left to finish on its own
            await asyncio.sleep(0)
        _assert_pins_agree(tiers)
        for name in list(tiers.pinned_names()):
            await tiers.unpin(name)
        _assert_pins_agree(tiers)
        assert tiers.gate.free == 2 and tiers.engine.pinned_host == set()
        await tiers.pin("c", "device")
        _assert_pins_agree(tiers)
        return finished_first

    steps = 0
    while not asyncio.run(go(steps)):   # every await of the change, then once past its end
        steps += 1
    assert steps > 3, "the change never awaited: nothing was tested"


def test_evict_from_host_of_a_name_whose_content_another_name_pinned_names_that_pin(tmp_path):
    """"b" has the same content as "a", pinned in host RAM: ``evict b --from host`` is refused,
    and the refusal names the pin to undo (before: "'b' is pinned ... loractl unpin b", which
    then failed with "'b' is not pinned")."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = _Ref("b", 1)
        await tiers.pin("a", "host")
        with pytest.raises(InvalidRequest, match="same content as 'a', which is pinned") as refused:
            await tiers.evict("b", "host")
        assert refused.value.hint == "To evict it, unpin that first: loractl unpin a"
        with pytest.raises(InvalidRequest, match="'b' is not pinned"):
            await tiers.unpin("b")
        _assert_pins_agree(tiers)
        await tiers.unpin("a")
        assert (await tiers.evict("b", "host")).tier == "disk"
    asyncio.run(go())


@pytest.mark.parametrize("command", ["load b --to host", "evict b --from device"])
def test_no_command_takes_a_device_pinned_adapter_off_the_device_through_another_name(tmp_path, command):
    """"b" has the same content as "a" (one engine id), and "a" is pinned to the device: taking
    "b" off the device would take "a" too, and vLLM drops a deactivated adapter's pin without a
    word (the gate kept the place; ls no longer showed the pin). Refused in one line, naming
    the pin to undo; after "a" is unpinned the command works."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = _Ref("b", 1)
        await tiers.pin("a", "device")
        run = (lambda: tiers.load("b", "host")) if command.startswith("load") else (lambda: tiers.evict("b", "device"))
        with pytest.raises(InvalidRequest, match="same content as 'a', which is pinned to the device") as refused:
            await run()
        assert refused.value.hint == "To " + ("move it to host RAM" if command.startswith("load") else "evict it") + \
            ", unpin that first: loractl unpin a"
        _assert_pins_agree(tiers)
        assert tiers.engine.pinned_device == {1} and 1 in tiers.engine.device
        await tiers.unpin("a")
        assert (await run()).tier == "host"
        _assert_pins_agree(tiers)
    asyncio.run(go())


# -- two names of the same content pinned to the device at once ------------------------------------
async def _full_gate_and_two_twin_pins(tiers: Tiers):
    """Every place taken by a request of another adapter (5, 6, 7), then "a" and "b" (the same
    content: engine id 1) both pinned to the device: both wait for a place."""
    tiers.resolver.refs["b"] = _Ref("b", 1)
    running = [await tiers.gate.enter(key, f"x{key}") for key in (5, 6, 7)]
    pin_a = asyncio.ensure_future(tiers.pin("a", "device"))
    await asyncio.sleep(0)
    pin_b = asyncio.ensure_future(tiers.pin("b", "device"))
    for _ in range(5):
        await asyncio.sleep(0)
    assert not pin_a.done() and not pin_b.done() and tiers.gate.pins_waiting
    return running, pin_a, pin_b


def test_a_device_pin_of_content_already_pinned_takes_no_second_place(tmp_path):
    """"a" and "b" have the same content (one engine id, one gate place). Both device pins wait
    for a full gate; when one place frees, both go (the second takes no place). Before the fix
    "b" waited for a second free place it would never take, and while it waited no request of
    an unpinned adapter was admitted: every running adapter had to drain first."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=3, max_cpu_loras=5)
        running, pin_a, pin_b = await _full_gate_and_two_twin_pins(tiers)
        tiers.gate.finish(running[0])                 # one place frees
        await asyncio.wait_for(asyncio.gather(pin_a, pin_b), timeout=5)
        assert not tiers.gate.pins_waiting and tiers.gate.pinned == {1} and tiers.gate.free == 0
        _assert_pins_agree(tiers)
        joined = asyncio.ensure_future(tiers.gate.enter(6, "x6"))   # an active adapter takes requests again
        await asyncio.sleep(0)
        assert joined.done()
    asyncio.run(go())


def test_a_cancelled_twin_device_pin_leaves_the_other_names_place(tmp_path):
    """"a" and "b" (one engine id) both wait for a device place; two places free in one loop
    turn, which grants both, and "b"'s caller goes away in that same turn. Before the fix the
    gate gave the place back for "b"'s cancel although "a"'s pin holds it: the engine pinned
    id 1 in a slot the gate no longer counted, so the gate could admit max_loras unpinned
    adapters next to it (a step then evicts one of its own adapters and vLLM dies)."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=3, max_cpu_loras=5)
        running, pin_a, pin_b = await _full_gate_and_two_twin_pins(tiers)
        tiers.gate.finish(running[0])
        tiers.gate.finish(running[1])
        pin_b.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await pin_b
        await asyncio.wait_for(pin_a, timeout=5)
        for _ in range(50):
            await asyncio.sleep(0)
        assert tiers.state.device_pins == ["a"]
        _assert_pins_agree(tiers)
        assert tiers.gate.used == 2                    # the pin and adapter 7: one place for one more
    asyncio.run(go())


def test_rm_keeps_an_engine_id_that_another_names_pin_holds(tmp_path):
    """"a" and "b" had the same content (engine id 1); "b" was pinned to the device while a new
    revision of it landed, so its pin holds the old content, id 1 (the pull reports 'pin not
    moved'). ``rm a`` finds no other name of that content and unloads id 1: before the fix the
    engine dropped the pin with the entry (vLLM does so silently), while the records and the
    gate kept it (a place held for a pin the engine no longer has)."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = _Ref("b", 1)
        with testhooks.armed("pin-claimed") as point:
            pin = asyncio.ensure_future(tiers.pin("b", "device"))
            await point.until_reached()
            tiers.resolver.refs["b"] = _Ref("b", 9)      # b's new revision
            point.release()
            await pin
        assert tiers.held_pins() == {"b": ("device", 1)}
        with tiers.claimed("a"):                          # what core.remove does, "a" gone from disk
            unloaded = await tiers.forget("a", _Ref("a", 1), unload=True)
        assert not unloaded
        _assert_pins_agree(tiers)
        assert 1 in tiers.engine.host
        await tiers.unpin("b")
        _assert_pins_agree(tiers)
        assert tiers.gate.free == 2
    asyncio.run(go())


def test_a_host_pin_moved_to_a_new_revision_never_holds_one_host_pin_over_the_cap(tmp_path):
    """"a" is pinned in host RAM with every host pin place taken (max_cpu_loras - max_loras = 1);
    a new revision of it lands and the pin moves over. Host pins are capped so that a step of
    max_loras unpinned adapters always finds room in RAM next to them; before the fix the new
    revision was pinned while the old one still was (two host pins, one over the cap) for at
    least one engine call, during which such a step must evict one of its own adapters."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        engine, most = tiers.engine, []
        real_pin = engine.pin_adapter

        async def pin_adapter(engine_id, *, device=False):
            answer = await real_pin(engine_id, device=device)
            most.append(len(engine.pinned_host - engine.pinned_device))
            return answer
        engine.pin_adapter = pin_adapter
        await tiers.pin("a", "host")
        await _new_revision(tiers, "a", 9)
        await tiers.repin("a")
        assert tiers.held_pins() == {"a": ("host", 9)}
        _assert_pins_agree(tiers)
        assert max(most) <= tiers.max_pins, most
    asyncio.run(go())


@pytest.mark.parametrize("old", ["still loaded", "gone too"])
def test_a_host_pin_whose_move_to_a_new_revision_fails_stays_on_the_old_one_or_ends(tmp_path, old):
    """The host pin gives up the old revision first (above); when the engine then refuses to pin
    the new one, the old one is pinned again, and if the engine no longer holds it either the
    name is recorded unpinned, with an event: records, gate and engine agree either way."""
    from loractl.errors import LoractlError

    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        engine = tiers.engine
        real_pin = engine.pin_adapter
        await tiers.pin("a", "host")
        await _new_revision(tiers, "a", 9)

        async def pin_adapter(engine_id, *, device=False):
            if engine_id == 9:
                if old == "gone too":
                    await engine.remove_adapter(1)
                return False
            return await real_pin(engine_id, device=device)
        engine.pin_adapter = pin_adapter
        with pytest.raises(LoractlError, match="the engine no longer holds it"):
            await tiers.repin("a")
        _assert_pins_agree(tiers)
        assert tiers.held_pins() == ({"a": ("host", 1)} if old == "still loaded" else {})
        assert PersistentState(tmp_path / "state.json").pin_of("a") == ("host" if old == "still loaded" else "")
    asyncio.run(go())


# -- a name's claim belongs to the command that took it --------------------------------------------
def test_a_pin_refused_as_busy_leaves_the_claim_of_the_pin_in_progress(tmp_path):
    """``pin a`` waits (here: held between its claim and the gate); the user runs it again, which
    is refused as busy. Before the fix the refused pin's clean-up dropped the first pin's claim:
    the caps no longer counted it, so ``pin b`` took the last device-pin place too, and both
    pins ended recorded (2 device pins of at most 1: every place of the gate pinned, no
    unpinned adapter could run again); an rm could have run in the middle of it as well."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with testhooks.armed("pin-claimed") as point:
            first = asyncio.ensure_future(tiers.pin("a", "device"))
            await point.until_reached()
            with pytest.raises(InvalidRequest, match="busy with another command"):
                await tiers.pin("a", "device")             # the same command, run again
            with pytest.raises(InvalidRequest, match="busy with another command"):
                with tiers.claimed("a"):                    # rm
                    pass
            b = asyncio.ensure_future(tiers.pin("b", "device"))
            for _ in range(20):
                await asyncio.sleep(0)
            point.release()
            await asyncio.wait_for(first, timeout=5)
            with contextlib.suppress(InvalidRequest):
                await asyncio.wait_for(b, timeout=5)
        assert tiers.state.device_pins == ["a"]
        _assert_pins_agree(tiers)
        assert tiers.gate.free == 1
    asyncio.run(go())


def test_a_pin_run_again_while_the_cancelled_one_gives_its_place_back_keeps_its_claim(tmp_path):
    """Ctrl-C on ``pin a --to device`` while it loads, and the user runs it again at once: the
    new pin claims the name while the cancelled one is still giving its gate place back (that
    waits for the tiers' lock). Before the fix the cancelled pin's clean-up then dropped the
    new pin's claim, and a pin of "b" got past the device-pin cap while "a"'s was in flight."""
    async def go():
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        engine = tiers.engine
        real_add, real_pin = engine.add_adapter, engine.pin_adapter
        adding, pinning = asyncio.Event(), asyncio.Event()
        hold_add, hold_pin = asyncio.Event(), asyncio.Event()

        async def add_adapter(adapter):
            if not adding.is_set():                     # the first pin's load: held, then cancelled
                adding.set()
                await hold_add.wait()
            return await real_add(adapter)

        async def pin_adapter(engine_id, *, device=False):
            pinning.set()
            await hold_pin.wait()
            return await real_pin(engine_id, device=device)
        engine.add_adapter, engine.pin_adapter = add_adapter, pin_adapter
        first = asyncio.ensure_future(tiers.pin("a", "device"))
        await adding.wait()
        first.cancel()
        again = asyncio.ensure_future(tiers.pin("a", "device"))
        with contextlib.suppress(asyncio.CancelledError):
            await first
        await asyncio.wait_for(pinning.wait(), timeout=5)   # the new pin commits, under the lock
        b = asyncio.ensure_future(tiers.pin("b", "device"))
        for _ in range(20):
            await asyncio.sleep(0)
        hold_pin.set()
        await asyncio.wait_for(again, timeout=5)
        with contextlib.suppress(InvalidRequest):
            await asyncio.wait_for(b, timeout=5)
        assert tiers.state.device_pins == ["a"]
        _assert_pins_agree(tiers)
    asyncio.run(go())


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
        _assert_pins_agree(tiers)
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

        async def client():
            async with contextlib.aclosing(core.pull("test://a", name="a")) as stream:
                async for _ in stream:
                    pass
        with testhooks.armed("store-installed") as point:
            pull = asyncio.ensure_future(client())
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
        _assert_pins_agree(tiers)
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

        async def client():
            async with contextlib.aclosing(core.pull("test://a", name="a")) as stream:
                async for _ in stream:
                    pass
        with testhooks.armed("store-installed") as point:
            pull = asyncio.ensure_future(client())
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
        tiers = _tiers(tmp_path, max_loras=2, max_cpu_loras=3)   # the saved pin, never applied
        tiers.resolver.refs["b"] = _Ref("b", 1)                  # b: a's old content
        await _new_revision(tiers, "a", 9)
        real_pin = tiers.engine.pin_adapter

        async def pin_adapter(engine_id, *, device=False):
            return False if engine_id == 9 else await real_pin(engine_id, device=device)
        tiers.engine.pin_adapter = pin_adapter
        with pytest.raises(LoractlError, match="the engine no longer holds it"):
            await tiers.repin("a")
        assert tiers.held_pins() == {} and tiers.gate.pinned == set()
        assert (await tiers.load("b", "host")).tier == "host"
    asyncio.run(go())
