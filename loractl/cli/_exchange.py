"""Exchange traffic for ``loractl top``, read from the daemon's Prometheus text: loads, bytes and
evictions per tier, and why requests waited (for a device slot at the admission gate, or, once
admitted, for their adapter's load), each as a rate over the last refresh.

The daemon's counters (loractld/events.py, ``Metrics.HELP``): ``loractl_adapter_loads_total``,
``loractl_adapter_load_bytes_total`` and ``loractl_adapter_evictions_total`` per tier (host: disk
to host RAM; device: host RAM to a slot), ``loractl_admission_wait_seconds`` (a slot) and
``loractl_adapter_load_wait_seconds`` (a load, by where the adapter came from) histograms, and
``loractl_adapter_prefetch_total`` by result (the prefetch at the gate, loractld/serving/prefetch.py).
Counters only grow while the daemon runs, so a rate is a difference of two readings.
"""

from __future__ import annotations

import re
from typing import Any

_SAMPLE = re.compile(r'^(?P<name>[a-zA-Z_:][\w:]*)(?:\{(?P<labels>.*)\})?\s+(?P<value>\S+)$')
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
TIERS = ("host", "device")
_PER_TIER = {"loractl_adapter_loads_total": "loads", "loractl_adapter_load_bytes_total": "bytes",
             "loractl_adapter_evictions_total": "evictions"}
PREFETCH = ("loaded", "hit", "miss", "late", "wasted")
_WAITS = {"loractl_admission_wait_seconds": "slot", "loractl_adapter_load_wait_seconds": "load"}


def samples(text: str):
    """(name, labels, value) of every sample in Prometheus text."""
    for line in text.splitlines():
        match = _SAMPLE.match(line)
        if match:
            yield match["name"], dict(_LABEL.findall(match["labels"] or "")), float(match["value"])


def counters(text: str) -> dict[tuple[str, str], float]:
    """The exchange counters: (loads|bytes|evictions, tier) summed over other labels, and
    (wait kind, "sum"|"count") for waits: ("slot", ...), ("load from disk", ...), ("load from host", ...)."""
    found: dict[tuple[str, str], float] = {}
    for name, labels, value in samples(text):
        if name in _PER_TIER:
            key = (_PER_TIER[name], labels.get("tier", ""))
        elif name == "loractl_adapter_prefetch_total":
            key = ("prefetch", labels.get("result", ""))
        elif name.endswith(("_sum", "_count")) and name.rsplit("_", 1)[0] in _WAITS:
            base, part = name.rsplit("_", 1)
            kind = _WAITS[base] + (f" from {labels['from']}" if "from" in labels else "")
            key = (kind, part)
        else:
            continue
        found[key] = found.get(key, 0.0) + value
    return found


def over(before: dict[tuple[str, str], float], after: dict[tuple[str, str], float],
         elapsed: float) -> dict[str, Any]:
    """What moved between two readings ``elapsed`` seconds apart: per tier the loads, bytes and
    evictions and their rates; per wait kind the requests that finished waiting and their mean."""
    def delta(key: tuple[str, str]) -> float:
        return max(after.get(key, 0.0) - before.get(key, 0.0), 0.0)   # a restarted daemon: from 0

    elapsed = max(elapsed, 1e-6)
    tiers = {}
    for tier in TIERS:
        moved = {what: delta((what, tier)) for what in ("loads", "bytes", "evictions")}
        tiers[tier] = {**{k: int(v) for k, v in moved.items()},
                       **{f"{k}_per_s": round(v / elapsed, 3) for k, v in moved.items()}}
    waits = {}
    for kind in sorted({k for k, part in after if part == "count"}):
        count, total = delta((kind, "count")), delta((kind, "sum"))
        waits[kind] = {"requests": int(count), "mean_s": round(total / count, 4) if count else 0.0}
    prefetch = {result: int(delta(("prefetch", result))) for result in PREFETCH}
    return {"seconds": round(elapsed, 3), "tiers": tiers, "waits": waits, "prefetch": prefetch}


def lines(moved: dict[str, Any]) -> list[str]:
    """The exchange as plain lines for ``top``'s screen."""
    out = [f"{'EXCHANGE':<8} {'LOADS/S':>8} {'BYTES/S':>10} {'EVICTIONS/S':>12}"]
    for tier in TIERS:
        row = moved["tiers"][tier]
        arrow = "disk->host" if tier == "host" else "host->dev"
        out.append(f"{arrow:<10} {row['loads_per_s']:>6.1f} {_bytes(row['bytes_per_s']):>10} "
                   f"{row['evictions_per_s']:>12.1f}")
    shown = moved.get("prefetch", {})
    out.append("prefetch   " + "  ".join(f"{result} {shown.get(result, 0)}" for result in PREFETCH))
    waited = [f"for a {kind} {w['requests']} requests, mean {w['mean_s']:.3f} s"
              for kind, w in moved["waits"].items() if w["requests"]]
    out.append("waited     " + ("; ".join(waited) if waited else "no request waited in this refresh"))
    return out


def _bytes(rate: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if rate < 1000 or unit == "GB":
            return f"{rate:.0f} {unit}" if unit == "B" else f"{rate:.1f} {unit}"
        rate /= 1000
    return f"{rate:.1f} GB"
