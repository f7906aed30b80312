"""Races between tier commands (pin, unpin, load, evict, rm of pins), each held open at its racy
point by a test-only pause (``loractl_test_hooks.armed``, tests/hooks_plugin) or an engine
double's held call, rather than left to timing: the real ``Tiers`` and ``Gate`` in front of
``tier_double.EngineDouble``.

The store's races are in test_races_store.py, the requests' on a real daemon in
test_races_daemon.py."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from loractl.errors import InvalidRequest
from loractld.serving.pins import PersistentState
from loractld.serving.tiers import Tiers

from loractl_test_hooks import armed
from tier_double import Ref, assert_pins_agree, make_tiers, new_revision


@pytest.mark.parametrize("to", ["host", "device"])
def test_of_two_concurrent_pins_for_the_last_place_exactly_one_wins(tmp_path, to):
    """One host-pin place (max_cpu_loras - max_loras = 1) or one device-pin place (max_loras - 1
    = 1): the first pin is held between its cap check and its record, the second runs into the
    gap. Before the fix both succeeded (a host full of pins kills the engine; two device pins
    left no place for unpinned adapters)."""
    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with armed("pin-claimed") as point:
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=2, names=("a", "b", "c", "d"))  # caps: 1 device, 0 host
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
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


def test_an_unpin_gives_back_the_place_of_the_revision_its_pin_holds(tmp_path):
    """A new revision of the name lands while its device pin is between check and record (the
    storm's leak): the pin holds the revision it resolved. Before the fix the unpin released the
    id the name resolves to now, and the pinned revision kept its gate place for good (the gate
    full of pins: every request for an unpinned adapter waited until its deadline)."""
    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with armed("pin-claimed") as point:
            pin = asyncio.ensure_future(tiers.pin("a", "device"))
            await point.until_reached()
            tiers.resolver.refs["a"] = Ref("a", 9)      # a new revision of "a" installed meanwhile
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
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
    "new revision": ([lambda t: t.pin("a", "device"), lambda t: new_revision(t, "a", 9)],
                     lambda t: t.repin("a")),
    "pin again after a refused move": ([lambda t: t.pin("a", "device"), lambda t: new_revision(t, "a", 9)],
                                       lambda t: t.pin("a", "device")),
    "host pin, new revision": ([lambda t: t.pin("a", "host"), lambda t: new_revision(t, "a", 9)],
                               lambda t: t.repin("a")),
    "unpin": ([lambda t: t.pin("a", "device")], lambda t: t.unpin("a")),
    "shared content": ([lambda t: new_revision(t, "b", 1), lambda t: t.pin("a", "device"),
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
        tiers = make_tiers(tmp_path / f"{change}-{steps}", max_loras=2, max_cpu_loras=4)
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
        assert_pins_agree(tiers)
        for name in list(tiers.pinned_names()):
            await tiers.unpin(name)
        assert_pins_agree(tiers)
        assert tiers.gate.free == 2 and tiers.engine.pinned_host == set()
        await tiers.pin("c", "device")
        assert_pins_agree(tiers)
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = Ref("b", 1)
        await tiers.pin("a", "host")
        with pytest.raises(InvalidRequest, match="same content as 'a', which is pinned") as refused:
            await tiers.evict("b", "host")
        assert refused.value.hint == "To evict it, unpin that first: loractl unpin a"
        with pytest.raises(InvalidRequest, match="'b' is not pinned itself; its weights are pinned by 'a'") as not_b:
            await tiers.unpin("b")   # ls shows b's weights pinned: the refusal says by whom
        assert not_b.value.hint == "loractl unpin a releases them."
        assert_pins_agree(tiers)
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = Ref("b", 1)
        await tiers.pin("a", "device")
        run = (lambda: tiers.load("b", "host")) if command.startswith("load") else (lambda: tiers.evict("b", "device"))
        with pytest.raises(InvalidRequest, match="same content as 'a', which is pinned to the device") as refused:
            await run()
        assert refused.value.hint == "To " + ("move it to host RAM" if command.startswith("load") else "evict it") + \
            ", unpin that first: loractl unpin a"
        assert_pins_agree(tiers)
        assert tiers.engine.pinned_device == {1} and 1 in tiers.engine.device
        await tiers.unpin("a")
        assert (await run()).tier == "host"
        assert_pins_agree(tiers)
    asyncio.run(go())


# -- two names of the same content pinned to the device at once ------------------------------------
async def _full_gate_and_two_twin_pins(tiers: Tiers):
    """Every place taken by a request of another adapter (5, 6, 7), then "a" and "b" (the same
    content: engine id 1) both pinned to the device: both wait for a place."""
    tiers.resolver.refs["b"] = Ref("b", 1)
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
        tiers = make_tiers(tmp_path, max_loras=3, max_cpu_loras=5)
        running, pin_a, pin_b = await _full_gate_and_two_twin_pins(tiers)
        tiers.gate.finish(running[0])                 # one place frees
        await asyncio.wait_for(asyncio.gather(pin_a, pin_b), timeout=5)
        assert not tiers.gate.pins_waiting and tiers.gate.pinned == {1} and tiers.gate.free == 0
        assert_pins_agree(tiers)
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
        tiers = make_tiers(tmp_path, max_loras=3, max_cpu_loras=5)
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
        assert_pins_agree(tiers)
        assert tiers.gate.used == 2                    # the pin and adapter 7: one place for one more
    asyncio.run(go())


def test_rm_keeps_an_engine_id_that_another_names_pin_holds(tmp_path):
    """"a" and "b" had the same content (engine id 1); "b" was pinned to the device while a new
    revision of it landed, so its pin holds the old content, id 1 (the pull reports 'pin not
    moved'). ``rm a`` finds no other name of that content and unloads id 1: before the fix the
    engine dropped the pin with the entry (vLLM does so silently), while the records and the
    gate kept it (a place held for a pin the engine no longer has)."""
    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        tiers.resolver.refs["b"] = Ref("b", 1)
        with armed("pin-claimed") as point:
            pin = asyncio.ensure_future(tiers.pin("b", "device"))
            await point.until_reached()
            tiers.resolver.refs["b"] = Ref("b", 9)      # b's new revision
            point.release()
            await pin
        assert tiers.held_pins() == {"b": ("device", 1)}
        with tiers.claimed("a"):                          # what core.remove does, "a" gone from disk
            unloaded = await tiers.forget("a", Ref("a", 1), unload=True)
        assert not unloaded
        assert_pins_agree(tiers)
        assert 1 in tiers.engine.host
        await tiers.unpin("b")
        assert_pins_agree(tiers)
        assert tiers.gate.free == 2
    asyncio.run(go())


def test_a_host_pin_moved_to_a_new_revision_never_holds_one_host_pin_over_the_cap(tmp_path):
    """"a" is pinned in host RAM with every host pin place taken (max_cpu_loras - max_loras = 1);
    a new revision of it lands and the pin moves over. Host pins are capped so that a step of
    max_loras unpinned adapters always finds room in RAM next to them; before the fix the new
    revision was pinned while the old one still was (two host pins, one over the cap) for at
    least one engine call, during which such a step must evict one of its own adapters."""
    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        engine, most = tiers.engine, []
        real_pin = engine.pin_adapter

        async def pin_adapter(engine_id, *, device=False):
            answer = await real_pin(engine_id, device=device)
            most.append(len(engine.pinned_host - engine.pinned_device))
            return answer
        engine.pin_adapter = pin_adapter
        await tiers.pin("a", "host")
        await new_revision(tiers, "a", 9)
        await tiers.repin("a")
        assert tiers.held_pins() == {"a": ("host", 9)}
        assert_pins_agree(tiers)
        assert max(most) <= tiers.max_pins, most
    asyncio.run(go())


@pytest.mark.parametrize("old", ["still loaded", "gone too"])
def test_a_host_pin_whose_move_to_a_new_revision_fails_stays_on_the_old_one_or_ends(tmp_path, old):
    """The host pin gives up the old revision first (above); when the engine then refuses to pin
    the new one, the old one is pinned again, and if the engine no longer holds it either the
    name is recorded unpinned, with an event: records, gate and engine agree either way."""
    from loractl.errors import LoractlError

    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        engine = tiers.engine
        real_pin = engine.pin_adapter
        await tiers.pin("a", "host")
        await new_revision(tiers, "a", 9)

        async def pin_adapter(engine_id, *, device=False):
            if engine_id == 9:
                if old == "gone too":
                    await engine.remove_adapter(1)
                return False
            return await real_pin(engine_id, device=device)
        engine.pin_adapter = pin_adapter
        with pytest.raises(LoractlError, match="the engine no longer holds it"):
            await tiers.repin("a")
        assert_pins_agree(tiers)
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
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
        with armed("pin-claimed") as point:
            first = asyncio.ensure_future(tiers.pin("a", "device"))
            await point.until_reached()
            with pytest.raises(InvalidRequest, match="busy with another command"):
                await tiers.pin("a", "device")             # the same command, run again
            with pytest.raises(InvalidRequest, match="busy with another command"):
                with tiers.claimed("a"):                    # rm
                    pass
            await _pin_b_meanwhile(tiers, point.release, first)
        assert tiers.gate.free == 1
    asyncio.run(go())


def test_a_pin_run_again_while_the_cancelled_one_gives_its_place_back_keeps_its_claim(tmp_path):
    """Ctrl-C on ``pin a --to device`` while it loads, and the user runs it again at once: the
    new pin claims the name while the cancelled one is still giving its gate place back (that
    waits for the tiers' lock). Before the fix the cancelled pin's clean-up then dropped the
    new pin's claim, and a pin of "b" got past the device-pin cap while "a"'s was in flight."""
    async def go():
        tiers = make_tiers(tmp_path, max_loras=2, max_cpu_loras=3)
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
        await _pin_b_meanwhile(tiers, hold_pin.set, again)
    asyncio.run(go())


async def _pin_b_meanwhile(tiers, release, pin_a) -> None:
    """``pin b --to device`` while ``pin_a`` is in flight; then ``release`` it: the device-pin cap
    (1) counts a's pin in flight, so b is refused and only a ends pinned, records and engine agreeing."""
    b = asyncio.ensure_future(tiers.pin("b", "device"))
    for _ in range(20):
        await asyncio.sleep(0)
    release()
    await asyncio.wait_for(pin_a, timeout=5)
    with contextlib.suppress(InvalidRequest):
        await asyncio.wait_for(b, timeout=5)
    assert tiers.state.device_pins == ["a"]
    assert_pins_agree(tiers)
