"""Keep-alive: the engine gives its memory back after ``--keep-alive`` idle, and the next request
that needs it wakes it (Ollama's ``keep_alive``, on vLLM's sleep mode).

How the engine sleeps depends on the device (``Engine.sleep``): on CUDA with sleep mode, vLLM's
own (level 1: weights to host RAM, KV cache dropped; level 2: both dropped, the weights reloaded
from the model's files at wake); on the CPU, which has no sleep mode, a full stop of the engine
(its engine-core process exits) and a fresh start with the same settings at wake. The daemon
itself, its store, its registry entry and every door stay up: whatever needs no engine (``ls``,
``show``, ``status``, ``pull``, metrics) answers as usual, from the tier state last read.

Invariants:
- One owner: :class:`KeepAlive` alone decides and changes the engine's sleep state (``state``),
  under one lock (``_lock``) that a sleep and a wake each hold from their start to their end.
- The idle clock counts from the last use's end: the engine falls asleep only after ``idle_s``
  with no holder (:meth:`hold`: every engine request, a prepare, a tier operation), no admitted
  or queued request at the gate, nothing unfinished in the engine and nothing else busy
  (``busy``: a preflight, a tier state read). The check and the change of state are made under
  the lock with no await between them, so a request that arrives after it sees the state
  already changed.
- A request that arrives while the engine falls asleep waits for the sleep to end, then wakes
  it (:meth:`awake` queues on the lock); one that arrives while it wakes waits for that wake.
  None fails for it, and none is served by a half-stopped engine: nothing reads or asks the
  engine while it sleeps (``Engine.asleep``; the tier reader returns its last state).
- At wake, what vLLM lost is put back before any request is let in: on the CPU (a new engine)
  and after a level-2 sleep, the pinned adapters are loaded and pinned again where they were,
  host or device (the admission gate kept the device pins' places meanwhile); the KV cache and
  the prefix cache start empty in every case, so no stale state is ever reused.
- A wake that fails leaves the engine asleep and fails the request that asked with
  ``EngineUnavailable``; the next request tries again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
import time
from typing import TYPE_CHECKING, Callable

from loractl.errors import EngineUnavailable, InvalidRequest, LoractlError
from loractld.events import Event

if TYPE_CHECKING:
    from loractld.events import EventBus, Metrics
    from loractld.serving.tiers import Tiers

_log = logging.getLogger("loractld.keep_alive")

DEFAULT_CUDA_S = 300.0      # 5 minutes, as Ollama's keep_alive
SLEEP_LEVELS = (1, 2)

AWAKE, FALLING_ASLEEP, ASLEEP, WAKING = "awake", "falling asleep", "asleep", "waking"

_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "ms": 0.001}
_DURATION = re.compile(r"(\d+(?:\.\d*)?|\.\d+)(ms|s|m|h|d)?")


def parse_duration(text: str) -> float:
    """``--keep-alive``'s value in seconds: ``5m``, ``300s``, ``300``, ``1h``, ``1h30m``; ``0``,
    ``forever``, ``off`` or ``never`` give 0: keep-alive off, the engine never sleeps."""
    value = text.strip().lower()
    if value in ("forever", "off", "never", "none", "inf", "-1"):
        return 0.0
    if not value or not re.fullmatch(rf"(?:{_DURATION.pattern})+", value):
        raise InvalidRequest(f"--keep-alive {text!r} is not a duration",
                             "Write it as 300, 300s, 5m, 1h or 1h30m; 0 or forever keep the engine up for good.")
    return sum(float(n) * _UNITS[unit or ""] for n, unit in _DURATION.findall(value))


def duration_arg(text: str) -> float:
    """:func:`parse_duration` for argparse (``loractld --keep-alive``, the config's ``keep-alive``)."""
    try:
        return parse_duration(text)
    except InvalidRequest as e:
        import argparse

        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (try 5m, 300s, 1h; 0 or forever: off)") from e


def resolve_idle(keep_alive_s: float | None, device: str) -> float | None:
    """The idle time after which the engine sleeps on ``device``, None for never: the flag's
    value where given (0: never), else 5 minutes on CUDA and never on the CPU, where a sleep is
    a full engine stop and its wake a start of several seconds."""
    if keep_alive_s is None:
        return DEFAULT_CUDA_S if device == "cuda" else None
    return keep_alive_s or None


def describe(seconds: float | None) -> str:
    if seconds is None:
        return "off"
    if seconds >= 60 and seconds % 60 == 0:
        return f"{seconds / 60:g} min"
    return f"{seconds:g} s"


class KeepAlive:
    """The engine's sleep state and its idle clock; see the module's invariants.

    ``engine`` has ``asleep``, ``restarted_by_sleep`` and ``async sleep(level)`` / ``wake()``
    (``loractld.engine.client.Engine``); ``busy()`` says what, besides the holders and the gate,
    keeps the engine from sleeping now ("" for nothing); ``notify(*lines)`` tells systemd."""

    def __init__(self, engine, tiers: Tiers, events: EventBus, metrics: Metrics, *, idle_s: float,
                 level: int = 1, busy: Callable[[], str] = lambda: "",
                 notify: Callable[..., None] = lambda *lines: None,
                 awake_status: Callable[[], str] = lambda: "STATUS=ready",
                 clock: Callable[[], float] = time.monotonic) -> None:
        if level not in SLEEP_LEVELS:
            raise InvalidRequest(f"--sleep-level {level} is not one of 1, 2")
        self.engine = engine
        self.tiers = tiers
        self.events = events
        self.metrics = metrics
        self.idle_s = idle_s
        self.level = level
        self.busy = busy
        self.notify = notify
        self.awake_status = awake_status
        self.clock = clock
        self.state = AWAKE
        self._lock = asyncio.Lock()
        self._holders = 0
        self._last_use = clock()
        self._poke = asyncio.Event()
        self._watcher: asyncio.Task | None = None
        self._waking: asyncio.Future | None = None
        self.sleeps = 0
        self.slept_at: float | None = None     # time.time() of the last sleep
        self.woke_at: float | None = None
        self.last_sleep_s = 0.0                # how long the last fall asleep took
        self.last_wake_s = 0.0                 # how long the last wake took
        self.wake_error: str = ""
        metrics.set("loractl_engine_asleep", (), 0)

    # -- the callers' side -------------------------------------------------------------------
    @property
    def asleep(self) -> bool:
        """True from the moment the engine starts falling asleep until it is awake again."""
        return self.state != AWAKE

    @property
    def holders(self) -> int:
        return self._holders

    def touch(self) -> None:
        """A use of the engine ended (or began): the idle clock starts again from now."""
        self._last_use = self.clock()
        self._poke.set()

    async def awake(self) -> None:
        """Return once the engine is awake, waking it if it sleeps or is falling asleep (then
        after that sleep has ended). Raises ``EngineUnavailable`` if the wake fails."""
        self.touch()
        while self.state != AWAKE:
            # Shared and shielded: a caller that goes away (Ctrl-C) does not cut a wake short,
            # which would leave a half-started engine behind and start a second one next time.
            await asyncio.shield(self._wake_soon())
        self.touch()

    def _wake_soon(self) -> asyncio.Future:
        """The wake in progress, or a new one (no await between the check and its start)."""
        if self._waking is None:
            waking = asyncio.ensure_future(self._wake_when_asleep())
            self._waking = waking

            def done(future: asyncio.Future) -> None:
                self._waking = None
                if not future.cancelled():
                    future.exception()   # retrieved: every waiter may have gone
            waking.add_done_callback(done)
        return self._waking

    async def _wake_when_asleep(self) -> None:
        async with self._lock:   # after a sleep in progress ends
            if self.state == ASLEEP:
                await self._wake()

    @contextlib.asynccontextmanager
    async def hold(self):
        """The body uses the engine: it is awake when the body starts, and does not fall asleep
        before the body ends; the idle clock restarts at its end."""
        self._holders += 1   # before any await: a sleep that decides from now on sees it
        try:
            await self.awake()
            yield
        finally:
            self._holders -= 1
            self.touch()

    # -- the idle clock ------------------------------------------------------------------------
    def start(self) -> None:
        self.touch()
        self._watcher = asyncio.create_task(self._watch())

    def stop(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()

    def _idle_for(self) -> float:
        return self.clock() - self._last_use

    def _why_not_now(self) -> str:
        """What keeps the engine from sleeping now ("" for nothing). No await in here."""
        if self.state != AWAKE:
            return self.state
        if self._holders:
            return f"{self._holders} holder(s)"
        gate = self.tiers.gate
        if gate.tickets:
            return f"{len(gate.tickets)} request(s) at the gate"
        unfinished = self.engine.unfinished_requests()
        if unfinished:
            return f"{unfinished} request(s) in the engine"
        if self.tiers.lock.locked():
            return "a tier operation"
        return self.busy()

    async def _watch(self) -> None:
        while True:
            self._poke.clear()
            if self.state != AWAKE:
                await self._poke.wait()
                continue
            left = self.idle_s - self._idle_for()
            if left > 0:
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(self._poke.wait(), timeout=left)
                continue
            if self._why_not_now():
                # Busy without a holder (a preflight, a tier read): look again shortly.
                await asyncio.sleep(min(1.0, max(0.05, self.idle_s / 4)))
                continue
            try:
                await self._maybe_sleep()
            except asyncio.CancelledError:
                raise
            except Exception:  # noqa: BLE001 - the engine stays as it is; the watchdog judges a dead one
                _log.exception("the engine failed to fall asleep; it stays up")
                self.touch()

    async def _maybe_sleep(self) -> None:
        async with self._lock:
            # Decided and recorded with no await in between (see the invariants).
            if self._idle_for() < self.idle_s or self._why_not_now():
                return
            self.state = FALLING_ASLEEP
            await self._sleep()

    async def _sleep(self) -> None:
        began = self.clock()
        idle = self._idle_for()
        self.notify("STATUS=falling asleep: idle for " + describe(round(idle)))
        _log.info("idle for %.1f s (--keep-alive %s): the engine falls asleep", idle, describe(self.idle_s))
        self.events.publish(Event("ENGINE_FALLING_ASLEEP", "", reason="keep-alive",
                                  message=f"idle for {idle:.1f} s: the engine falls asleep"))
        try:
            self.tiers.stop_following()
            await self.tiers.reader.settled()   # no read of the engine in flight while it stops
            how = await self.engine.sleep(self.level)
        except BaseException:
            self.state = AWAKE
            self.tiers.start_following()
            raise
        self.state = ASLEEP
        self.sleeps += 1
        self.slept_at = time.time()
        self.last_sleep_s = self.clock() - began
        self.metrics.set("loractl_engine_asleep", (), 1)
        self.metrics.inc("loractl_engine_sleeps_total", ())
        self.metrics.observe("loractl_engine_sleep_seconds", (), self.last_sleep_s, buckets=SECONDS_BUCKETS)
        message = f"the engine is asleep ({how}) after {idle:.1f} s idle; the next request wakes it"
        self.events.publish(Event("ENGINE_ASLEEP", "", reason="keep-alive", message=message))
        self.notify(f"STATUS=asleep ({how}): the next request wakes the engine")
        _log.info("%s (%.2f s to fall asleep)", message, self.last_sleep_s)

    async def _wake(self) -> None:
        """Wake the engine; the caller holds the lock and saw it asleep."""
        self.state = WAKING
        began = self.clock()
        self.notify("STATUS=waking the engine for a request")
        _log.info("a request wakes the engine")
        self.events.publish(Event("ENGINE_WAKING", "", reason="request", message="a request wakes the engine"))
        try:
            how = await self.engine.wake()
            if self.engine.restarted_by_sleep:
                await self._restore_pins()
        except BaseException as e:
            self.state = ASLEEP
            self.wake_error = str(getattr(e, "message", "") or e)
            self.metrics.inc("loractl_engine_wake_failures_total", ())
            self.notify(f"STATUS=asleep: the last wake failed: {self.wake_error}")
            _log.error("the engine failed to wake: %s", self.wake_error)
            if isinstance(e, (LoractlError, asyncio.CancelledError)):
                raise
            raise EngineUnavailable(f"the engine failed to wake: {e}",
                                    "Retry; the daemon's log says why; if it persists, restart the daemon.") from e
        self.wake_error = ""
        self.state = AWAKE
        self.tiers.start_following()
        self.last_wake_s = self.clock() - began
        self.woke_at = time.time()
        self.metrics.set("loractl_engine_asleep", (), 0)
        self.metrics.inc("loractl_engine_wakes_total", ())
        self.metrics.set("loractl_engine_last_wake_seconds", (), self.last_wake_s)
        self.metrics.observe("loractl_engine_wake_seconds", (), self.last_wake_s, buckets=SECONDS_BUCKETS)
        message = f"the engine is awake ({how}) in {self.last_wake_s:.2f} s"
        self.events.publish(Event("ENGINE_AWAKE", "", reason="request", message=message))
        self.notify(self.awake_status())
        _log.info("%s", message)
        self.touch()

    async def _restore_pins(self) -> None:
        """The engine came back without its adapters (a new engine, or a level-2 sleep): put
        every applied pin back in the engine where it was, device pins first (their gate places
        were kept), then the host pins; the reader's next read starts afresh from the worker's
        new journal. Under the tiers' lock: no tier operation runs meanwhile."""
        tiers = self.tiers
        reader = tiers.reader
        async with tiers.lock:
            before = reader.last_state
            for tier, ids in (("host", before.host), ("device", before.device)):
                for engine_id in ids:
                    reader.expect(engine_id, tier, "sleep")
            reader.restart_journal()
            held = tiers.held_pins()
            for kind in ("device", "host"):
                for name, (pin, engine_id) in held.items():
                    if pin != kind:
                        continue
                    try:
                        adapter = tiers.resolver.resolve(name)
                    except LoractlError as e:
                        _log.warning("wake: the %s pin of %s is not restored: %s", kind, name, e.message)
                        continue
                    if adapter.engine_id != engine_id:
                        _log.warning("wake: the %s pin of %s held an older revision; it is not restored", kind, name)
                        continue
                    reader.expect(engine_id, "host", "wake")
                    reader.expect(engine_id, "device", "wake")
                    await tiers.engine.add_adapter(adapter)
                    if not await tiers.engine.pin_adapter(engine_id, device=kind == "device"):
                        _log.warning("wake: pinning %s to %s again failed", name, kind)
            await tiers.sync()
            reader.clear_expected()

    # -- reports -------------------------------------------------------------------------------
    def view(self) -> dict:
        return {"state": self.state, "idle_s": self.idle_s, "level": self.level, "sleeps": self.sleeps,
                "slept_at": self.slept_at, "woke_at": self.woke_at, "last_wake_s": self.last_wake_s,
                "last_sleep_s": self.last_sleep_s}


SECONDS_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
