"""What the store's folders hold, scanned once and kept while nothing in them changed.

``ls``, ``status``, ``/v1/models`` and ``top`` list every entry; with 10,000 adapters placed by
hand, reading each entry again per ask cost seconds (issue 48). A :class:`Scan` records, besides
the adapter-looking entries it found, the stats of everything whose change could change the
listing; :meth:`Scan.holds` checks those stats again (one ``lstat`` each, no reads):

- the store's root and every real folder one or two levels down that is not an adapter (an org
  folder, a folder not yet an adapter): adding, removing or renaming anything in a folder moves
  its ctime, so a hand-placed adapter added, removed, or given its config, shows on the next ask;
- each hand-placed adapter's config and weights (inode, size, mtime, ctime), what
  ``Store.entry_key`` reads it by: content rewritten in place (which moves no folder's ctime), a
  file replaced or removed. A pulled adapter is a link swapped or removed by
  ``os.replace`` or ``unlink`` (its folder's ctime moves) to an object never rewritten.

Invariants: the stats are taken before the entries are read, so a change that races the read is
seen by the next check, never hidden by it. A scan is never trusted where a ctime it recorded is
within :data:`RACY_S` of its start (a change in the same clock tick, or within a coarse
filesystem's timestamp step, would leave the stat unchanged): such a listing is read again until
its files have settled, as git treats racily clean entries. A link that leads anywhere but the
store's objects (which are never rewritten) makes a scan untrusted too.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE

RACY_S = 2.0   # FAT's timestamps step by 2 s; Linux's coarse clock by a few ms
_OBJECTS = ".objects"


def _dir_stat(path: str) -> tuple | None:
    try:
        s = os.lstat(path)
    except OSError:
        return None
    return (s.st_ino, s.st_ctime_ns, s.st_mtime_ns)


def _file_stat(path: str) -> tuple | None:
    try:
        s = os.lstat(path)
    except OSError:
        return None
    return (s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


@dataclass
class Scan:
    """One walk of the store: ``found`` (name, path) of every adapter-looking entry, in name
    order, and what :meth:`holds` checks."""

    found: list[tuple[str, str]]
    folders: list[str]
    files: list[str]
    stats: tuple
    trusted: bool

    def holds(self) -> bool:
        """Whether nothing this scan watched has changed since (see the module)."""
        return self.trusted and self._stats(self.folders, self.files) == self.stats

    @staticmethod
    def _stats(folders: list[str], files: list[str]) -> tuple:
        return tuple(map(_dir_stat, folders)) + tuple(map(_file_stat, files))


def scan(root: str) -> Scan:
    """Walk ``root`` one and two levels down (scandir: one stat per entry, not one per path
    operation) for entries holding an adapter config."""
    began = time.time_ns()
    found: list[tuple[str, str]] = []
    folders, files = [root], []
    trusted = True

    def visit(name: str, entry: os.DirEntry, depth: int) -> None:
        nonlocal trusted
        path = entry.path
        if entry.is_symlink():
            if os.path.exists(os.path.join(path, CONFIG_FILE)):
                found.append((name, path))
                # A link to anything but an object may be rewritten without a folder here moving.
                trusted = trusted and _OBJECTS in os.readlink(path).split(os.sep)
            return
        if not entry.is_dir(follow_symlinks=False):
            return
        if os.path.exists(os.path.join(path, CONFIG_FILE)):
            # Its two files, not its folder: what Store.entry_key reads it by (a config removed or
            # replaced moves or loses the file's stats).
            found.append((name, path))
            files.extend((os.path.join(path, CONFIG_FILE), os.path.join(path, WEIGHTS_FILE)))
            return
        folders.append(path)
        if depth == 1:
            for sub in sorted(os.scandir(path), key=lambda e: e.name):
                if not sub.name.startswith("."):
                    visit(f"{name}/{sub.name}", sub, 2)

    for entry in sorted(os.scandir(root), key=lambda e: e.name):
        if not entry.name.startswith("."):
            visit(entry.name, entry, 1)
    stats = Scan._stats(folders, files)
    # ctime (never set by a user, unlike mtime) within RACY_S of the scan: a later change in the
    # same timestamp step would go unseen.
    newest = max((s[1] if len(s) == 3 else s[3] for s in stats if s is not None), default=0)
    trusted = trusted and None not in stats and newest < began - int(RACY_S * 1e9)
    return Scan(found, folders, files, stats, trusted)
