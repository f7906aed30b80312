"""What a create in flight has pulled, on disk, so that a create the daemon never finished (a
``kill -9``, a power cut) is undone at the next start as a failed one is undone at once.

A create pulls adapters under new names (a Modelfile's ``ADAPTER`` folders and Hub refs, the
blobs of Ollama's ``/api/create``). Layout: ``<store>/.creates/<id>.json``, one per create in
flight: ``{"started": <unix time>, "names": [...]}``.

Invariants:
- A name is recorded (the file written whole: ``write_json_atomic``) before its pull starts, so
  no install of a create can be on disk without its record.
- The record goes when its create ends, made or undone (:meth:`CreateJournal.close`).
- At start-up (:func:`undo_unfinished`), a record left by a create that never ended has each
  name it lists removed when the store still holds it as pulled during that create (pulled at
  or after ``started``), and no profile uses it (a create killed between writing its profile
  and closing its record is a made one). Then the record goes.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from pathlib import Path

from loractld.store.disk import Store, write_json_atomic
from loractld.store.profiles import Profiles

CREATES_DIR = ".creates"
_log = logging.getLogger("loractld.store")


class CreateJournal:
    """The record of one create's new names (see the module's invariants)."""

    def __init__(self, store_root: Path) -> None:
        self.path = Path(store_root) / CREATES_DIR / f"{uuid.uuid4().hex}.json"
        self.started = time.time()
        self.names: list[str] = []

    def record(self, name: str) -> None:
        """Record ``name`` before its pull starts."""
        if name in self.names:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(self.path, {"started": self.started, "names": [*self.names, name]})
        self.names.append(name)

    def close(self) -> None:
        self.path.unlink(missing_ok=True)


def undo_unfinished(store: Store, profiles: Profiles) -> list[str]:
    """Remove what creates that never ended pulled (see the module's invariants); return the names."""
    folder = store.root / CREATES_DIR
    removed: list[str] = []
    for record in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            doc = json.loads(record.read_text())
            started, names = float(doc["started"]), [str(n) for n in doc["names"]]
        except (OSError, ValueError, KeyError, TypeError) as e:
            _log.warning("ignoring an unreadable create record %s: %s", record, e)
            record.unlink(missing_ok=True)
            continue
        for name in reversed(names):
            try:
                if not store.has(name) or profiles.users_of(name):
                    continue
                pulled_at = float(store.get(name).manifest.get("pulled_at") or 0)
            except Exception as e:  # noqa: BLE001 - a damaged entry is left for rm, as any other
                _log.warning("left %s of an unfinished create: %s", name, e)
                continue
            if pulled_at >= started:
                store.remove(name)
                removed.append(name)
        record.unlink(missing_ok=True)
    for leftover in folder.glob(".*") if folder.is_dir() else []:   # a record's write a kill stopped
        leftover.unlink(missing_ok=True)
    return removed
