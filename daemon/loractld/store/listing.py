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

The scan is kept per folder (:class:`Part`): a folder whose stats and whose children's are
unchanged since a trusted read is not read again, so a pull into ``pulled/`` re-reads that folder
and the root, not an org folder of 10,000 hand-placed adapters beside it (issue 48: every pull
and rm, and the registry entry written after each, listed the whole store again).

Invariants: the stats are taken before the entries are read, so a change that races the read is
seen by the next check, never hidden by it. A scan is never trusted where a ctime it recorded is
within :data:`RACY_S` of its start (a change in the same clock tick, or within a coarse
filesystem's timestamp step, would leave the stat unchanged): such a listing is read again until
its files have settled, as git treats racily clean entries. A link that leads anywhere but the
store's objects (which are never rewritten) makes a scan untrusted too.
"""

from __future__ import annotations

import os
import struct
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


STAT = struct.Struct("<QQqq")


def packed_stat(s: os.stat_result) -> bytes:
    """A file's inode, size, mtime and ctime as 32 bytes: the same test of change as the tuple of
    them at about a fifth of its memory (a store of 10,000 keeps several such keys per adapter)."""
    return STAT.pack(s.st_ino, s.st_size, s.st_mtime_ns, s.st_ctime_ns)


def _ctime(stat_: tuple | bytes) -> int:
    """The ctime in a folder's :func:`_dir_stat` or a file's :func:`packed_stat`."""
    return STAT.unpack(stat_)[3] if isinstance(stat_, bytes) else stat_[1]


def _file_stat(path: str) -> bytes | None:
    try:
        return packed_stat(os.lstat(path))
    except OSError:
        return None


@dataclass
class Part:
    """One real folder's direct content, read with one ``scandir``: ``found`` (name, path) of the
    adapters in it, ``walk`` (name, path) of its child folders walked as parts of their own (the
    root's only), and the stats of everything in it whose change could change them: the folder,
    its other child folders (the config a folder may be given later), each hand-placed adapter's
    two files. ``trusted``: no stat racy, no link out of the objects (see the module)."""

    path: str
    depth: int
    found: list[tuple[str, str]]
    walk: list[tuple[str, str]]
    folders: list[str]
    files: list[str]
    stats: tuple
    trusted: bool

    def current(self) -> tuple:
        return tuple(map(_dir_stat, self.folders)) + tuple(map(_file_stat, self.files))


@dataclass
class Scan:
    """One walk of the store: ``found`` (name, path) of every adapter-looking entry, in name
    order, and its ``parts`` (folder path -> :class:`Part`, the root's first), which
    :meth:`holds` checks."""

    found: list[tuple[str, str]]
    parts: dict[str, Part]
    trusted: bool

    def holds(self) -> bool:
        """Whether nothing this scan watched has changed since (see the module)."""
        return self.trusted and all(part.current() == part.stats for part in self.parts.values())


def file_stats(scan_: Scan) -> dict[str, bytes | None]:
    """Each watched file's stat in ``scan_`` (a hand-placed adapter's config and weights), by path."""
    stats: dict[str, bytes | None] = {}
    for part in scan_.parts.values():
        stats.update(zip(part.files, part.stats[len(part.folders):]))
    return stats


def _read_part(path: str, prefix: str, depth: int, began: int) -> Part:
    found: list[tuple[str, str]] = []
    walk: list[tuple[str, str]] = []
    folders, files = [path], []
    trusted = True
    for entry in sorted(os.scandir(path), key=lambda e: e.name):
        if entry.name.startswith("."):
            continue
        name, child = prefix + entry.name, entry.path
        if entry.is_symlink():
            if os.path.exists(os.path.join(child, CONFIG_FILE)):
                found.append((name, child))
                # A link to anything but an object may be rewritten without a folder here moving.
                trusted = trusted and _OBJECTS in os.readlink(child).split(os.sep)
        elif not entry.is_dir(follow_symlinks=False):
            continue
        elif os.path.exists(os.path.join(child, CONFIG_FILE)):
            # Its two files, not its folder: what Store.entry_key reads it by (a config removed or
            # replaced moves or loses the file's stats).
            found.append((name, child))
            files.extend((os.path.join(child, CONFIG_FILE), os.path.join(child, WEIGHTS_FILE)))
        elif depth == 1:
            walk.append((name, child))      # an org folder: a part of its own
        else:
            folders.append(child)           # a folder not yet an adapter: watched for its config
    part = Part(path, depth, found, walk, folders, files, (), trusted)
    part.stats = part.current()
    # ctime (never set by a user, unlike mtime) within RACY_S of the scan: a later change in the
    # same timestamp step would go unseen.
    newest = max((_ctime(s) for s in part.stats if s is not None), default=0)
    part.trusted = trusted and None not in part.stats and newest < began - int(RACY_S * 1e9)
    return part


def scan(root: str, previous: Scan | None = None) -> Scan:
    """Walk ``root`` one and two levels down (scandir: one stat per entry, not one per path
    operation) for entries holding an adapter config. A folder whose part in ``previous`` was
    trusted and whose stats are unchanged is not read again: its part is reused (the same
    object, so the caller may reuse what it read from it), and a store write into one folder
    re-reads that folder, not 10,000 entries elsewhere."""
    began = time.time_ns()
    old = previous.parts if previous is not None else {}
    parts: dict[str, Part] = {}
    found: list[tuple[str, str]] = []

    def part_of(path: str, prefix: str, depth: int) -> Part:
        kept = old.get(path)
        if kept is not None and kept.trusted and kept.depth == depth and kept.current() == kept.stats:
            part = kept
        else:
            part = _read_part(path, prefix, depth, began)
        parts[path] = part
        return part

    top = part_of(root, "", 1)
    # Name order, as one sorted walk gave it: the root's adapters and its folders' among them.
    rows = [(name, path, False) for name, path in top.found] + [(name, path, True) for name, path in top.walk]
    for name, path, is_folder in sorted(rows):
        if is_folder:
            found.extend(part_of(path, name + "/", 2).found)
        else:
            found.append((name, path))
    return Scan(found, parts, all(part.trusted for part in parts.values()))
