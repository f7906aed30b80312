"""SIGKILL of the daemon's own pid at each step that changes something (a load, an eviction, a
pin, a removal, a pull's final rename, a write of state.json), and of a client mid-stream.

The daemon kills itself at the step named in an arming file (the suite's hook,
tests/hooks_plugin/loractl_test_hooks.py, at a point of loractld/worker/hooks.py), as ``kill -9
PID`` or the OOM killer would. After the restart, for every step: the CLI's call that was cut
got one clean error line; the store, the pins and state.json agree; nothing half-installed is
visible or left on disk; and a generation equals the HF + PEFT reference.

The daemon is a rig of this module's own (conftest's ``Rig``): each case runs on the daemon
the previous case restarted, so a kill point costs one daemon start (about 14 s on two cores). The kills inside an engine step,
before anything on disk changed (load to device or host, pin, evict), run with
LORACTL_TEST_EVERY_KILL_POINT=1 only; those in the steps that change files always run.
(The engine process killed under the daemon: tests/test_faults.py.)
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import RIG_CONTEXT, Rig, sub_home
from support_daemons import stop_at_end

ADAPTERS = ["poet/v1", "sql-expert/v1"]
PROBE = ("poet/v1", "hi", 8)  # adapter, prompt, tokens: as in test_faults, so the reference is shared


def pins(rig: Rig) -> list[str]:
    state = rig.root / "state" / "state.json"
    return json.loads(state.read_text())["pins"] if state.exists() else []


@pytest.fixture(scope="module")
def kills(home):
    """A rig of this module's own, with the two adapters in its store and nothing pinned: what
    is checked after each restart is the whole store, and on the shared rig it held whatever
    the modules run before on that worker had made (profiles, merges, blobs)."""
    rig = Rig(sub_home(home, "kills"), ("--max-model-len", str(RIG_CONTEXT)))
    rig.start()
    rig.pull(*ADAPTERS)
    yield rig
    stop_at_end(rig.daemon.proc)


def probe_is_right(rig: Rig, reference, demo) -> None:
    adapter, prompt, n = PROBE
    out = rig.ok("run", "-t", "0", "-n", str(n), "--lora", adapter, prompt)
    assert out.stdout == reference.text(reference.greedy(reference.chat_ids(prompt), demo / "adapters" / adapter, n)) \
        + "\n"


def assert_consistent(rig: Rig) -> dict[str, dict]:
    """What ls shows is what the store holds, every pin is a listed adapter's and shows as
    pinned, and no leftover of a cut operation is on disk. Returns the listing."""
    listed = {a["name"]: a for a in json.loads(rig.ok("ls", "--json").stdout)}
    store = rig.root / "adapters"
    names = {f"{org.name}/{link.name}" for org in store.iterdir() if not org.name.startswith(".")
             for link in org.iterdir()}
    assert set(listed) == names, (listed.keys(), names)
    pinned = pins(rig)
    assert set(pinned) <= set(listed), pinned
    assert {n for n, a in listed.items() if a["pinned"]} == set(pinned), (pinned, listed)
    # Leftovers: staging folders, temporary links and files, objects no name points to.
    assert not any((store / ".tmp").iterdir())
    # Copies of folders; the format; what other modules on this rig made (profiles, blobs, a create's record).
    hidden = [p.name for p in store.iterdir() if p.name.startswith(".")
              and p.name not in (".objects", ".tmp", ".snapshots", ".loractl-store.json", ".profiles", ".blobs",
                                 ".creates")]
    assert not list((store / ".creates").glob("*")), "a create's record outlived it"
    hidden += [f"{org.name}/{p.name}" for org in store.iterdir() if not org.name.startswith(".")
               for p in org.iterdir() if p.name.startswith(".")]
    assert not hidden, hidden
    assert all(any(org.iterdir()) for org in store.iterdir() if not org.name.startswith(".")), "an empty org folder"
    objects = {p.name for p in (store / ".objects").iterdir()}
    assert objects == {Path(a["path"]).name for a in listed.values()}, (objects, listed)
    assert not list((rig.root / "state").glob(".state.json.*"))
    return listed


# (step armed, what to do first, the call that reaches the step, what must hold after the restart)
CASES = {
    "load-to-device": ("engine-add", [], ["load", "poet/v1", "--to", "device"],
                       lambda ls: ls["poet/v1"]["tier"] == "disk"),
    "load-to-host": ("engine-deactivate", [], ["load", "poet/v1", "--to", "host"],
                     lambda ls: ls["poet/v1"]["tier"] == "disk"),
    "pin": ("engine-pin", [], ["pin", "poet/v1"],  # killed before state.json records the pin
            lambda ls: not ls["poet/v1"]["pinned"]),
    "evict": ("engine-remove", [["load", "poet/v1", "--to", "host"]], ["evict", "poet/v1", "--from", "host"],
              lambda ls: ls["poet/v1"]["tier"] == "disk"),
    # rm unlinks the name before it drops the pin: the restart must not keep a pin of nothing.
    "rm": ("store-unlink", [["pin", "sql-expert/v1"]], ["rm", "--force", "sql-expert/v1"],
           lambda ls: "sql-expert/v1" not in ls),
    # The object is in .objects/ and a temporary link beside where the name goes: neither stays.
    "pull-rename": ("store-installed", [], ["pull", "{demo}/adapters/translator/v1", "--name", "crash/pulled"],
                    lambda ls: "crash/pulled" not in ls),
    # The old state.json stands (the pin holds), the half-written one is gone.
    "state-write": ("write:state.json", [["pin", "poet/v1"]], ["unpin", "poet/v1"],
                    lambda ls: ls["poet/v1"]["pinned"] and ls["poet/v1"]["tier"] == "device"),
}


# Kills in the engine's steps, before anything on disk changed (the engine's tiers die with the
# daemon): each costs a restart (~14 s on two cores) and none found anything, so they run on
# request only; the steps that change files on disk always run.
ENGINE_ONLY = {"load-to-device", "load-to-host", "pin", "evict"}
EVERY = os.environ.get("LORACTL_TEST_EVERY_KILL_POINT") == "1"


@pytest.mark.parametrize("case", [pytest.param(case, marks=pytest.mark.skipif(
    case in ENGINE_ONLY and not EVERY, reason="set LORACTL_TEST_EVERY_KILL_POINT=1 (a restart each)"))
    for case in CASES])
def test_sigkill_at_a_step_then_restart(kills, case, demo, reference):
    rig = kills
    step, setup, call, holds = CASES[case]
    for args in setup:
        rig.ok(*args)
    rig.arm.write_text(step)
    cut = rig.cli(*[a.format(demo=demo) for a in call])
    assert rig.daemon.proc.wait(30) == -signal.SIGKILL, rig.daemon.log_tail()
    assert not rig.arm.exists()
    assert cut.returncode != 0, cut.stdout
    lines = [ln for ln in cut.stderr.splitlines() if ln.startswith(("loractl: error:", "hint:"))]
    assert len(lines) == 2 and "Traceback" not in cut.stderr, cut.stderr
    rig.start()
    listed = assert_consistent(rig)
    assert holds(listed), listed
    probe_is_right(rig, reference, demo)


def test_sigkill_of_a_client_mid_stream_aborts_its_request(kills, reference, demo):
    """A client killed while its generation streams: the daemon ends the request in the engine
    (vLLM's counters stop short) and serves the next one right."""
    rig = kills

    async def engine() -> tuple[float, float]:
        async with rig.daemon.client() as c:
            text = await c.metrics()
        running, tokens = (re.findall(rf"^vllm:{name}\{{[^}}]*\}} (\S+)$", text, re.M)
                           for name in ("num_requests_running", "generation_tokens_total"))
        assert running and tokens, text[-2000:]
        return sum(map(float, running)), sum(map(float, tokens))

    _, before = asyncio.run(engine())
    # loractl.Client in a process of its own, so that min_tokens holds the request to its whole length:
    # nearly the rig's context, long enough that a loaded machine still aborts it midway.
    length = RIG_CONTEXT - 48
    code = ("import asyncio, sys\nfrom loractl import Client\n"
            "async def go():\n"
            f"    async with Client({str(rig.daemon.socket)!r}) as c:\n"
            f"        async for chunk in c.generate(prompt='Once', lora='poet/v1', max_tokens={length}, min_tokens={length},"
            " temperature=0.0):\n"
            "            sys.stdout.write(chunk.text); sys.stdout.flush()\n"
            "asyncio.run(go())\n")
    client = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert client.stdout.read(1), client.stderr.read()  # text streams: the request is in the engine
        os.kill(client.pid, signal.SIGKILL)
    finally:
        client.wait(30)
    deadline = time.monotonic() + 30  # generous: a loaded two-core machine
    while (state := asyncio.run(engine()))[0] > 0:
        assert time.monotonic() < deadline, "the engine still runs the killed client's request"
        time.sleep(0.05)
    assert 0 < state[1] - before < length, state[1] - before  # it ran, and not to its end
    assert rig.daemon.proc.poll() is None
    probe_is_right(rig, reference, demo)
