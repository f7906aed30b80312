"""``loractl top``'s screen from a daemon's answers (issue 60, item 9): profiles are not counted
as adapters (they hold no slot and no file of their own), copies that share content show as
one slot (``a = b``), and a refresh in which no request waited says so in words.

The answers are built here (render is a pure function); tests/test_tiers.py watches the real
screen of a real daemon."""

from __future__ import annotations

import collections

from loractl.cli import _exchange
from loractl.cli.top import render

STATUS = {"engine": {"model_name": "demo", "model": "tiny", "device": "cpu"},
          "capacity": {"device_used": 2, "device_slots": 2, "host_used": 1, "host_slots": 3}, "admission": {}}


def _adapter(name: str, tier: str, slot: int = -1, kind: str = "adapter", pin: str = "") -> dict:
    return {"name": name, "tier": tier, "slot": slot, "kind": kind, "pin": pin, "pinned": bool(pin)}


def _exchange_frame(waits: dict) -> dict:
    row = {"loads_per_s": 0.0, "bytes_per_s": 0.0, "evictions_per_s": 0.0}
    return {"seconds": 1.0, "tiers": {tier: dict(row) for tier in _exchange.TIERS}, "waits": waits,
            "prefetch": {result: 0 for result in _exchange.PREFETCH}}


def test_profiles_are_not_adapters_and_copies_share_their_slot():
    adapters = [_adapter("sql-expert/v1", "device", 0), _adapter("sql-copy/v1", "device", 0, pin="device"),
                _adapter("poet/v1", "device", 1), _adapter("translator/v1", "host"),
                _adapter("python-expert/v1", "disk"), _adapter("sql-pirate", "disk", kind="profile")]
    lines = render(STATUS, adapters, {}, None, collections.deque(), 0.0, _exchange_frame({}))
    by_tier = {line.split()[0]: line for line in lines if line.split()[:1] in (["device"], ["host"], ["disk"])}
    assert by_tier["device"].endswith("2/2 slots  sql-expert/v1 = sql-copy/v1 [pin device], poet/v1"), by_tier
    assert by_tier["host"].endswith("translator/v1"), by_tier
    assert by_tier["disk"].startswith("disk    5 adapters  python-expert/v1"), by_tier   # 6 listed, 1 a profile
    assert "sql-pirate" not in "\n".join(lines)
    assert "waited     no request waited in this refresh" in lines


def test_waits_are_named_by_what_was_waited_for():
    waits = {"device slot": {"requests": 3, "mean_s": 0.25}, "load": {"requests": 0, "mean_s": 0.0}}
    out = _exchange.lines(_exchange_frame(waits))
    assert out[-1] == "waited     for a device slot 3 requests, mean 0.250 s", out
