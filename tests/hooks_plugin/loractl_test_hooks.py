"""The test suite's hook for loractld: kill points, pause points, worker faults and step timers.

loractld marks named points (loractld/worker/hooks.py, which lists them) and installs the one
module registered under the entry-point group ``loractld.hooks``. This is that module; its
registration (``loractl_test_hooks-0.dist-info`` beside it) is on the path only where the suite
puts it (tests/support_hooks.py: the test process and, through PYTHONPATH, every daemon and
engine process it starts), never in an installed loractl. Every ``LORACTL_TEST_*`` setting is
read here and nowhere in production code (tests/test_no_test_hooks.py). Each one does nothing
until a test arms it, and each is read when its point is reached, so an arming made after start
counts. They do not import loractld: this module is loaded while loractld's hooks are.

- Kill (``LORACTL_TEST_KILL_AT=FILE``): when a point is reached while FILE holds its name, the
  process removes FILE (so its restart is not armed) and SIGKILLs itself, exactly as ``kill -9``
  or the OOM killer would (no handler, no cleanup). tests/test_kill_points.py.
- Pause, in a daemon (``LORACTL_TEST_PAUSE_DIR=DIR``): a point pauses while the file
  ``DIR/<point>`` exists, after writing ``DIR/<point>.reached``; removing the arming file lets
  it go on. In the test's own process: ``with armed("pin-claimed") as point:`` then
  ``point.wait_reached()`` and ``point.release()``. tests/test_races*.py.
- Worker faults, each once (the arming file is removed when it fires), as a real failure inside
  an engine step would be: ``LORACTL_TEST_LOAD_FAULT=FILE`` fails the load of an adapter whose
  path holds FILE's text; ``LORACTL_TEST_POISON=FILE`` sets every lora_B weight of such an
  adapter to NaN (values that slipped past every check); ``LORACTL_TEST_ACTIVATE_FAULT=FILE``
  fails the copy into a device slot of the adapter whose engine id FILE holds (set_lora's size
  mismatch stands for it). Preflight runs the loader unhooked: these stand for what slips past it.
- Step timers (``LORACTL_TEST_STEP_TIMES=1``, read when the worker is installed): the start of
  each engine step and how long each preflight utility call held the engine loop, read back with
  :func:`step_times` in the engine's process, which the daemon's ``loractl_hook_report`` worker
  method returns (bench/preflight_stall.py).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

KILL_AT = "LORACTL_TEST_KILL_AT"
PAUSE_DIR = "LORACTL_TEST_PAUSE_DIR"
LOAD_FAULT = "LORACTL_TEST_LOAD_FAULT"
ACTIVATE_FAULT = "LORACTL_TEST_ACTIVATE_FAULT"
POISON = "LORACTL_TEST_POISON"
STEP_TIMES = "LORACTL_TEST_STEP_TIMES"
STEP_TIMES_LIMIT = 65536


# -- the hook loractld calls ----------------------------------------------------------------

def reached(point: str, *subjects: Any) -> None:
    _kill_if_armed(point)
    if point == "worker-loaded":
        lora_request, lora = subjects
        if _fires(LOAD_FAULT, lambda needle: needle in str(lora_request.lora_path)):
            raise RuntimeError(f"injected load fault ({LOAD_FAULT})")
        if _fires(POISON, lambda needle: needle in str(lora_request.lora_path)):
            _poison(lora)
    elif point == "worker-activated":
        (lora_id,) = subjects
        if _fires(ACTIVATE_FAULT, lambda text: text == str(lora_id)):
            raise RuntimeError(f"injected activation fault ({ACTIVATE_FAULT})")
    held = _holds(point)
    while held():
        time.sleep(0.01)


async def reached_async(point: str, *subjects: Any) -> None:
    _kill_if_armed(point)
    held = _holds(point)
    while held():
        await asyncio.sleep(0.01)


def wrap(point: str, fn: Callable) -> Callable:
    if os.environ.get(STEP_TIMES) != "1" or getattr(fn, "_loractl_timed", False):
        return fn
    if point == "worker-step":
        return _timed(fn, lambda began, ended: _steps.append(began))
    if point.startswith("worker-call:loractl_preflight"):
        name = point.partition(":")[2]
        return _timed(fn, lambda began, ended: _held_loop.append((name, began, ended - began)))
    return fn


# -- kill points ------------------------------------------------------------------------------

def _kill_if_armed(point: str) -> None:
    if _fires(KILL_AT, lambda text: text == point):
        os.kill(os.getpid(), signal.SIGKILL)


def _fires(variable: str, matches: Callable[[str], bool]) -> bool:
    """True once (the arming file is removed) when the file ``variable`` names holds a text that
    ``matches`` accepts; False whenever it is not armed."""
    armed = os.environ.get(variable)
    if not armed:
        return False
    try:
        with open(armed) as f:
            text = f.read().strip()
        if not text or not matches(text):
            return False
        os.unlink(armed)
    except FileNotFoundError:
        return False
    return True


def _poison(lora: Any) -> None:
    for layer in getattr(lora, "loras", {}).values():
        for b in layer.lora_b if isinstance(layer.lora_b, (list, tuple)) else [layer.lora_b]:
            if b is not None:
                b.fill_(float("nan"))


# -- pause points -----------------------------------------------------------------------------

class Point:
    """One point armed in this process: reached once, held until released."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.reached = threading.Event()
        self.released = threading.Event()

    def wait_reached(self, timeout: float = 30) -> None:
        if not self.reached.wait(timeout):
            raise TimeoutError(f"pause point {self.name!r} was not reached in {timeout} s")

    async def until_reached(self, timeout: float = 30) -> None:
        await asyncio.to_thread(self.wait_reached, timeout)

    def release(self) -> None:
        self.released.set()


_points: dict[str, Point] = {}


@contextlib.contextmanager
def armed(name: str):
    """Arm ``name`` in this process for the body; released (and disarmed) on the way out."""
    point = _points[name] = Point(name)
    try:
        yield point
    finally:
        point.release()
        del _points[name]


def _holds(name: str) -> Callable[[], bool]:
    """What keeps a caller at ``name`` waiting: the point armed in this process, if this caller is
    the first to reach it (one caller per arming), or the arming file, while it exists."""
    point = _points.get(name)
    if point is not None and not point.reached.is_set():
        point.reached.set()
    else:
        point = None
    folder = os.environ.get(PAUSE_DIR)
    arming = Path(folder) / name if folder else None
    if arming is not None and arming.exists():
        (arming.parent / f"{name}.reached").touch()
    else:
        arming = None
    return lambda: (point is not None and not point.released.is_set()) or (arming is not None and arming.exists())


# -- step timers ------------------------------------------------------------------------------

_steps: collections.deque = collections.deque(maxlen=STEP_TIMES_LIMIT)
_held_loop: collections.deque = collections.deque(maxlen=STEP_TIMES_LIMIT)


def _timed(fn: Callable, record: Callable[[float, float], None]) -> Callable:
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        began = time.monotonic()
        try:
            return fn(*args, **kwargs)
        finally:
            record(began, time.monotonic())

    wrapper._loractl_timed = True  # type: ignore[attr-defined]
    return wrapper


def report() -> dict[str, list]:
    """What loractld's ``hooks.report()`` hands on from this process: the step timers."""
    return step_times()


def step_times() -> dict[str, list]:
    """The monotonic start of each recent engine step, and for each preflight utility call the
    engine loop ran ``[method, start, seconds]`` (how long it held the loop, so the next step)."""
    return {"steps": list(_steps), "held": [list(r) for r in _held_loop]}
