"""Tiers on the real engine (max_loras=2, max_cpu_loras=3, four adapters): load, evict, pin,
unpin, rm and requests in random order; after every step the listing must equal an
independent model of vLLM's LRU tiers, and every generation must equal its reference."""

from __future__ import annotations

import asyncio
import json
import random
import time

import pytest

from adapter_factory import edit_config, good
from conftest import collect, own_daemon, run_cli, start_daemon
from loractld.serving.admission import DEFAULT_MAX_WAIT_S
from test_errors import assert_one_error
from vllm_lru_model import VllmTiers

NAMES = ["sql-expert/v1", "python-expert/v1", "poet/v1", "translator/v1"]
POLICY = ("--admission", "adaptive")


@pytest.fixture(scope="module")
def tiered(home):
    """A daemon of its own: pins persist, so this module must not share state with others. It
    runs the opt-in ``--admission adaptive`` policy, so that a real engine drives it too (the
    session daemon runs the default, batching); every answer here is checked all the same."""
    d = own_daemon(home, "tiers", NAMES, *POLICY, name="t")
    yield d
    d.stop()


def listing(d) -> dict[str, dict]:
    result = run_cli("ls", "--json", "--socket", str(d.socket))
    assert result.returncode == 0, result.stderr
    return {a["name"]: a for a in json.loads(result.stdout)}


def cli(d, *args):
    result = run_cli(*args, "--socket", str(d.socket))
    assert result.returncode == 0, (args, result.stderr)
    return result


def test_random_sequences_keep_the_listing_true(tiered, home, reference):
    rng = random.Random(20261122)
    model = VllmTiers(device_slots=2, host_slots=3)
    pins: dict[str, str] = {}    # name -> "host" or "device"
    demo = home / "tiny" / "adapters"
    log = []
    succeeded: set[str] = set()

    def pinned_to(tier: str) -> list[str]:
        return [n for n, t in pins.items() if t == tier]

    for step in range(48):
        op = rng.choice(["load", "load_host", "evict", "evict_host", "pin", "pin_device", "unpin", "request",
                         "request", "rm"])
        name = rng.choice(NAMES)
        log.append((op, name))
        if op in ("load_host", "evict", "evict_host") and pins.get(name) == "device":
            args = ("load", name, "--to", "host") if op == "load_host" else \
                ("evict", name, "--from", "device" if op == "evict" else "host")
            assert_one_error(run_cli(*args, "--socket", str(tiered.socket)), 2, "is pinned to the device",
                             f"loractl unpin {name}")
        elif op == "load":
            cli(tiered, "load", name)
            model.add(name)
        elif op == "load_host":
            cli(tiered, "load", name, "--to", "host")
            model.add(name)
            model.deactivate(name)
        elif op in ("evict", "evict_host"):
            result = run_cli("evict", name, "--from", "device" if op == "evict" else "host",
                             "--socket", str(tiered.socket))
            if pins.get(name) == "host" and op == "evict_host":
                assert_one_error(result, 2, "is pinned in host RAM", f"loractl unpin {name}")
            else:
                assert result.returncode == 0, result.stderr
                model.deactivate(name) if op == "evict" else model.remove(name)
        elif op in ("pin", "pin_device"):
            to = "device" if op == "pin_device" else "host"
            result = run_cli("pin", name, "--to", to, "--socket", str(tiered.socket))
            if pins.get(name) != to and len(pinned_to(to)) >= 1:  # at most 3 - 2 host pins, 2 - 1 device pins
                assert_one_error(result, 2, f"at most 1 {to} pins", "loractl unpin NAME")
            else:
                assert result.returncode == 0, result.stderr
                if pins.get(name) == "device":
                    model.unpin(name)  # device -> host: unpinned in the engine, then pinned again
                model.add(name)
                model.pin_device(name) if to == "device" else model.pin_host(name)
                pins[name] = to
                succeeded.add(to)
        elif op == "unpin":
            result = run_cli("unpin", name, "--socket", str(tiered.socket))
            if name in pins:
                assert result.returncode == 0, result.stderr
                model.unpin(name)
                del pins[name]
            else:
                assert_one_error(result, 2, "is not pinned")
        elif op == "request":
            out = cli(tiered, "run", "--lora", name, "-t", "0", "-n", "8", "hi")
            expected = reference.greedy(reference.chat_ids("hi"), demo / name, 8)
            assert out.stdout == reference.text(expected) + "\n", log
            model.add(name)
        elif op == "rm":
            cli(tiered, "rm", name, "--force")
            model.remove(name)
            pins.pop(name, None)
            assert name not in listing(tiered)
            cli(tiered, "pull", str(demo / name), "--name", name)

        listed = listing(tiered)
        for n in NAMES:
            assert listed[n]["tier"] == model.tier(n), (step, n, log)
            assert (listed[n]["pinned"], listed[n]["pin"]) == (n in pins, pins.get(n, "")), (step, n, log)
        on_device = [n for n in NAMES if listed[n]["tier"] == "device"]
        assert len(on_device) <= 2 and sum(listed[n]["tier"] != "disk" for n in NAMES) <= 3
        slots = sorted(listed[n]["slot"] for n in on_device)
        assert len(set(slots)) == len(slots) and all(0 <= s < 2 for s in slots)
    assert succeeded == {"host", "device"}, log  # the sequence pinned both ways at least once
    for name in pins:
        cli(tiered, "unpin", name)


def test_status_reports_capacity(tiered):
    cli(tiered, "load", NAMES[0])
    info = json.loads(cli(tiered, "status", "--json").stdout)
    cap = info["capacity"]
    assert cap["device_slots"] == 2 and cap["host_slots"] == 3 and cap["max_pins"] == 1  # 3 - 2
    assert 1 <= cap["device_used"] <= 2 and cap["device_used"] <= cap["host_used"] <= 3
    assert cap["disk_adapters"] == 4 and cap["max_lora_rank"] == 16


def test_usage_and_metrics(tiered):
    before = listing(tiered)[NAMES[2]]["requests"]
    cli(tiered, "run", "--lora", NAMES[2], "-t", "0", "-n", "4", "hi")
    after = listing(tiered)[NAMES[2]]
    assert int(after["requests"]) == int(before) + 1 and after["last_used"] > 0
    text = cli(tiered, "metrics").stdout
    assert f'loractl_adapter_requests_total{{adapter="{NAMES[2]}"}}' in text
    for family in ("loractl_adapter_load_seconds_bucket", "loractl_adapter_loads_total",
                   "loractl_adapter_evictions_total", "loractl_tier_bytes{tier=\"disk\"}",
                   "loractl_tier_adapters{tier=\"device\"}"):
        assert family in text, family


def test_events_stream_lifecycle(tiered):
    async def go():
        async with tiered.client() as client:
            received = []

            async def follow():
                async for event in client.events():
                    received.append(event)
                    if event["kind"] == "UNPINNED":
                        return

            task = asyncio.create_task(follow())
            await asyncio.sleep(0.3)
            await client.evict(NAMES[3], source="host")
            await client.pin(NAMES[3])
            await client.unpin(NAMES[3])
            await asyncio.wait_for(task, 30)
            return received

    events = asyncio.run(go())
    kinds = [(e["kind"], e["adapter"]) for e in events if e["adapter"] == NAMES[3]]
    assert ("LOADED_TO_HOST", NAMES[3]) in kinds and ("LOADED_TO_DEVICE", NAMES[3]) in kinds
    assert kinds.index(("PINNED", NAMES[3])) < kinds.index(("UNPINNED", NAMES[3]))


def test_pins_and_preload_survive_a_restart(tiered, home):
    """Pins persist; preloads load; a preload the engine's loader refuses (placed by hand while
    the daemon was down) is refused by the preflight, reported, and never reaches the engine."""
    cli(tiered, "pin", NAMES[1])
    cli(tiered, "pin", NAMES[2], "--to", "device")
    saved = json.loads((tiered.home / "state" / "state.json").read_text())
    tiered.stop()
    edit_config(good(home / "tiny", tiered.home / "adapters" / "handmade-pissa" / "v1", name="handmade-pissa"),
                init_lora_weights="pissa")
    d = start_daemon(tiered.home, *POLICY, "--preload", NAMES[0], "--preload", "no-such/v1",
                     "--preload", "handmade-pissa/v1", name="t")
    tiered.proc, tiered.log = d.proc, d.log
    listed = listing(d)
    assert (listed[NAMES[1]]["tier"], listed[NAMES[1]]["pin"]) in {("device", "host"), ("host", "host")}
    assert (listed[NAMES[2]]["tier"], listed[NAMES[2]]["pin"]) == ("device", "device")
    assert listed[NAMES[0]]["tier"] == "device" and not listed[NAMES[0]]["pinned"]
    assert "preload no-such/v1" in d.log_tail(200)  # reported, and the daemon still came up
    refused = [ln for ln in d.log_tail(200).splitlines() if "preload handmade-pissa/v1" in ln]
    assert refused and "init_lora_weights" in refused[0], d.log_tail(200)
    assert (listed["handmade-pissa/v1"]["state"], listed["handmade-pissa/v1"]["tier"]) == ("failed", "disk")
    status = json.loads(cli(d, "status", "--json").stdout)
    assert (status["capacity"]["pins"], status["capacity"]["device_pins"], status["admission"]["pinned"]) == (1, 1, 1)
    assert saved == {"format": 1, "pins": [NAMES[1]], "device_pins": [NAMES[2]]}
    cli(d, "unpin", NAMES[1])
    cli(d, "unpin", NAMES[2])


def test_tier_errors(tiered):
    assert_one_error(run_cli("load", "nope/v1", "--socket", str(tiered.socket)), 4, "no adapter named 'nope/v1'")
    assert_one_error(run_cli("unpin", NAMES[0], "--socket", str(tiered.socket)), 2, "is not pinned")
    cli(tiered, "pin", NAMES[0])
    assert_one_error(run_cli("rm", NAMES[0], "--socket", str(tiered.socket)), 2, "is pinned", "--force")
    cli(tiered, "unpin", NAMES[0])


def test_a_device_pin_holds_against_commands_on_another_name_of_the_same_content(tiered, home):
    """A second name for a device-pinned adapter's files is the same adapter in the engine:
    loading it to host RAM or evicting it from the device would drop the pin in vLLM (its LRU
    cache unpins what it deactivates) while the gate kept the place. Refused in one line that
    names the pin; the pin, its place and the engine's pin stay; after the unpin both work."""
    twin = "twin/v1"
    cli(tiered, "pull", str(home / "tiny" / "adapters" / NAMES[0]), "--name", twin)
    cli(tiered, "pin", NAMES[0], "--to", "device")
    try:
        for args in (("load", twin, "--to", "host"), ("evict", twin, "--from", "device")):
            assert_one_error(run_cli(*args, "--socket", str(tiered.socket)), 2,
                             f"same content as '{NAMES[0]}', which is pinned to the device", f"loractl unpin {NAMES[0]}")
        listed = listing(tiered)
        assert (listed[NAMES[0]]["tier"], listed[NAMES[0]]["pin"]) == ("device", "device")
        assert (listed[twin]["tier"], listed[twin]["pin"]) == ("device", "device")  # the engine's pin, by content
        status = json.loads(cli(tiered, "status", "--json").stdout)
        assert (status["capacity"]["device_pins"], status["admission"]["pinned"]) == (1, 1)
    finally:
        cli(tiered, "unpin", NAMES[0])
    assert listing(tiered)[twin]["tier"] == "device"
    assert json.loads(cli(tiered, "load", twin, "--to", "host", "--json").stdout)["tier"] == "host"
    cli(tiered, "rm", twin)
    assert json.loads(cli(tiered, "status", "--json").stdout)["admission"]["pinned"] == 0


def test_tier_changes_during_streams_never_change_outputs(tiered, home, reference):
    """Loads, evictions, pins and a refused rm while three generations stream: every output
    still equals its reference, and a request for a missing adapter fails alone."""
    demo = home / "tiny" / "adapters"
    n = 160  # long enough to outlast the churn below on a busy machine (48 did not, at times)
    streams = [None, NAMES[0], NAMES[1]]
    prompt = "How do I reverse a list in Python?"

    async def go():
        async with tiered.client() as client:
            async def one(name):
                return await collect(client, messages=[{"role": "user", "content": prompt}], lora=name,
                                     max_tokens=n, min_tokens=n, temperature=0.0)

            tasks = [asyncio.create_task(one(name)) for name in streams]
            # The rm first, as soon as the daemon holds NAMES[0]'s request: it must be refused
            # (a later rm would race the end of the stream on a fast machine).
            while NAMES[0] not in [r["adapter"] for r in (await client.status())["admission"]["requests"]]:
                await asyncio.sleep(0.005)
            errors = []
            try:
                await client.remove(NAMES[0])
            except Exception as e:  # noqa: BLE001 - asserted below
                errors.append(e)
            churn = [
                client.evict(NAMES[0]), client.load(NAMES[2], to="host"), client.pin(NAMES[1]),
                client.load(NAMES[3]), client.evict(NAMES[3], source="host"), client.unpin(NAMES[1]),
            ]
            for op in churn:
                try:
                    await op
                except Exception as e:  # noqa: BLE001 - collected and asserted below
                    errors.append(e)
            missing = asyncio.create_task(one("no-such/v1"))
            results = await asyncio.gather(*tasks)
            missing_error = await asyncio.gather(missing, return_exceptions=True)
            return results, errors, missing_error[0]

    results, errors, missing_error = asyncio.run(go())
    ids = reference.chat_ids(prompt)
    for name, got in zip(streams, results):
        assert got["ids"] == reference.greedy(ids, demo / name if name else None, n, n), name
    # Only the rm of an adapter that was streaming is refused, with a clear reason.
    assert len(errors) == 1 and "is serving" in str(errors[0]), errors
    assert "no adapter named 'no-such/v1'" in str(missing_error)
    assert NAMES[0] in listing(tiered)


def test_a_new_revision_serves_new_requests_while_old_ones_finish(tiered, home, reference, tmp_path):
    """KV-cache safety with prefix caching on: a re-pull under the same name reaches new
    requests with the new weights, while a request in flight finishes on the old ones."""
    from adapter_factory import good

    old, new = good(home / "tiny", tmp_path / "old", name="rev-old"), good(home / "tiny", tmp_path / "new",
                                                                           name="rev-new")
    cli(tiered, "pull", str(old), "--name", "moving/v1")
    prompt = "Write a query that lists every user"
    n = 128

    async def go():
        async with tiered.client() as client:
            async def one():
                return await collect(client, messages=[{"role": "user", "content": prompt}], lora="moving/v1",
                                     max_tokens=n, min_tokens=n, temperature=0.0)

            warm = await one()  # fills the prefix cache under the old revision
            in_flight = asyncio.create_task(one())
            await asyncio.sleep(0.05)
            async for _ in client.pull(str(new), name="moving/v1", force=True):   # another folder
                pass
            after = await one()
            return warm, await in_flight, after

    warm, in_flight, after = asyncio.run(go())
    ids = reference.chat_ids(prompt)
    expected_old = reference.greedy(ids, old, n, n)
    assert warm["ids"] == expected_old and in_flight["ids"] == expected_old
    assert after["ids"] == reference.greedy(ids, new, n, n) != expected_old
    assert after["adapter"] != in_flight["adapter"]  # a new engine identity for the new content


@pytest.mark.parametrize("to", ["host", "device"])
def test_a_pin_never_blocks_a_step_of_other_adapters(tiered, home, reference, to):
    """With one adapter pinned and max_loras=2, concurrent requests for two *other* adapters
    must not kill the engine (vLLM's own device pin_lora does, unguarded: KeyError in punica's
    convert_mapping), and every output still equals its reference. With the pin on the device,
    the admission gate lets one of the two adapters at a time into the engine: the other's
    requests wait, and ps, status, the events stream and the metrics say so."""
    demo = home / "tiny" / "adapters"
    pinned = cli(tiered, "pin", NAMES[0], "--to", to, "--json")
    assert json.loads(pinned.stdout)["pin"] == to
    n = 48
    prompt = "Once upon a time"
    order = (NAMES[1], NAMES[2], NAMES[1], NAMES[2], NAMES[0])

    async def go():
        async with tiered.client() as client:
            received, queued_seen = [], []

            async def follow():
                async for event in client.events():
                    received.append(event)

            async def watch():
                while True:
                    status = await client.status()
                    queued_seen.extend(r for r in status["admission"]["requests"] if r["state"] == "queued")
                    await asyncio.sleep(0.05)

            watchers = [asyncio.create_task(follow()), asyncio.create_task(watch())]
            await asyncio.sleep(0.3)
            results = await asyncio.gather(*[
                collect(client, messages=[{"role": "user", "content": prompt}], lora=name, max_tokens=n,
                        min_tokens=n, temperature=0.0) for name in order])
            await asyncio.sleep(0.2)
            for task in watchers:
                task.cancel()
            await asyncio.gather(*watchers, return_exceptions=True)
            return results, received, queued_seen

    try:
        results, events, queued_seen = asyncio.run(go())
        ids = reference.chat_ids(prompt)
        for name, got in zip(order, results):
            assert got["ids"] == reference.greedy(ids, demo / name, n, n)
        listed = listing(tiered)
        assert listed[NAMES[0]]["pinned"] and listed[NAMES[0]]["pin"] == to
        assert listed[NAMES[0]]["tier"] == "device" if to == "device" else listed[NAMES[0]]["tier"] in ("host", "device")
        status = json.loads(cli(tiered, "status", "--json").stdout)
        assert status["ready"] and status["capacity"]["device_pins"] == (to == "device")
        waited = [e for e in events if e["kind"] == "WAITED_FOR_SLOT"]
        if to == "device":
            # One of NAMES[1], NAMES[2] had to wait for the other: one place is the pin's.
            assert waited and {e["adapter"] for e in waited} <= {NAMES[1], NAMES[2]}
            assert queued_seen and all(r["position"] >= 1 and r["adapter"] in NAMES[1:3] for r in queued_seen)
            assert status["admission"]["pinned"] == 1 and status["admission"]["places"] == 2
            # Adaptive: batching until its first hand-over, then the measured drain; never above the cap.
            assert status["admission"]["policy"] == "adaptive"
            assert 0 < status["admission"]["max_wait_s"] <= DEFAULT_MAX_WAIT_S, status["admission"]
            text = cli(tiered, "metrics").stdout
            assert 'loractl_admission_wait_seconds_count{adapter="' in text
            assert "loractl_admission_queue_depth" in text
    finally:
        cli(tiered, "unpin", NAMES[0])
    assert not json.loads(cli(tiered, "status", "--json").stdout)["admission"]["pinned"]


def test_ps_lists_requests_running_and_waiting(tiered):
    """ps shows the requests in flight. A device pin takes one of the two places, and two
    clients keep asking for two other adapters, one request after another: at any moment one
    adapter runs and the other's request waits, at position 1. A waiting request whose client
    goes away leaves the line at once."""
    cli(tiered, "pin", NAMES[0], "--to", "device")

    async def go():
        async with tiered.client() as client:
            stop = asyncio.Event()

            async def one(name):
                return await collect(client, prompt="hi", lora=name, max_tokens=240, min_tokens=240, temperature=0.0)

            async def loop(name):
                while not stop.is_set():
                    await one(name)

            loops = [asyncio.create_task(loop(name)) for name in (NAMES[1], NAMES[2])]
            rows = table = None
            deadline = time.monotonic() + 120
            while (rows is None or table is None) and time.monotonic() < deadline:
                if rows is None:
                    out = await asyncio.to_thread(run_cli, "ps", "--json", "--socket", str(tiered.socket))
                    rows = json.loads(out.stdout)["requests"] if '"queued"' in out.stdout else None
                if table is None:
                    out = await asyncio.to_thread(run_cli, "ps", "--socket", str(tiered.socket), env={"COLUMNS": "120"})
                    table = out.stdout if "queued" in out.stdout else None
            gone = asyncio.create_task(one(NAMES[3]))
            while NAMES[3] not in [r["adapter"] for r in (await client.status())["admission"]["requests"]]:
                await asyncio.sleep(0.01)
            gone.cancel()
            await asyncio.gather(gone, return_exceptions=True)
            await asyncio.sleep(0.1)
            left = [r["adapter"] for r in (await client.status())["admission"]["requests"]]
            stop.set()
            await asyncio.gather(*loops)
            return rows, table, left

    try:
        rows, table, left = asyncio.run(go())
    finally:
        cli(tiered, "unpin", NAMES[0])
    assert rows is not None and table is not None, "no request was ever seen waiting"
    assert sorted(r["state"] for r in rows) == ["queued", "running"], rows
    assert {r["adapter"] for r in rows} == {NAMES[1], NAMES[2]}
    queued = next(r for r in rows if r["state"] == "queued")
    assert queued["position"] == 1 and queued["waited_s"] > 0
    assert "running" in table and "queued" in table and any(n in table for n in NAMES[1:3])
    assert NAMES[3] not in left, left  # its place in the line went as its client went
    assert run_cli("ps", "--socket", str(tiered.socket)).stdout.strip() == "no requests in flight"


def test_top_shows_a_request_waiting_for_a_slot_and_quits_on_q(tiered):
    """loractl top on a terminal, as a person watches it: a device pin holds one of the two
    places and two clients keep asking for two other adapters, so one request always waits for
    the other place. The screen shows that waiting request with its wait, tokens/s of the one
    running, the slot changing hands as tier moves, and q quits. In a pipe: plain blocks."""
    import io
    import os
    import re

    import pexpect

    from conftest import BIN

    cli(tiered, "pin", NAMES[0], "--to", "device")
    env = {**os.environ, "NO_COLOR": "1"}
    screen = pexpect.spawn(str(BIN / "loractl"), ["top", "--socket", str(tiered.socket)], env=env,
                           dimensions=(40, 120), timeout=120)
    seen = screen.logfile_read = io.BytesIO()

    async def go():
        async with tiered.client() as client:
            stop = asyncio.Event()

            async def loop(name):
                while not stop.is_set():
                    await collect(client, prompt="hi", lora=name, max_tokens=200, min_tokens=200, temperature=0.0)

            loops = [asyncio.create_task(loop(name)) for name in (NAMES[1], NAMES[2])]
            try:
                # One adapter's request waits (0 running, 1 waiting, its wait) while the other's runs.
                await asyncio.to_thread(screen.expect, rf"({re.escape(NAMES[1])}|{re.escape(NAMES[2])}) +0 +1 +\d+\.\d s")
                await asyncio.to_thread(screen.expect, rf"({re.escape(NAMES[1])}|{re.escape(NAMES[2])}) +1 +0 +- +[1-9]")
                await asyncio.to_thread(screen.expect, r"\d\d:\d\d:\d\d  \S+ -> device")
                piped = await asyncio.to_thread(run_cli, "top", "-n", "2", "-d", "0.5", "--socket", str(tiered.socket))
                # One frame, in a script: its tokens/s is measured already (it showed 0.0).
                once = await asyncio.to_thread(run_cli, "top", "-n", "1", "--socket", str(tiered.socket))
            finally:
                stop.set()
                await asyncio.gather(*loops)
            return piped, once

    try:
        piped, once = asyncio.run(go())
        # The expects above may all have matched in the first frame, and pexpect logs only what it
        # has read: read on to the next frame's clear (CI once had read only one frame).
        screen.expect_exact("\x1b[H\x1b[2J")
        assert seen.getvalue().decode().count("\x1b[H\x1b[2J") >= 2  # redrawn in place
        assert re.search(rf"device +2/2 slots +[^\r]*{re.escape(NAMES[0])} \[pin device\]", seen.getvalue().decode())
        screen.send("q")
        screen.expect(pexpect.EOF)
        screen.close()
        assert screen.exitstatus == 0
    finally:
        screen.close(force=True)
        cli(tiered, "unpin", NAMES[0])
    assert piped.returncode == 0, piped.stderr
    assert piped.stdout.count("loractl top - loractl/demo-tiny-llama on cpu") == 2 and "\x1b" not in piped.stdout
    assert once.returncode == 0 and once.stdout.count("loractl top - ") == 1, once.stderr
    rates = [float(m) for m in re.findall(rf"^(?:{re.escape(NAMES[1])}|{re.escape(NAMES[2])}) .* (\d+\.\d)$",
                                          once.stdout, re.M)]
    assert rates and max(rates) > 0, once.stdout


def test_every_tier_change_under_thrash_is_reported_in_order(tiered):
    """Concurrent requests over more adapters than slots, with explicit loads and evictions in
    between: replaying the events stream from the state before must give every transition in
    a valid order (nothing loaded twice, nothing evicted that was not there) and end in the
    state ls reads from the engine after. The daemon reads the engine's state only now and
    then (never per request), so this holds only because the worker journals every change."""

    def residency() -> tuple[set[str], set[str]]:
        listed = listing(tiered)
        return ({n for n in NAMES if listed[n]["tier"] in ("host", "device")},
                {n for n in NAMES if listed[n]["tier"] == "device"})

    async def go():
        async with tiered.client() as client:
            received = []

            async def follow():
                async for event in client.events():
                    received.append(event)

            before = residency()  # the daemon is idle: nothing changes between this and the follow
            task = asyncio.create_task(follow())
            await asyncio.sleep(0.3)
            rng = random.Random(11)

            async def one(name):
                await collect(client, messages=[{"role": "user", "content": "hi"}], lora=name, max_tokens=6,
                              temperature=0.0)

            for wave in range(4):
                requests = [asyncio.create_task(one(rng.choice(NAMES))) for _ in range(10)]
                await client.load(NAMES[wave], to="host")
                await client.evict(NAMES[(wave + 1) % 4], source="host")
                await asyncio.gather(*requests)
            await asyncio.sleep(1.0)  # the follower reads within its interval after the last request
            after = residency()
            await asyncio.sleep(0.3)
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            return before, after, received

    (host, device), after, events = asyncio.run(go())
    tiers = {"HOST": host, "DEVICE": device}
    reasons = set()
    for e in (e for e in events if e["adapter"] in NAMES):
        kind, name = e["kind"], e["adapter"]
        reasons.add(e["reason"])
        if kind.startswith("LOADED_TO_"):
            tier = tiers[kind.removeprefix("LOADED_TO_")]
            assert name not in tier, (e, events)
            assert kind != "LOADED_TO_DEVICE" or name in host, (e, events)
            tier.add(name)
        elif kind in ("EVICTED_FROM_HOST", "UNLOADED_FROM_DEVICE"):
            tier = host if kind == "EVICTED_FROM_HOST" else device
            assert name in tier and (kind != "EVICTED_FROM_HOST" or name not in device), (e, events)
            tier.remove(name)
    assert (host, device) == after
    assert {"lazy", "lru", "explicit"} <= reasons, reasons


def test_events_show_what_happened_before_the_command_started(daemon, demo):
    """``loractl events`` replays the most recent events the daemon kept, then follows: run after
    the fact it showed nothing and looked hung."""
    pulled = run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", "hist-poet/v1",
                     "--socket", str(daemon.socket))
    assert pulled.returncode == 0, pulled.stderr

    async def replayed() -> list[dict]:
        seen = []
        async with daemon.client() as client:
            stream = client.events(history=256)
            while not any(e["kind"] == "DOWNLOADED_TO_DISK" and e["adapter"] == "hist-poet/v1" for e in seen):
                seen.append(await asyncio.wait_for(anext(stream), 10))
            await stream.aclose()
        return seen

    assert asyncio.run(replayed())[-1]["adapter"] == "hist-poet/v1"
    shown = run_cli("events", "--history", "256", "-n", "1", "--json", "--socket", str(daemon.socket), timeout=30)
    assert shown.returncode == 0 and json.loads(shown.stdout)["kind"], shown.stderr


def test_admission_passthrough_lets_every_adapter_in_and_holds_for_a_device_pin(tiered, home, reference):
    """Issue 58: ``loractl admission passthrough`` while serving. Four adapters stream at once
    on two device slots: none waits at the gate (vLLM's scheduler takes the turns) and every
    output equals its reference; a device pin makes the gate hold, and says why; its unpin
    lets it pass again. An unknown policy is refused in one line. The module's policy is put back."""
    demo = home / "tiny" / "adapters"
    n = 48
    prompt = "Name a colour."
    shown = cli(tiered, "admission", "passthrough").stdout
    assert "admission passthrough: passthrough (vLLM's scheduler keeps each step within max_loras)" in shown
    try:
        status = json.loads(cli(tiered, "status", "--json").stdout)["admission"]
        assert (status["policy"], status["mode"]) == ("passthrough", "passthrough")
        assert "gate" in cli(tiered, "status").stdout

        async def go():
            async with tiered.client() as client:
                tasks = [asyncio.create_task(collect(client, messages=[{"role": "user", "content": prompt}], lora=name,
                                                     max_tokens=n, min_tokens=n, temperature=0.0)) for name in NAMES]
                queued = 0
                while not all(t.done() for t in tasks):
                    queued = max(queued, (await client.status())["admission"]["queued"])
                    await asyncio.sleep(0.01)
                return [t.result() for t in tasks], queued

        results, queued = asyncio.run(go())
        ids = reference.chat_ids(prompt)
        for name, got in zip(NAMES, results):
            assert got["ids"] == reference.greedy(ids, demo / name, n, n), name
        assert queued == 0, "a request waited at the gate under passthrough"
        cli(tiered, "pin", NAMES[0], "--to", "device")
        try:
            gate = json.loads(cli(tiered, "admission", "--json").stdout)
            assert (gate["mode"], gate["mode_reason"]) == ("holding", "1 device pin: vLLM alone would evict it mid-step")
        finally:
            cli(tiered, "unpin", NAMES[0])
        assert json.loads(cli(tiered, "admission", "--json").stdout)["mode"] == "passthrough"
        assert_one_error(run_cli("admission", "lifo", "--socket", str(tiered.socket)), 2,
                         "unknown admission policy 'lifo'", "passthrough")
        assert_one_error(run_cli("admission", "batching", "--max-wait", "-1", "--socket", str(tiered.socket)), 2,
                         "--max-wait must be 0 or more")
    finally:
        back = json.loads(cli(tiered, "admission", POLICY[1], "--max-wait", str(DEFAULT_MAX_WAIT_S), "--json").stdout)
    assert (back["policy"], back["mode"]) == (POLICY[1], "holding")
