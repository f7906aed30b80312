"""Test-only pause points: hold a racy interleaving open, instead of hoping for timing.

The race tests (tests/test_races.py) stop one operation at a named point, run another one
into the gap, then let the first go on. Points:

    resolved        a generation resolved its adapter (and took its lease), before it runs
    preflighted     a generation's adapter passed the engine's preflight, before it is admitted
    pin-claimed     a pin checked the caps and claimed its place, before it asks the engine
    store-installed a pull's object is renamed into .objects/; the name's link is not swapped

Arming, in process (unit tests): ``with armed("pin-claimed") as point:`` then ``point.wait_reached()``
and ``point.release()``. Arming a daemon: start it with ``LORACTL_TEST_PAUSE_DIR=DIR``; a point
pauses while the file ``DIR/<point>`` exists, after writing ``DIR/<point>.reached``; removing
the arming file lets it go on (the point is then disarmed).

Unarmed (always, outside those tests) a point costs one truth test of a module global.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from pathlib import Path

ENV = "LORACTL_TEST_PAUSE_DIR"
_DIR = Path(os.environ[ENV]) if os.environ.get(ENV) else None
_points: dict[str, Point] = {}
active = _DIR is not None


class Point:
    """One armed point: reached once, held until released."""

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


@contextlib.contextmanager
def armed(name: str):
    """Arm ``name`` in this process for the body; released (and disarmed) on the way out."""
    global active
    point = _points[name] = Point(name)
    active = True
    try:
        yield point
    finally:
        point.release()
        del _points[name]
        active = _DIR is not None or bool(_points)


def _take(name: str) -> Point | None:
    point = _points.get(name)
    if point is not None and not point.reached.is_set():
        point.reached.set()
        return point
    return None


def _file_armed(name: str) -> Path | None:
    if _DIR is None or not (_DIR / name).exists():
        return None
    (_DIR / f"{name}.reached").touch()
    return _DIR / name


async def pause(name: str) -> None:
    """Pause here (on the event loop) if ``name`` is armed."""
    if not active:
        return
    point, arming = _take(name), _file_armed(name)
    while (point is not None and not point.released.is_set()) or (arming is not None and arming.exists()):
        await asyncio.sleep(0.01)


def pause_in_thread(name: str) -> None:
    """Pause here (in a worker thread) if ``name`` is armed."""
    if not active:
        return
    point, arming = _take(name), _file_armed(name)
    while (point is not None and not point.released.is_set()) or (arming is not None and arming.exists()):
        time.sleep(0.01)
