"""Lifecycle events and Prometheus metrics, shared by the tiers, the store and the service.

Events are fanned out to every subscriber (the ``Events`` RPC) and logged; a slow subscriber
drops its oldest events rather than stalling the daemon.
"""

from __future__ import annotations

import asyncio
import bisect
import collections
import logging
import time
from dataclasses import dataclass, field

_log = logging.getLogger("loractld.events")

KINDS = ("DOWNLOADED_TO_DISK", "DELETED_FROM_DISK", "LOADED_TO_HOST", "EVICTED_FROM_HOST", "LOADED_TO_DEVICE",
         "UNLOADED_FROM_DEVICE", "PINNED", "UNPINNED", "FAILED", "WAITED_FOR_SLOT",
         "ENGINE_FALLING_ASLEEP", "ENGINE_ASLEEP", "ENGINE_WAKING", "ENGINE_AWAKE")   # the engine's --keep-alive sleep (serving.keep_alive)
# Events about requests, not about where adapters are: the registry entry need not be rewritten.
REQUEST_KINDS = ("WAITED_FOR_SLOT",)


@dataclass
class Event:
    kind: str
    adapter: str
    message: str = ""
    reason: str = ""       # explicit, lru, rm, lazy, preload, ...
    time: float = field(default_factory=time.time)


class EventBus:
    """Fans events out to subscribers, and keeps the last ``backlog`` for a subscriber that asks
    what happened before it came (``loractl events`` shows them first)."""

    def __init__(self, backlog: int = 256) -> None:
        self._subscribers: set[asyncio.Queue] = set()
        self._backlog = backlog
        self._recent: collections.deque[Event] = collections.deque(maxlen=backlog)

    def publish(self, event: Event) -> None:
        assert event.kind in KINDS, event.kind
        _log.info("%s %s%s", event.kind, event.adapter, f" ({event.reason})" if event.reason else "")
        self._recent.append(event)
        for queue in list(self._subscribers):
            if queue.full():
                queue.get_nowait()
            queue.put_nowait(event)

    def subscribe(self, history: int = 0) -> asyncio.Queue:
        """A queue of the events from now on, after the last ``history`` ones kept."""
        queue: asyncio.Queue = asyncio.Queue(self._backlog)
        for event in list(self._recent)[-history:] if history > 0 else ():
            queue.put_nowait(event)
        self._subscribers.add(queue)
        return queue

    def unsubscribe(self, queue: asyncio.Queue) -> None:
        self._subscribers.discard(queue)


class Metrics:
    """Counters, gauges and histograms, rendered in the Prometheus text format."""

    LOAD_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)

    def __init__(self) -> None:
        self.counters: dict[str, collections.Counter] = collections.defaultdict(collections.Counter)
        self.gauges: dict[str, dict[tuple, float]] = collections.defaultdict(dict)
        self._hist: dict[tuple, list] = {}
        self._buckets: dict[str, tuple[float, ...]] = {}

    def inc(self, name: str, labels: tuple = (), by: float = 1) -> None:
        self.counters[name][labels] += by

    def set(self, name: str, labels: tuple, value: float) -> None:
        self.gauges[name][labels] = value

    def observe(self, name: str, labels: tuple, value: float, buckets: tuple[float, ...] = LOAD_BUCKETS) -> None:
        """``buckets``: a histogram's bounds, fixed by its first observation."""
        bounds = self._buckets.setdefault(name, buckets)
        counts, total = self._hist.setdefault((name, labels), [[0] * (len(bounds) + 1), 0.0])
        counts[bisect.bisect_left(bounds, value)] += 1
        self._hist[(name, labels)][1] = total + value

    HELP = {
        "loractl_adapter_load_seconds": ("histogram", "Time to load an adapter into a tier."),
        "loractl_adapter_loads_total": ("counter", "Adapters loaded into a tier (host: from disk; device: from "
                                                   "host RAM), by an operation or by vLLM within a step."),
        "loractl_adapter_load_bytes_total": ("counter", "Bytes moved into a tier by those loads (host: the weights "
                                                        "files read; device: what the engine holds of them)."),
        "loractl_adapter_load_wait_seconds": ("histogram", "Time from admission to first token of a request whose "
                                                           "adapter was not on the device (from: where it was, as "
                                                           "last read): its load and prefill."),
        "loractl_adapter_prefetch_total": ("counter", "Prefetches to host RAM of adapters waited for at the gate "
                                                      "(loaded), and per turn of a request that waited: its adapter "
                                                      "prefetched and still there (hit), on disk (miss), its prefetch "
                                                      "in flight (late); prefetched adapters evicted unused (wasted)."),
        "loractl_adapter_evictions_total": ("counter", "Adapters that left a tier, by reason."),
        "loractl_adapter_load_failures_total": ("counter", "Adapter loads that failed."),
        "loractl_adapter_requests_total": ("counter", "Generation requests per adapter (empty: the base model)."),
        "loractl_adapter_generated_tokens_total": ("counter", "Tokens generated per adapter (empty: the base model)."),
        "loractl_tier_bytes": ("gauge", "Bytes of adapters held per tier."),
        "loractl_exchange_price_steps": ("gauge", "What bringing an adapter into a device slot costs the engine, in "
                                                  "steps: copy and disk-load time per copy over a step's own time "
                                                  "(the auto admission policy's measure)."),
        "loractl_engine_step_seconds": ("gauge", "A step's own time (exchanges taken out), as last measured."),
        "loractl_tier_adapters": ("gauge", "Adapters held per tier."),
        "loractl_engine_requests": ("gauge", "Requests the engine holds (waiting or running)."),
        "loractl_engine_asleep": ("gauge", "1 while the engine sleeps after --keep-alive idle (its memory given "
                                           "back), 0 while it is awake."),
        "loractl_engine_sleeps_total": ("counter", "Times the engine fell asleep after --keep-alive idle."),
        "loractl_engine_wakes_total": ("counter", "Times a request woke the sleeping engine."),
        "loractl_engine_wake_failures_total": ("counter", "Wakes of the engine that failed (the engine stays asleep)."),
        "loractl_engine_sleep_seconds": ("histogram", "Time the engine took to fall asleep."),
        "loractl_engine_wake_seconds": ("histogram", "Time the engine took to wake for a request (the wait of the "
                                                     "request that woke it), pins restored."),
        "loractl_engine_last_wake_seconds": ("gauge", "How long the last wake of the engine took."),
        "loractl_admission_queue_depth": ("gauge", "Requests waiting at the admission gate for a device slot, "
                                                   "per adapter."),
        "loractl_admission_wait_seconds": ("histogram", "Time a request waited at the admission gate, per adapter."),
        "loractl_admission_oldest_wait_seconds": ("gauge", "How long each adapter's oldest request waiting at the "
                                                           "admission gate has waited (0: none waits)."),
        "loractl_admission_measured_seconds": ("gauge", "What the gate measured: a hand-over (a turn's first request, "
                                                        "grant to first token) and a request's service (grant to end)."),
    }

    def render(self) -> str:
        lines = []
        names = sorted(set(self.counters) | set(self.gauges) | {n for n, _ in self._hist} | set(self.HELP))
        for name in names:
            kind, help_text = self.HELP.get(name, ("untyped", name))
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
            for labels, value in sorted(self.counters.get(name, {}).items()):
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
            for labels, value in sorted(self.gauges.get(name, {}).items()):
                lines.append(f"{name}{_labels(labels)} {_number(value)}")
            for (hname, labels), (counts, total) in sorted(self._hist.items()):
                if hname != name:
                    continue
                running = 0
                for bound, count in zip((*self._buckets[name], float("inf")), counts):
                    running += count
                    le = "+Inf" if bound == float("inf") else f"{bound:g}"
                    lines.append(f"{name}_bucket{_labels(labels + (('le', le),))} {running}")
                lines.append(f"{name}_sum{_labels(labels)} {_number(total)}")
                lines.append(f"{name}_count{_labels(labels)} {running}")
        return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A sample's value, exact: ``:g`` kept six digits (3,370,976 bytes read 3.37098e+06)."""
    value = float(value)
    if value != value:
        return "NaN"
    if value in (float("inf"), float("-inf")):
        return "+Inf" if value > 0 else "-Inf"
    return str(int(value)) if value.is_integer() and abs(value) < 2 ** 53 else repr(value)


def _labels(labels: tuple) -> str:
    if not labels:
        return ""
    def escape(value) -> str:
        return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")

    return "{" + ",".join(f'{k}="{escape(v)}"' for k, v in labels) + "}"
