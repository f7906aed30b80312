"""A bounded concurrency storm on the shared rig (bench/storm.py, where a longer run lives): random
generations (short and over 2,048 characters, streamed and cancelled midway), pulls, re-pulls of
a new revision, rm --force, load, evict, pin and unpin both ways over three names, a fifth of
those commands abandoned by their client at a random moment; afterwards the
engine is alive, no request waited past the bound, ls equals the store, residency and pins are
within their caps, nothing is left in the store's temporaries, and every answer equals the
HF + PEFT reference for the content it ran with."""

from __future__ import annotations

import asyncio
import sys

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import storm  # noqa: E402

SECONDS = 25      # plus the checks: the whole test stays under 60 s on the 2-core CI machine
BOUND = 30.0


def test_storm_of_commands_and_requests(rig, reference):
    folders = sorted(d / "v1" for d in (rig.root / "tiny" / "adapters").iterdir())
    names = ["storm/a", "storm/b", "storm/c"]
    sock = str(rig.daemon.socket)
    try:
        report = asyncio.run(storm.storm(sock, folders, names=names, seconds=SECONDS, seed=22, bound=BOUND))
    finally:
        asyncio.run(storm.tidy(sock, names))
    summary = report.summary()
    print(f"\nstorm: {summary}")
    assert report.failures == [], (report.failures, rig.daemon.log_tail())
    assert report.requests["completed"] >= 10 and report.requests["cancelled"] >= 1, summary
    assert report.requests["of which over 2,048 characters"] >= 1, summary
    for kind in ("pull", "rm", "pin host", "pin device", "unpin", "load device", "evict host"):
        assert any(op.startswith(kind) for op in report.operations), (kind, summary)
    assert any(op.endswith(": abandoned") for op in report.operations), summary
    assert storm.check_answers(report, reference) == []
