"""Exchange traffic, seen by a user (issue 48, item 7): four adapters asked for in turn on a
daemon whose host RAM holds three and device two, so that every request loads its adapter from
disk to host and from host to device (LRU thrash). The metrics count each load and the bytes
it moved (the weights files read; onto the device, what the engine holds of them), and
``loractl top --json``'s refreshes add up to the same traffic."""

from __future__ import annotations

import json
import re
import subprocess
import time

import pytest

from conftest import BIN, own_daemon, run_cli
from loractl.cli._exchange import counters

NAMES = ["sql-expert/v1", "python-expert/v1", "poet/v1", "translator/v1"]   # four, over 3 host entries
ORDER = NAMES * 2


@pytest.fixture(scope="module")
def thrashing(home):
    d = own_daemon(home, "exchange", NAMES, name="x")
    yield d
    d.stop()


def cli(d, *args) -> str:
    result = run_cli(*args, "--socket", str(d.socket))
    assert result.returncode == 0, (args, result.stderr)
    return result.stdout


def test_loads_bytes_and_waits_per_tier_in_the_metrics_and_in_top(thrashing):
    # The weights files as stored (a pull may have rewritten a demo adapter's keys: not the source's size).
    sizes = {a["name"]: next(f["size"] for f in a["files"] if f["name"] == "adapter_model.safetensors")
             for a in json.loads(cli(thrashing, "ls", "--json"))}
    top = subprocess.Popen([str(BIN / "loractl"), "top", "--json", "-d", "0.5", "--socket", str(thrashing.socket)],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        frames = [json.loads(top.stdout.readline())]   # its first reading is taken before any request
        before = counters(cli(thrashing, "metrics"))
        engine_bytes = {}
        for name in ORDER:
            cli(thrashing, "run", "--lora", name, "-t", "0", "-n", "2", "hi")
            listed = {a["name"]: a for a in json.loads(cli(thrashing, "ls", "--json"))}
            assert listed[name]["tier"] == "device"
            engine_bytes[name] = listed[name]["host_bytes"]
        after = counters(cli(thrashing, "metrics"))
        ended = time.time()
        while frames[-1]["time"] < ended + 0.2:        # a refresh that read after the last request
            frames.append(json.loads(top.stdout.readline()))
    finally:
        top.terminate()
        top.wait(30)
    moved = {key: after.get(key, 0) - before.get(key, 0) for key in after}
    status = json.loads(cli(thrashing, "status", "--json"))["capacity"]

    # Every request missed both tiers: A B C D A B C D over three host entries and two slots.
    assert moved[("loads", "host")] == len(ORDER) and moved[("loads", "device")] == len(ORDER)
    assert moved[("bytes", "host")] == sum(sizes[n] for n in ORDER) > 1e6   # exact past six digits
    assert moved[("bytes", "device")] == sum(engine_bytes[n] for n in ORDER) > 0
    # What came in and did not leave is what each tier holds now (all started empty).
    for tier, held in (("host", status["host_used"]), ("device", status["device_used"])):
        total = after[("loads", tier)] - after.get(("evictions", tier), 0)
        assert total == held, (tier, after)
    # Each request's slot wait is counted; each waited for its adapter's load too (from disk or
    # host, as last read when it was admitted).
    assert moved[("slot", "count")] == len(ORDER)
    load_waits = sum(moved.get((f"load from {t}", "count"), 0) for t in ("disk", "host"))
    assert load_waits == len(ORDER)
    assert sum(moved.get((f"load from {t}", "sum"), 0) for t in ("disk", "host")) > 0

    # top's refreshes cover the run without gaps: their traffic adds up to the counters'.
    shown = {(what, tier): sum(f["exchange"]["tiers"][tier][what] for f in frames[1:])
             for what in ("loads", "bytes", "evictions") for tier in ("host", "device")}
    assert shown == {key: after.get(key, 0) - before.get(key, 0) for key in shown}, frames
    assert sum(f["exchange"]["waits"].get("slot", {}).get("requests", 0) for f in frames) == len(ORDER)
    assert frames[-1]["tiers"]["host"]["used"] == status["host_used"]

    # The worker timed the 8 copies, the 8 loads and the steps: the exchange price (auto's
    # measure) is a positive number of steps, and a step's own time a positive time.
    text = cli(thrashing, "metrics")
    price = re.search(r"^loractl_exchange_price_steps (\S+)$", text, re.M)
    step = re.search(r"^loractl_engine_step_seconds (\S+)$", text, re.M)
    assert price and step, text[-2000:]
    assert float(price.group(1)) > 0 and 0 < float(step.group(1)) < 5
