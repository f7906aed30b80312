"""What the engine's worker could not load inside a step, read from its journal.

vLLM's worker loads an adapter lazily, inside a scheduling step; when that load fails it keeps
serving with a zero stand-in (the base model under the adapter's name). loractl's worker
extension appends one JSON line per such failure to a journal file
(``worker_ext.BROKEN_JOURNAL``) before the step's outputs leave. ``BrokenJournal`` is the only
reader: it takes in the lines written since its last read (one ``stat`` when none were) and
owns ``broken``, engine id -> why. Invariant: read before an output of a step is handed on, a
failure of that step's load is known by then (``AdmittedEngineClient.generate``, ``Engine.add_adapter``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os

from loractl.errors import InvalidAdapter

_log = logging.getLogger(__name__)


def broken_adapter(label: str, reason: str) -> InvalidAdapter:
    """The error for an adapter the engine failed to load inside a step (and survived)."""
    return InvalidAdapter(f"the engine could not load adapter {label!r}: {reason}",
                          "The engine kept serving; the adapter is marked failed (loractl ls). Remove it, "
                          "or pull a revision that loads.")


class BrokenJournal:
    def __init__(self, path: str) -> None:
        self.path = path
        self.broken: dict[int, str] = {}   # engine id -> why the worker could not load it in a step
        self._read = 0                      # bytes of the journal read so far

    def reason(self, engine_id: int) -> str | None:
        """Why ``engine_id`` could not be loaded, after taking in what was journaled since."""
        self._take_in()
        return self.broken.get(engine_id)

    def _take_in(self) -> None:
        if not self.path:
            return
        try:
            if os.stat(self.path).st_size <= self._read:
                return
            with open(self.path) as f:
                f.seek(self._read)
                text = f.read()
        except OSError:
            return
        complete = text[:text.rfind("\n") + 1]   # a line still being written waits for the next read
        self._read += len(complete.encode())
        for line in complete.splitlines():
            try:
                record = json.loads(line)
                lora_id, reason = int(record["id"]), str(record["error"])
            except (ValueError, KeyError, TypeError):
                _log.warning("ignoring a malformed line of the worker's load journal: %r", line[:200])
                continue
            _log.error("the engine could not load adapter id %d: %s (it kept serving)", lora_id, reason)
            self.broken[lora_id] = reason

    def remove(self) -> None:
        if self.path:
            with contextlib.suppress(OSError):
                os.unlink(self.path)
