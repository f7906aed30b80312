"""What the store learned about its content, kept across restarts (``<store>/.known.json``).

At 10,000 hand-placed adapters every start hashed each adapter's files before the engine
started (1.5 s of the 3.8 s the store took to open) and the first listing validated every
adapter again (6 s), though nothing had changed since the last run. This file keeps, between
runs, what those passes found:

- a hand-placed adapter's computed manifest (its files' sha256, its config's fields), under the
  stat key of its two files (``copies.stat_key``: the folder's path, then inode, size, mtime
  and ctime of each): trusted while those stats are unchanged, as within one run, and while
  its seed metadata file's size and mtime are what they were;
- a content's validation facts, under its digest and whether the pull was forced, for one
  fingerprint of what validation checked against (``validation_fingerprint``: the rank limit,
  the base model's shapes, names and experts, the size cap, the validator's version): a
  changed base model, limit or validator validates everything again.

Only successes are kept: a refusal is validated again at its next use. The file is written
whole (``write_json_atomic``) and read once at start; a damaged or foreign file is ignored
(the content is hashed and validated again, as before this file existed). It holds only the
entries of the last listing, so it never outgrows the store.

Trust: the file lives in the store, with the store's permissions; whoever can write it can
write the adapters themselves.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
from collections.abc import Callable
from pathlib import Path

_log = logging.getLogger("loractld.store")

KNOWN_FILE = ".known.json"
FORMAT = 1


def validation_fingerprint(*parts: object) -> str:
    """A short digest of what validation checks against (each part printed with ``repr`` of
    sorted containers, so equal settings give equal fingerprints in every run)."""
    def canonical(part: object) -> object:
        if isinstance(part, dict):
            return sorted((str(k), canonical(v)) for k, v in part.items())
        if isinstance(part, (set, frozenset)):
            return sorted(map(str, part))
        if isinstance(part, (list, tuple)):
            return [canonical(p) for p in part]
        return part
    return hashlib.sha256(repr([canonical(p) for p in parts]).encode()).hexdigest()[:32]


def _meta_stat(folder: Path | str, metadata_file: str) -> list[int] | None:
    try:
        st = os.stat(os.path.join(folder, metadata_file))
    except OSError:
        return None
    return [st.st_size, st.st_mtime_ns]


class KnownContent:
    """The kept manifests and facts, read at start and written by :meth:`save`.

    Thread-safe: the store's listing (in a thread), the resolver (in threads) and the save (in a
    thread) share it; one lock guards the two tables."""

    def __init__(self, folder: Path, metadata_file: str, write: Callable[..., None]) -> None:
        """``write(path, data, compact=True)`` writes a file whole or not at all (the store's
        ``write_json_atomic``); a temporary a killed write left is removed here."""
        self.path = Path(folder) / KNOWN_FILE
        self.metadata_file = metadata_file
        self._write = write
        for leftover in self.path.parent.glob(f".{KNOWN_FILE}.*"):
            if len(leftover.name) == len(KNOWN_FILE) + 10:
                leftover.unlink(missing_ok=True)
        self._lock = threading.Lock()
        self._hand: dict[bytes, dict] = {}        # stat key -> {"manifest": ..., "meta": [size, mtime_ns] | None}
        self._fingerprint = ""
        self._facts: dict[str, list] = {}         # "digest:forced" -> [rank, alpha, target_modules, base_model]
        self._changed = False
        self._read()

    def _read(self) -> None:
        try:
            data = json.loads(self.path.read_bytes())
            if data.get("format") != FORMAT:
                return
            hand = {bytes.fromhex(k): v for k, v in data["hand"].items()}
            facts = dict(data["facts"])
            fingerprint = str(data["fingerprint"])
        except FileNotFoundError:
            return
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            _log.warning("ignoring %s (%s): the adapters are hashed and validated again", self.path, e)
            return
        self._hand, self._facts, self._fingerprint = hand, facts, fingerprint

    # -- hand-placed adapters' manifests ---------------------------------------------------
    def manifest(self, key: bytes, folder: Path | str) -> dict | None:
        """The manifest kept for the files whose stat key is ``key``, if its metadata file is
        unchanged too; else None (compute it)."""
        with self._lock:
            kept = self._hand.get(key)
        if kept is None or kept.get("meta") != _meta_stat(folder, self.metadata_file):
            return None
        return kept["manifest"]

    def keep_manifest(self, key: bytes, folder: Path | str, manifest: dict) -> None:
        entry = {"manifest": manifest, "meta": _meta_stat(folder, self.metadata_file)}
        with self._lock:
            if self._hand.get(key) != entry:
                self._hand[key] = entry
                self._changed = True

    # -- validation facts ------------------------------------------------------------------
    def facts(self, digest: str, forced: bool, fingerprint: str) -> list | None:
        """The facts kept for ``digest`` validated under ``fingerprint``; None if not kept."""
        with self._lock:
            if fingerprint != self._fingerprint:
                return None
            return self._facts.get(f"{digest}:{int(forced)}")

    def keep_facts(self, digest: str, forced: bool, fingerprint: str, facts: list) -> None:
        with self._lock:
            if fingerprint != self._fingerprint:   # validated against something else now: start over
                self._fingerprint, self._facts = fingerprint, {}
            key = f"{digest}:{int(forced)}"
            if self._facts.get(key) != facts:
                self._facts[key] = facts
                self._changed = True

    # -- writing ---------------------------------------------------------------------------
    def stale(self, listed: int) -> bool:
        """Whether :meth:`save` has anything to write, for a listing of ``listed`` adapters: new
        knowledge, or entries beyond the listing's (some of them are gone)."""
        with self._lock:
            return self._changed or len(self._hand) > listed

    def save(self, hand_keys: set[bytes], digests: set[str]) -> bool:
        """Write what is kept for ``hand_keys`` (the stat keys of the hand-placed adapters listed
        last) and ``digests`` (every listed content's), dropping the rest; a no-op when nothing
        changed since the last save. Returns whether it wrote."""
        with self._lock:
            if not self._changed and self._hand.keys() <= hand_keys:
                return False
            self._hand = {k: v for k, v in self._hand.items() if k in hand_keys}
            self._facts = {k: v for k, v in self._facts.items() if k.split(":", 1)[0] in digests}
            data = {"format": FORMAT, "fingerprint": self._fingerprint,
                    "hand": {k.hex(): v for k, v in self._hand.items()}, "facts": dict(self._facts)}
            self._changed = False
        try:
            self._write(self.path, data, compact=True)
        except OSError as e:   # a full disk: the next start hashes again, nothing is lost
            with self._lock:
                self._changed = True
            _log.warning("could not write %s: %s", self.path, e)
            return False
        return True
