"""The disk tier: named adapters on disk, installed atomically.

Layout under the store root (``<data dir>/adapters``)::

    .objects/<id>/          one installed adapter: adapter_config.json,
                            adapter_model.safetensors, loractl-manifest.json
    .tmp/<random>/          pulls in progress (removed on every daemon start)
    .snapshots/<digest>/    private read-only copies of adapters used in place (a folder given to
                            --lora, an entry placed by hand): what the engine loads, made when
                            leased, kept to a budget in bytes (loractld.store.copies); removed
                            on every daemon start
    sql-expert/v1 -> ../.objects/<id>     a pulled adapter: a relative symlink
    org/name/ (a real folder)             placed by hand (the seeds' <name>/<version>/ layout)

Invariants:
- A name becomes visible only by ``os.replace`` of its symlink, which is atomic: readers see
  the old adapter or the new one, never a mix, and a crash at any point leaves no half adapter
  visible. Whatever a crash leaves in ``.tmp`` or as an unreferenced object is removed by
  :meth:`Store.recover` at start-up.
- Every path the store hands out resolves inside the store root; hand-placed entries that are
  symlinks leading out of it are refused.
- The store owns its folders' lifetimes under one lock (``Store.lock``): GC deletes an object
  only if no name links to it, no lease holds it (``loractld.store.leases``: requests that
  resolved it) and no install has it in flight (renamed into .objects/, link not yet swapped).
  A folder unlinked by ``rm`` or a replacing pull while leased is *retired*, and deleted when
  its last lease goes.
- A damaged pulled adapter (an unreadable manifest) costs that adapter only: it is listed as
  damaged (:attr:`Store.damaged`), warned about once, and kept out of every listing and GC.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import shutil
import stat
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import AdapterNotFound, DiskFull, InvalidAdapter, InvalidRequest, LoractlError
from loractl.names import MAX_NAME_LEN, NAME_RE, validate_name
from loractld.worker import hooks
from loractl import __version__
from loractld.store.formats import MANIFEST_FORMAT, STORE_FORMAT, STORE_MARKER
from loractld.store.copies import SNAPSHOT_BUDGET, SNAPSHOT_GRACE_S, Copies, files_digest, stat_key_of
from loractld.store.known import KnownContent
from loractld.store.listing import packed_stat
from loractld.store import listing
from loractld.store.leases import Lease, Leases
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE, read_config

MANIFEST_FILE = "loractl-manifest.json"
SEED_METADATA_FILE = "metadata.json"
_OLD_COPIES = "old-snapshots-"   # last run's private copies, set aside in .tmp at start (Store.recover)
_log = logging.getLogger("loractld.store")


@dataclass(frozen=True)
class StoredAdapter:
    name: str
    path: Path          # the folder vLLM loads from (resolved, inside the store)
    manifest: dict
    hand_placed: bool

    @property
    def size_bytes(self) -> int:
        return sum(f["size"] for f in self.manifest.get("files", []))


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _is_name_folder(entry: Path) -> bool:
    """An org folder (``sql-expert`` of ``sql-expert/v1``): not a link, not an adapter itself."""
    return (not entry.name.startswith(".") and entry.is_dir() and not entry.is_symlink()
            and not (entry / CONFIG_FILE).exists())


def _same_files(entry: str, before: dict[str, bytes | None], now: dict[str, bytes | None]) -> bool:
    """Whether a hand-placed entry's config and weights have the same stats in two scans."""
    files = (os.path.join(entry, CONFIG_FILE), os.path.join(entry, WEIGHTS_FILE))
    return all(now.get(f) is not None and now.get(f) == before.get(f) for f in files)


def write_json_atomic(path: Path, data: dict, *, compact: bool = False) -> None:
    """Write ``path`` whole or not at all (a temporary beside it, fsync, rename, fsync the folder).
    A crash can leave the temporary behind: :func:`remove_partial_writes` at start-up.
    ``compact``: no indentation, by json's C encoder (``json.dump`` to a file encodes in Python:
    seconds for the megabytes of ``store.known``)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "w") as f:
            if compact:
                f.write(json.dumps(data, separators=(",", ":")))
            else:
                json.dump(data, f, indent=2, sort_keys=True)
            f.write("\n")
            f.flush()
            os.fsync(f.fileno())
        hooks.reached(f"write:{path.name}")
        os.replace(tmp, path)
    except BaseException:   # a full disk, above all: the old file stands, no temporary beside it
        tmp.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def remove_partial_writes(path: Path) -> list[Path]:
    """Delete the temporaries that :func:`write_json_atomic` calls killed mid-way left beside ``path``."""
    leftovers = [p for p in path.parent.glob(f".{path.name}.*") if len(p.name) == len(path.name) + 10]
    for p in leftovers:
        p.unlink(missing_ok=True)
    return leftovers


def _within(path: str, root: str) -> bool:
    """Whether the real path ``path`` is ``root`` or under it (both from os.path.realpath)."""
    return path == root or path.startswith(root.rstrip(os.sep) + os.sep)


def _real_folder(known: dict[str, str], folder: str) -> str:
    """``os.path.realpath(folder)``, looked up in ``known`` first (``realpath`` costs a system
    call per path component, and every entry of an org folder shares its folder's)."""
    real = known.get(folder)
    if real is None:
        real = known[folder] = os.path.realpath(folder)
    return real


class Store:
    def __init__(self, root: Path, snapshot_budget: int = SNAPSHOT_BUDGET,
                 snapshot_grace_s: float = SNAPSHOT_GRACE_S) -> None:
        self.root = Path(root)
        self._root_str = str(self.root)
        self.objects = self.root / ".objects"
        self.tmp = self.root / ".tmp"
        self.snapshots = self.root / ".snapshots"
        for folder in (self.root, self.objects, self.tmp, self.snapshots):
            folder.mkdir(parents=True, exist_ok=True)
        self._hand_manifests: dict[bytes | tuple, dict] = {}
        # Manifests of hand-placed adapters and validation facts, kept from the last run.
        self.known = KnownContent(self.root, SEED_METADATA_FILE, write_json_atomic)
        self._entries: dict[str, tuple[tuple | bytes, StoredAdapter]] = {}   # name -> (entry's key, what it read as)
        # The last listing, kept while it holds (``list``); every write of this store's bumps the
        # generation, so a write within one timestamp step of a listing is never missed.
        self._writes = itertools.count(1)   # next() is atomic: no increment lost to a race
        self._generation = 0
        self._listing: tuple[int, listing.Scan, list[StoredAdapter]] | None = None
        self.lock = threading.RLock()
        self.leases = Leases(self.lock)
        self.leases.on_idle = self._lease_idle
        # Private copies of adapters used in place (loractld.store.copies): made when leased.
        self.copies = Copies(self.snapshots, self.lock, self.leases, self.staging, self.check_free_space,
                             budget=snapshot_budget, grace_s=snapshot_grace_s)
        self._retired: set[str] = set()     # objects no name links to any more, kept for a lease
        self.damaged: dict[str, str] = {}   # name -> why its manifest cannot be read

    # -- start-up -----------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Remove what interrupted pulls left behind; return what was removed."""
        removed = []
        self._generation = next(self._writes)
        # Last run's private copies (thousands, with many adapters placed by hand) go aside in one
        # rename and are deleted in the background: start-up does not wait for them, and a crash
        # mid-way leaves them in .tmp for the next start to finish.
        if any(self.snapshots.iterdir()):
            os.rename(self.snapshots, self.tmp / f"{_OLD_COPIES}{uuid.uuid4().hex}")
            self.snapshots.mkdir()
        old_copies = []
        for leftover in self.tmp.iterdir():
            if leftover.name.startswith(_OLD_COPIES):
                old_copies.append(leftover)
                continue
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
            removed.append(str(leftover))
        if old_copies:
            threading.Thread(target=lambda: [shutil.rmtree(p, ignore_errors=True) for p in old_copies],
                             name="loractl-old-copies", daemon=True).start()
        removed += self.collect_garbage()
        for link in self._links():
            if not link.exists():  # dangling: its object is gone
                link.unlink()
                removed.append(str(link))
        # An install killed before its rename leaves its temporary link (".NAME.xxxxxxxx", at the
        # root or in an org folder) and possibly an org folder with nothing else in it, which would
        # make the bare name ORG read as a hand-placed adapter and refuse a later pull of it.
        for folder in [self.root] + [e for e in self.root.iterdir() if _is_name_folder(e)]:
            for entry in folder.iterdir():
                if entry.name.startswith(".") and entry.is_symlink():
                    entry.unlink()
                    removed.append(str(entry))
            if folder != self.root and not any(folder.iterdir()):
                folder.rmdir()
                removed.append(str(folder))
        self._generation = next(self._writes)   # a listing GC took above saw what was removed since
        return removed

    def stamp_format(self) -> None:
        """Write the store's format marker where it has none (loractld/store/formats.py): a store
        without one is of this release's layout, which ``formats.check_home`` has just allowed."""
        marker = self.root / STORE_MARKER
        if not marker.exists():
            write_json_atomic(marker, {"format": STORE_FORMAT, "written_by": f"loractl {__version__}"})

    # -- reading ------------------------------------------------------------------------
    def _link_targets(self) -> set[str]:
        """The real path of every object a name links to (pulled adapters, damaged ones too):
        what ``collect_garbage`` keeps. A walk of names (scandir: a folder's entry types come
        with it, no stat per entry) and a readlink per link, not a listing: every pull and rm
        collects garbage right after changing the store, when the kept listing is void, and
        listing 10,000 hand-placed adapters again made pull number 10,001 ten times the first.
        Objects are never links, so a link's target joined to its folder's real path is real."""
        targets = set()

        def links_in(folder: str, depth: int) -> None:
            real = None
            with os.scandir(folder) as entries:
                for entry in entries:
                    if entry.name.startswith("."):
                        continue
                    if entry.is_symlink():
                        real = real or os.path.realpath(folder)
                        targets.add(os.path.normpath(os.path.join(real, os.readlink(entry.path))))
                    elif depth == 1 and entry.is_dir(follow_symlinks=False):
                        links_in(entry.path, 2)
        links_in(self._root_str, 1)
        return targets

    def _links(self) -> list[Path]:
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):
                continue
            if entry.is_symlink():
                found.append(entry)
            elif entry.is_dir():
                found.extend(sub for sub in sorted(entry.iterdir()) if sub.is_symlink())
        return found

    def list(self) -> list[StoredAdapter]:
        """Every adapter in the store, in name order. Kept between asks while the store's own
        writes (``_generation``) and the folders' and hand-placed files' stats say nothing changed
        (``loractld.store.listing``): an unchanged store of 10,000 adapters lists with an lstat
        per folder and file, no reads."""
        kept = self._listing
        if kept is not None and kept[0] == self._generation and kept[1].holds():
            return list(kept[2])
        generation = self._generation
        # Stats before reads: a racing change shows next time. Folders unchanged since the kept
        # listing are not read again, nor are their adapters (the same parts, the same entries).
        walk = listing.scan(self._root_str, kept[1] if kept is not None else None)
        same = {}
        if kept is not None:
            reused = {name for path, part in walk.parts.items() if kept[1].parts.get(path) is part
                      for name, _ in part.found}
            # In a folder read again (an adapter added beside 10,000), an entry whose two files'
            # stats the new scan took equal the kept scan's is the kept entry (its key: those
            # stats, as Store.entry_key reads them): not read, nor stat'ed, again.
            before, now = listing.file_stats(kept[1]), listing.file_stats(walk)
            unchanged = {name for path, part in walk.parts.items() if kept[1].parts.get(path) is not part
                         for name, entry in part.found if _same_files(entry, before, now)}
            same = {a.name: a for a in kept[2] if a.name in reused or a.name in unchanged}
        adapters = []
        real_folders: dict[str, str] = {}   # this listing's: every entry of an org folder shares it
        for name, path in walk.found:
            if (adapter := same.get(name)) is not None:
                adapters.append(adapter)
                continue
            entry = Path(path)
            if not NAME_RE.match(name):
                _log.warning("ignoring %s: %r is not a valid adapter name", entry, name)
                continue
            try:
                adapters.append(self._load(name, entry, real_folders))
            except LoractlError as e:
                _log.warning("ignoring %s: %s", entry, e.message)
            except DamagedManifest as e:
                self._note_damaged(name, str(e))
                # Listed (ls shows it failed, with why), and its folder kept from GC: set aside.
                adapters.append(StoredAdapter(name, entry.resolve(), {"files": [], "damaged": str(e)}, False))
        # Refused or damaged entries are read (and warned about) again on every ask, as before.
        clean = len(adapters) == len(walk.found) and not any("damaged" in a.manifest for a in adapters)
        # Kept even if some folder is racy: its other folders are reused by the next ask.
        self._listing = (generation, walk, adapters) if clean else None
        return list(adapters)

    def save_known(self) -> bool:
        """Keep what the last listing's entries taught (``store.known``) for the next start: the
        manifests of its hand-placed adapters and the facts of its contents; nothing else. A no-op
        when nothing changed or nothing was listed yet."""
        kept = self._listing
        if kept is None or not self.known.stale(len(kept[2])):
            return False
        key_of = {id(manifest): key for key, manifest in self._hand_manifests.items()}
        hand_keys = {key_of[id(a.manifest)] for a in kept[2] if a.hand_placed and id(a.manifest) in key_of}
        digests = {files_digest(a.manifest["files"]) for a in kept[2] if a.manifest.get("files")}
        return self.known.save(hand_keys, digests)

    def _note_damaged(self, name: str, why: str) -> None:
        if self.damaged.get(name) != why:
            _log.warning("adapter %s is damaged and set aside (%s); loractl rm %s removes it", name, why, name)
        self.damaged[name] = why

    def has(self, name: str) -> bool:
        """Whether ``name`` is a valid name with an adapter in the store (not validated): False,
        never an OSError, for a name no adapter can have (too long for the file system)."""
        return len(name) <= MAX_NAME_LEN and bool(NAME_RE.match(name)) and (self.root / name / CONFIG_FILE).exists()

    def get(self, name: str) -> StoredAdapter:
        validate_name(name)
        entry = self.root / name
        if not (entry / CONFIG_FILE).exists():
            raise AdapterNotFound(f"no adapter named {name!r} in the store",
                                  f"Pull it first: loractl pull ORG/REPO --name {name} (loractl ls lists the store).")
        try:
            return self._load(name, entry)
        except DamagedManifest as e:
            self._note_damaged(name, str(e))
            raise InvalidAdapter(f"adapter {name!r} is damaged: {e}",
                                 f"Remove it (loractl rm {name}) and pull it again.") from e

    def _load(self, name: str, entry: Path, real_folders: dict[str, str] | None = None) -> StoredAdapter:
        """What ``entry`` holds, read again only when it changed (:meth:`entry_key`): ls, status
        and /v1/models read every entry, and each costs two or three system calls unchanged."""
        key = self.entry_key(name)
        known = self._entries.get(name)
        if key is not None and known is not None and known[0] == key:
            return known[1]
        adapter = self._read(name, entry, {} if real_folders is None else real_folders)
        if key is not None:
            self._entries[name] = (key, adapter)
        return adapter

    def listed_key(self, name: str) -> tuple | None:
        """The entry key ``name`` was last read under (by a listing, a get or an install), with no
        system call: what the last listing's check stands for; None if not read yet."""
        known = self._entries.get(name)
        return known[0] if known is not None else None

    def entry_key(self, name: str) -> tuple | bytes | None:
        """What identifies the entry ``name`` now: a pulled adapter's link target (objects are
        never rewritten), a hand-placed one's files' inode, size, mtime and ctime (a rewrite that
        restores the mtime still moves the ctime). None: read it every time (missing files, or
        files that are links)."""
        entry = os.path.join(self._root_str, name)
        try:
            if os.path.islink(entry):
                return ("link", os.readlink(entry))
            stats = (os.lstat(os.path.join(entry, CONFIG_FILE)), os.lstat(os.path.join(entry, WEIGHTS_FILE)))
        except (OSError, ValueError):
            return None
        if stat.S_ISLNK(stats[0].st_mode) or stat.S_ISLNK(stats[1].st_mode):
            return None
        return b"".join(map(packed_stat, stats))   # bytes: never equal to a link's tuple

    def _read(self, name: str, entry: Path, real_folders: dict[str, str]) -> StoredAdapter:
        """What ``entry`` holds. ``real_folders`` maps folders to their real paths for the
        listing in progress (a new listing sees a folder replaced by a link since the last)."""
        # Strings and os calls, not Path methods: a store of 10,000 hand-placed adapters reads
        # every entry at start-up, where pathlib's parsing cost more than the reads.
        root = _real_folder(real_folders, self._root_str)
        hand_placed = not os.path.islink(entry)
        real_str = os.path.realpath(entry) if not hand_placed else os.path.join(
            _real_folder(real_folders, os.path.dirname(entry)), os.path.basename(entry))
        real = Path(real_str)
        if not _within(real_str, root):
            raise InvalidAdapter(f"{entry} leads out of the store (to {real})",
                                 "Copy the adapter into the store instead of linking to it.")
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            path = os.path.join(real_str, f)
            if os.path.islink(path) and not _within(os.path.realpath(path), root):
                raise InvalidAdapter(f"{path} is a symlink out of the store", "Copy the file into the store.")
        if not hand_placed:
            try:
                manifest = json.loads((real / MANIFEST_FILE).read_text())
                if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), list):
                    raise ValueError("not a loractl manifest")
            except (OSError, ValueError) as e:
                raise DamagedManifest(f"{real / MANIFEST_FILE}: {e}") from e
            self.damaged.pop(name, None)
        else:
            manifest = self._hand_manifest(real)
        return StoredAdapter(name, real, manifest, hand_placed)

    def _hand_manifest(self, folder: Path) -> dict:
        """A manifest for a hand-placed adapter, computed (and cached by its files' stats), never
        written. Its files are hashed in place (``Copies.records``), which the resolver's digest
        then reuses: one read per content, no copy."""
        from loractld.store.sources import sha256_file

        present = []   # (file, its stat), the adapter's files that are regular files
        for name in (CONFIG_FILE, WEIGHTS_FILE):
            with contextlib.suppress(OSError):
                st = os.stat(os.path.join(folder, name))
                if stat.S_ISREG(st.st_mode):
                    present.append((folder / name, st))
        # copies.stat_key(folder), from the stats above (one stat per file, not three).
        key = (stat_key_of(folder, [st for _, st in present]) if len(present) == 2
               else (str(folder), tuple((f.name, st.st_size, st.st_mtime_ns) for f, st in present)))
        if key not in self._hand_manifests and isinstance(key, bytes) and \
                (kept := self.known.manifest(key, folder)) is not None:
            self._hand_manifests[key] = kept
            self.copies.know(key, kept["files"])   # the resolver's digest: no hashing either
        if key not in self._hand_manifests:
            config = read_config(folder)
            metadata = {}
            if os.path.isfile(os.path.join(folder, SEED_METADATA_FILE)):
                try:
                    metadata = json.loads((folder / SEED_METADATA_FILE).read_text())
                except ValueError:
                    metadata = {}
            records = self.copies.records(folder, key) if len(present) == 2 else [
                {"name": f.name, "size": st.st_size, "sha256": sha256_file(f)} for f, st in present]
            self._hand_manifests[key] = {
                "source": "local", "ref": str(folder), "revision": "sha256:" + files_digest(records),
                "files": records, "pulled_at": max(st.st_mtime for _, st in present),
                "base_model": config.get("base_model_name_or_path"), "rank": config.get("r"),
                "alpha": config.get("lora_alpha"), "target_modules": config.get("target_modules"),
                "metadata": metadata,
            }
            if isinstance(key, bytes):
                self.known.keep_manifest(key, folder, self._hand_manifests[key])
        return self._hand_manifests[key]

    # -- writing ------------------------------------------------------------------------
    @contextmanager
    def staging(self):
        """A fresh folder inside the store for one pull; removed unless installed."""
        folder = self.tmp / uuid.uuid4().hex
        folder.mkdir()
        try:
            yield folder
        finally:
            shutil.rmtree(folder, ignore_errors=True)

    def check_free_space(self, needed: int, reserve: int = 64 << 20) -> None:
        free = shutil.disk_usage(self.root).free
        if free < needed + reserve:
            raise DiskFull(f"not enough disk space for this adapter: it needs {needed} bytes, "
                           f"{free} are free in {self.root}")

    def install(self, name: str, staged: Path, manifest: dict) -> StoredAdapter:
        """Move a verified staging folder into the store under ``name``, atomically. From
        before its rename until its link is swapped, the new object is an install in flight,
        which no GC deletes; the revision it replaces is retired (deleted once unleased)."""
        validate_name(name)
        entry = self.root / name
        if entry.exists() and not entry.is_symlink():
            raise InvalidAdapter(f"{name!r} is an adapter placed by hand in {entry}",
                                 "Remove that folder, or pull under another --name.")
        records = [r for r in manifest["files"]]
        manifest = {**manifest, "format": MANIFEST_FORMAT, "revision_digest": files_digest(records)}
        obj = self.objects / f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
        with self.lock:
            self.leases.installing.add(str(obj))
        try:
            write_json_atomic(staged / MANIFEST_FILE, manifest)
            for f in staged.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            os.rename(staged, obj)
            _fsync_dir(self.objects)
            entry.parent.mkdir(parents=True, exist_ok=True)
            link_tmp = entry.parent / f".{entry.name}.{uuid.uuid4().hex[:8]}"
            link_tmp.symlink_to(os.path.relpath(obj, entry.parent))
            hooks.reached("store-installed")
            with self.lock:
                previous = entry.resolve() if entry.is_symlink() else None
                os.replace(link_tmp, entry)
                self._generation = next(self._writes)
                if previous is not None and previous != obj.resolve():
                    self._retired.add(str(previous))
            _fsync_dir(entry.parent)
        except OSError as e:
            if e.errno == 28:  # ENOSPC
                raise DiskFull(f"the disk filled up while installing {name!r}") from e
            raise
        finally:
            with self.lock:
                self.leases.installing.discard(str(obj))
        # The replaced revision's folder stays until collect_garbage: a running request may
        # still need vLLM to reload it from disk.
        return self._load(name, entry)

    def copy(self, src: str, dst: str, *, replace: bool = False) -> StoredAdapter:
        """``dst``: a new name for ``src``'s content (``loractl cp``), installed as a pull is: its
        own object, whose files are hard links to ``src``'s where the disk allows (objects are
        never written after their install), so removing either name leaves the other whole.
        ``replace``: a pulled adapter ``dst`` is replaced, as a new revision of it."""
        adapter = self.get(src)
        validate_name(dst)
        if not (replace and (self.root / dst).is_symlink()) and \
                ((self.root / dst).exists() or (self.root / dst).is_symlink()):
            raise InvalidRequest(f"{dst!r} exists in the store", f"Remove it first (loractl rm {dst}), "
                                 "or copy to another name.")
        with self.staging() as staged:
            for record in adapter.manifest.get("files", []):
                source, target = adapter.path / record["name"], staged / record["name"]
                try:
                    os.link(source, target)
                except OSError:
                    shutil.copy2(source, target)
            manifest = {k: v for k, v in adapter.manifest.items() if k not in ("revision_digest", "metadata")}
            return self.install(dst, staged, {**manifest, "copied_from": src})

    def lease(self, path: Path) -> Lease:
        """A lease on ``path`` (a folder just resolved), so that no GC deletes it while the
        request that resolved it runs. Raises AdapterNotFound if a GC deleted it meanwhile."""
        lease = self.leases.take(path)
        if self.copies.is_copy(path):
            try:   # made now if it is not there (or went since it was resolved): the lease keeps it
                self.copies.materialize(path)
            except BaseException:
                lease.release()
                raise
        if not path.is_dir():
            lease.release()
            raise AdapterNotFound(f"the adapter at {path} was removed meanwhile", "Retry the request.")
        return lease

    def collect_garbage(self, keep: set[str] = frozenset()) -> list[str]:
        """Delete installed objects no name links to, unless a lease, an install in flight or
        ``keep`` holds them; under the store's lock, so that none of those can change meanwhile."""
        with self.lock:
            referenced = self._link_targets() | set(keep)
            held = self.leases.kept()
            removed = []
            for obj in self.objects.iterdir():
                if {str(obj.resolve()), str(obj)} & (referenced | held):
                    continue
                shutil.rmtree(obj, ignore_errors=True)
                self._retired.discard(str(obj.resolve()))
                removed.append(str(obj))
            return removed

    def _lease_idle(self, path: str) -> None:
        """A folder's last lease went: delete it if it was retired meanwhile (rm, new revision);
        a private copy may go now, if the copies are over their budget."""
        self.copies.released(path)
        with self.lock:
            if path not in self._retired or path in self.leases.kept():
                return
            self._retired.discard(path)
            shutil.rmtree(path, ignore_errors=True)

    def remove(self, name: str, *, keep_object: bool = False) -> StoredAdapter:
        """Remove ``name``. A pulled adapter's folder is retired: deleted now unless a lease
        holds it (or ``keep_object``: left for ``collect_garbage``), else when its last lease goes.
        A hand-placed adapter a request holds is refused (its folder is the adapter)."""
        entry = self.root / name
        self._entries.pop(name, None)
        self._generation = next(self._writes)
        try:
            adapter = self.get(name)
        except InvalidAdapter:
            if name not in self.damaged:
                raise
            adapter = StoredAdapter(name, entry.resolve(), {"files": [], "damaged": self.damaged.pop(name)}, False)
        with self.lock:
            if adapter.hand_placed:
                if self.leases.held(adapter.path):
                    raise InvalidRequest(f"{name!r} is in use by a request", "Wait for it to finish, then remove it.")
                shutil.rmtree(entry)
            else:
                entry.unlink()
                hooks.reached("store-unlink")
                self._retired.add(str(adapter.path))
                if not keep_object and not self.leases.held(adapter.path):
                    self._retired.discard(str(adapter.path))
                    shutil.rmtree(adapter.path, ignore_errors=True)
            parent = entry.parent
            if parent != self.root and not any(parent.iterdir()):
                parent.rmdir()
            self._generation = next(self._writes)   # again: a listing taken meanwhile may have seen it half gone
        return adapter


class DamagedManifest(Exception):
    """A pulled adapter's manifest cannot be read (not JSON, not a manifest)."""
