"""Private copies of adapters used in place (an entry placed by hand, a folder given to --lora).

The engine loads such an adapter from ``.snapshots/<digest>``, a read-only copy whose bytes are
exactly the ones its digest names, whatever the user does to the folder afterwards.

Invariants:
- Knowing an adapter (its digest, for ls, status, /v1/models, start-up) copies nothing: the
  folder is hashed in place, once per content (cached by the files' inode, size, mtime, ctime).
  A copy is made when something leases it (``Store.lease``: a request, a tier operation), or
  ahead of that, off the event loop (:meth:`Copies.materialize`, from ``resolve_async``).
- A copy is made from its folder only if the bytes read there still hash to the digest asked
  for; otherwise the folder changed meanwhile and the ask fails (a retry resolves the new
  content). A copy is renamed into place whole, so no reader sees half of one.
- A leased copy is never removed. The budget bounds the copies' bytes, never correctness: over
  it with every copy in use, the copies stay over it (a warning, :attr:`Copies.overflows`) and
  are trimmed, least recently used first, as leases go. A copy made or used in the last
  ``grace_s`` seconds is kept too (something that resolved it is about to lease it: a tier
  operation's preflight); a lease alone is what correctness rests on.
- All state is under the store's lock; copies are removed at every start (they were never
  fsynced).
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from loractl.errors import AdapterNotFound, DiskFull
from loractld.store.listing import STAT, packed_stat
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE

SNAPSHOT_BUDGET = 2 << 30    # bytes of copies kept once no lease holds them (--snapshot-budget)
SNAPSHOT_GRACE_S = 10.0
_log = logging.getLogger("loractld.store")


def stat_key(folder: Path) -> bytes | None:
    """What identifies the adapter files in ``folder`` now (None: one is missing): the folder's
    path, then the config's and the weights' inode, size, mtime and ctime, packed. A rewrite that
    restores the mtime still moves the ctime."""
    try:
        stats = [os.stat(folder / n) for n in (CONFIG_FILE, WEIGHTS_FILE)]
    except OSError:
        return None
    return stat_key_of(folder, stats)


def stat_key_of(folder: Path, stats: list[os.stat_result]) -> bytes:
    """:func:`stat_key` from stats already taken (the config's, then the weights')."""
    return os.fsencode(folder) + b"\0" + b"".join(map(packed_stat, stats))


def stat_key_size(key: bytes) -> int:
    """The adapter files' bytes together, as ``key`` (a :func:`stat_key`) recorded them."""
    return sum(STAT.unpack_from(key, len(key) - (i + 1) * STAT.size)[1] for i in range(2))


def files_digest(records: list[dict]) -> str:
    """The content digest of an adapter: sha256 over its files' names and sha256s."""
    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r["name"]):
        h.update(f"{r['name']}\0{r['sha256']}\0".encode())
    return h.hexdigest()


def _read_hashing(source: Path, dest: Path | None) -> tuple[int, str]:
    """(size, sha256) of ``source``, copied to ``dest`` in the same read when given."""
    h, size = hashlib.sha256(), 0
    with open(source, "rb") as src, (open(dest, "wb") if dest is not None else contextlib.nullcontext()) as out:
        while chunk := src.read(1 << 20):
            h.update(chunk)
            if out is not None:
                out.write(chunk)
            size += len(chunk)
    return size, h.hexdigest()   # no fsync: copies are cleared at every start, never needed after a crash


class Copies:
    def __init__(self, folder: Path, lock, leases, staging: Callable, check_free_space: Callable,
                 budget: int = SNAPSHOT_BUDGET, grace_s: float = SNAPSHOT_GRACE_S) -> None:
        self.folder = folder
        self.budget = budget
        self.grace_s = grace_s
        self.overflows = 0               # trims that left the copies over budget: all in use
        self._lock = lock
        self._leases = leases
        self._staging = staging
        self._check_free_space = check_free_space
        self._records: dict[bytes, list[dict]] = {}   # stat_key -> file records (hashed in place)
        self._sources: dict[str, Path] = {}           # digest -> the folder it was last read from
        self._made: dict[str, list] = {}              # copy path -> [bytes, last used]; oldest first
        self._over = False

    # -- knowing an adapter: no copy ------------------------------------------------------
    def records(self, folder: Path, key: bytes | None = None) -> list[dict]:
        """The name, size and sha256 of ``folder``'s adapter files, hashed in place once per content."""
        key = key or stat_key(folder)
        known = self._records.get(key) if key is not None else None
        if known is None:
            known = [{"name": n, **dict(zip(("size", "sha256"), _read_hashing(folder / n, None)))}
                     for n in (CONFIG_FILE, WEIGHTS_FILE)]
            if key is not None and stat_key(folder) == key:   # unchanged while read: cache it
                self._records[key] = known
        return known

    def know(self, key: bytes, records: list[dict]) -> None:
        """``records`` are those of the files whose stat key is ``key`` (kept from the last run,
        ``store.known``): :meth:`records` answers them without reading the files."""
        self._records[key] = records

    def path_for(self, folder: Path, key: bytes | None = None) -> tuple[Path, str]:
        """Where the copy of ``folder``'s adapter is (or will be) and its digest; copies nothing."""
        digest = files_digest(self.records(folder, key))
        with self._lock:
            self._sources[digest] = folder
        return self.folder / digest, digest

    def known_source(self, folder: Path, digest: str) -> Path:
        """:meth:`path_for` for a folder whose digest is known already (its stats unchanged
        since it was hashed): where its copy is, ``folder`` recorded as its source."""
        with self._lock:
            self._sources[digest] = folder
        return self.folder / digest

    # -- using one: a copy ----------------------------------------------------------------
    def is_copy(self, path: Path) -> bool:
        return Path(path).parent == self.folder

    def materialize(self, path: Path) -> None:
        """Make the copy at ``path`` (``.snapshots/<digest>``) unless it is there; raises
        AdapterNotFound if its folder is gone or no longer holds that content."""
        path = Path(path)
        with self._lock:
            if (path / WEIGHTS_FILE).exists():
                self._used(path)
                return
            source = self._sources.get(path.name)
        if source is None:
            raise AdapterNotFound(f"the adapter at {path} was removed meanwhile", "Retry the request.")
        sources = [source / n for n in (CONFIG_FILE, WEIGHTS_FILE)]
        try:
            self._check_free_space(sum(f.stat().st_size for f in sources))
        except FileNotFoundError as e:
            raise AdapterNotFound(f"the adapter folder {source} was removed meanwhile", "Retry the request.") from e
        with self._staging() as staged:
            records = []
            for f in sources:
                try:
                    size, digest = _read_hashing(f, staged / f.name)
                except FileNotFoundError as e:
                    raise AdapterNotFound(f"the adapter folder {source} was removed meanwhile", "Retry the request.") from e
                except OSError as e:
                    if e.errno == errno.ENOSPC:
                        raise DiskFull(f"no space left for a private copy of {source}",
                                       "Free space in the adapter store.") from e
                    raise
                records.append({"name": f.name, "size": size, "sha256": digest})
            if files_digest(records) != path.name:
                raise AdapterNotFound(f"the adapter in {source} changed while it was being read", "Retry the request.")
            with self._lock:
                if not (path / WEIGHTS_FILE).exists():
                    for f in staged.iterdir():
                        os.chmod(f, 0o444)
                    os.rename(staged, path)
                    staged.mkdir()  # staging removes its folder on the way out
                self._made[str(path)] = [sum(r["size"] for r in records), time.monotonic()]
                self._used(path)
                self.trim()

    def _used(self, path: Path) -> None:
        """``path`` was just used: the last to go. Under the lock."""
        entry = self._made.pop(str(path), None)
        if entry is not None:
            entry[1] = time.monotonic()
            self._made[str(path)] = entry

    def released(self, path: str) -> None:
        """A copy's last lease went: it counts as used now, and the copies are trimmed."""
        with self._lock:
            if path in self._made:
                self._used(Path(path))
                self.trim()

    def trim(self) -> None:
        """Remove least recently used copies that no lease holds (nor ``grace_s`` protects) until
        their bytes fit the budget; over it with everything in use, say so once and stay over."""
        with self._lock:
            total = sum(size for size, _ in self._made.values())
            if total <= self.budget:
                self._over = False
                return
            held, now = self._leases.kept(), time.monotonic()
            for path, (size, used) in list(self._made.items()):
                if total <= self.budget:
                    break
                if path in held or now - used < self.grace_s:
                    continue
                shutil.rmtree(path, ignore_errors=True)   # read-only files go with their writable folder
                del self._made[path]
                total -= size
            if total > self.budget:
                self.overflows += 1
                if not self._over:
                    _log.warning("private copies of hand-placed adapters take %d bytes, over the %d-byte budget: "
                                 "all are in use; they are trimmed as requests end", total, self.budget)
                self._over = True
            else:
                self._over = False
