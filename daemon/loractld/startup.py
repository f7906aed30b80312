"""What the daemon is doing while it starts, for ``Status`` (and so for ``status --wait``,
``run`` and ``chat``): the stage, its progress, and an estimate of the time left when known.

Stages and their progress units: fetching the demo's model package (bytes), converting a GGUF
file (tensors), training a demo adapter (steps, with the loss as detail), starting the engine
(seconds, against the previous start's time kept in the state folder).

Invariants:
- ``update`` may be called from any thread (the model is prepared in worker threads);
  ``view`` returns a consistent snapshot: one reference to an immutable record is swapped.
- A stage's clock restarts when its key or message changes, never on a progress update, so the
  estimate (time per unit so far, times the units left) measures the stage alone.
- The last engine-start time is advice for an estimate: an unreadable or missing file means no
  estimate, never a failed start.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from loractld.store.disk import write_json_atomic
from loractld.views import StartupView

_log = logging.getLogger("loractld.startup")
ENGINE_STARTS_FILE = "engine-starts.json"

# The progress callback the model preparers take: update(stage, message, done=, total=, unit=, detail=).
Report = Callable[..., None]


@dataclass(frozen=True)
class _Stage:
    key: str
    message: str
    began: float
    done: float = 0.0
    total: float = 0.0
    unit: str = ""
    detail: str = ""
    expected_s: float = 0.0


class StartupProgress:
    """The current start-up stage; empty (no stage) before the first update and once ready."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._stage: _Stage | None = None

    def update(self, stage: str, message: str, *, done: float = 0.0, total: float = 0.0, unit: str = "",
               detail: str = "", expected_s: float = 0.0) -> None:
        """Enter ``stage`` (a new key or message starts its clock) or report progress in it."""
        current = self._stage
        began = current.began if current and (current.key, current.message) == (stage, message) else self._clock()
        if current is None or began != current.began:
            _log.debug("start-up stage: %s", message)
        self._stage = _Stage(stage, message, began, float(done), float(total), unit, detail, float(expected_s))

    def finish(self) -> None:
        self._stage = None

    def view(self) -> StartupView:
        stage = self._stage
        if stage is None:
            return StartupView()
        elapsed = self._clock() - stage.began
        done, total, eta = stage.done, stage.total, 0.0
        if stage.expected_s > 0:  # a stage timed by its previous run (the engine start)
            done, total, eta = elapsed, stage.expected_s, max(stage.expected_s - elapsed, 0.0)
        elif total > 0 and done > 0 and elapsed > 1.0:  # by its rate so far
            eta = elapsed * (total - done) / done
        return StartupView(stage=stage.key, message=stage.message, done=done, total=total, unit=stage.unit,
                           detail=stage.detail, elapsed_s=elapsed, eta_s=eta)


def last_engine_start(state_dir: Path, model: str) -> float:
    """Seconds the engine took to start on ``model`` the last time (0 when unknown)."""
    try:
        seconds = json.loads((state_dir / ENGINE_STARTS_FILE).read_text()).get(model, 0.0)
        return float(seconds) if isinstance(seconds, (int, float)) and seconds > 0 else 0.0
    except (OSError, ValueError, AttributeError):
        return 0.0


def record_engine_start(state_dir: Path, model: str, seconds: float) -> None:
    """Keep this start's time for the next start's estimate (atomically; failures only logged)."""
    path = state_dir / ENGINE_STARTS_FILE
    try:
        try:
            starts = json.loads(path.read_text())
            starts = starts if isinstance(starts, dict) else {}
        except (OSError, ValueError):
            starts = {}
        starts[model] = round(seconds, 2)
        state_dir.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, starts)
    except OSError as e:
        _log.warning("could not keep the engine's start time in %s: %s", path, e)
