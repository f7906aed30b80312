"""Work that runs to its end once begun, whoever awaited it.

A caller that goes away (a cancelled RPC, a client's deadline) cancels what it awaits. For a
change made in several steps (the engine's pin and its record; an install and its
announcement), stopping halfway leaves the parts disagreeing. ``Finishing`` runs such work as
a task of its own: the caller awaits it through ``asyncio.shield``, so the caller's cancel
reaches the caller only. Invariant: every task begun here is held until it ends (a task no one
references may be collected mid-way), and its failure is logged, never lost silently.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable

_log = logging.getLogger(__name__)


class Finishing:
    def __init__(self, what: str) -> None:
        self._what = what   # for the log: "a pin change", ...
        self._tasks: set[asyncio.Task] = set()

    def __call__(self, work: Awaitable):
        """Run ``work`` to its end; the awaitable returned gives its result to the caller."""
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._ended)
        return asyncio.shield(task)

    def __len__(self) -> int:
        """How many are still running (tests wait for none)."""
        return len(self._tasks)

    def _ended(self, task: asyncio.Task) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            _log.debug("%s ended with %r", self._what, task.exception())
