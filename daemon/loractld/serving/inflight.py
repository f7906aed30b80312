"""Work in flight (generations, pulls, merges): counted, drained on shutdown, and told why it
was stopped.

Invariants:
- While draining, a caller checks :attr:`InFlight.draining` and refuses new work; work still
  running when the grace period ends is cancelled and ends with ``Cancelled`` (its message
  says what was stopped), never left hanging.
- A cancellation that is not the drain's (a client going away) stays a plain cancellation.
- Single-threaded: every method runs on the daemon's event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Iterator

from loractl.errors import Cancelled


class InFlight:
    def __init__(self) -> None:
        self.draining = False
        self._tasks: set[asyncio.Task] = set()

    def __len__(self) -> int:
        return len(self._tasks)

    @contextlib.contextmanager
    def tracked(self, cancel_message: str) -> Iterator[None]:
        """Run the body as in-flight work of the current task: drained on shutdown, and a
        cancellation by the drain surfaces as ``Cancelled(cancel_message)``."""
        task = asyncio.current_task()
        assert task is not None
        self._tasks.add(task)
        try:
            yield
        except asyncio.CancelledError:
            if not self.draining:
                raise
            raise Cancelled(cancel_message, "Start the daemon again and rerun the command.") from None
        finally:
            self._tasks.discard(task)

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new work from now on, wait up to ``grace_seconds``, cancel the rest; return how
        many were cancelled."""
        self.draining = True
        if self._tasks:
            await asyncio.wait(set(self._tasks), timeout=grace_seconds)
        leftover = [t for t in self._tasks if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.wait(leftover, timeout=5)
        return len(leftover)
