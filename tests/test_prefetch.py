"""Prefetch at the gate (issue 48, item 3), on the real engine: one device slot and two host
entries. A long request for A holds the slot; B then waits at the gate with a free host entry,
so B is prefetched and its turn starts from host RAM (a hit); C waits while host RAM holds A
(running) and B (waiting), so C may not be prefetched then: that would evict an adapter a
request needs, and the engine would read it from disk again. Once A's request ended, A's entry
is free to take (removed first: vLLM's LRU would evict B, admitted and not yet stepped) and C is
prefetched during B's turn.

Checked: the prefetch counters (2 loaded, 2 hits, no miss, nothing wasted), each adapter read
from disk exactly once (a prefetch that evicted A or B would show a fourth load), the answers
token-equal to the same requests sent alone without waiting (so without a prefetch), and
``loractl top --json``'s refreshes adding up to the counters."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time

import pytest

from conftest import BIN, collect, own_daemon
from test_exchange_metrics import cli
from loractl.cli._exchange import PREFETCH, counters

A, B, C = "sql-expert/v1", "python-expert/v1", "poet/v1"
SHORT = dict(prompt="hello there", max_tokens=48, min_tokens=48, temperature=0.0)   # a turn outlasts a load


@pytest.fixture(scope="module")
def fetching(home):
    d = own_daemon(home, "prefetch", [A, B, C], "--prefetch", "--max-loras", "1", "--max-cpu-loras", "2",
                   name="p")
    yield d
    d.stop()


async def _until(client, adapter: str, state: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        rows = (await client.status())["admission"]["requests"]
        if any(r["adapter"] == adapter and r["state"] == state for r in rows):
            return
        await asyncio.sleep(0.005)
    raise AssertionError(f"{adapter} never {state}")


def test_waiting_requests_find_their_adapters_in_host_ram(fetching):
    top = subprocess.Popen([str(BIN / "loractl"), "top", "--json", "-d", "0.5", "--socket", str(fetching.socket)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frames = [json.loads(top.stdout.readline())]
        before = counters(cli(fetching, "metrics"))

        async def go():
            async with fetching.client() as client:
                long = asyncio.create_task(collect(client, prompt="hi", lora=A, max_tokens=240, min_tokens=240,
                                                   temperature=0.0))
                await _until(client, A, "running")
                b = asyncio.create_task(collect(client, lora=B, **SHORT))
                await _until(client, B, "queued")
                c = asyncio.create_task(collect(client, lora=C, **SHORT))
                await _until(client, C, "queued")
                assert not long.done(), "A's request ended before B and C waited: the test needs it longer"
                return await asyncio.gather(long, b, c)

        waited = asyncio.run(go())
        after = counters(cli(fetching, "metrics"))
        ended = time.time()
        while frames[-1]["time"] < ended + 0.2:
            frames.append(json.loads(top.stdout.readline()))
    finally:
        top.terminate()
        top.wait(30)
    moved = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    prefetch = {r: moved.get(("prefetch", r), 0) for r in PREFETCH}
    assert prefetch == {"loaded": 2, "hit": 2, "miss": 0, "late": 0, "wasted": 0}, (prefetch, fetching.log_tail())
    # Read from disk once each: nothing a request needed was evicted to make room for a prefetch.
    assert moved[("loads", "host")] == 3, moved
    # top shows the same prefetch counts, refresh by refresh.
    shown = {r: sum(f["exchange"]["prefetch"][r] for f in frames[1:]) for r in PREFETCH}
    assert shown == prefetch, frames

    # The same requests alone: each adapter from disk again, admitted at once (no prefetch).
    for name in (B, C):
        cli(fetching, "evict", name, "--from", "host")

    async def alone():
        async with fetching.client() as client:
            return [await collect(client, lora=name, **SHORT) for name in (B, C)]

    assert [r["ids"] for r in asyncio.run(alone())] == [waited[1]["ids"], waited[2]["ids"]]
    assert len(waited[0]["ids"]) == 240
    later = counters(cli(fetching, "metrics"))
    assert later.get(("prefetch", "loaded"), 0) == after.get(("prefetch", "loaded"), 0)


def test_prefetch_is_off_by_default_and_documented():
    """Off unless asked (docs/benchmarks.md: it did not pay on CPU), and the help says so."""
    out = subprocess.run([str(BIN / "loractld"), "--help"], capture_output=True, text=True, timeout=60).stdout
    assert "--prefetch, --no-prefetch" in out and "default: off" in " ".join(out.split())
