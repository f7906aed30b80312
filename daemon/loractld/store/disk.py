"""The disk tier: named adapters on disk, installed atomically.

Layout under the store root (``<data dir>/adapters``)::

    .objects/<id>/          one installed adapter: adapter_config.json,
                            adapter_model.safetensors, loractl-manifest.json
    .tmp/<random>/          pulls in progress (removed on every daemon start)
    sql-expert/v1 -> ../.objects/<id>     a pulled adapter: a relative symlink
    org/name/ (a real folder)             placed by hand (the seeds' <name>/<version>/ layout)

Invariants:
- A name becomes visible only by ``os.replace`` of its symlink, which is atomic: readers see
  the old adapter or the new one, never a mix, and a crash at any point leaves no half adapter
  visible. Whatever a crash leaves in ``.tmp`` or as an unreferenced object is removed by
  :meth:`Store.recover` at start-up.
- Every path the store hands out resolves inside the store root; hand-placed entries that are
  symlinks leading out of it are refused.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import AdapterNotFound, DiskFull, InvalidAdapter, LoractlError
from loractl.names import NAME_RE, validate_name
from loractld import killpoints
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE, read_config

MANIFEST_FILE = "loractl-manifest.json"
SEED_METADATA_FILE = "metadata.json"
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


def write_json_atomic(path: Path, data: dict) -> None:
    """Write ``path`` whole or not at all (a temporary beside it, fsync, rename, fsync the folder).
    A crash can leave the temporary behind: :func:`remove_partial_writes` at start-up."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}")
    with open(tmp, "w") as f:
        json.dump(data, f, indent=2, sort_keys=True)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())
    killpoints.reached(f"write:{path.name}")
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def remove_partial_writes(path: Path) -> list[Path]:
    """Delete the temporaries that :func:`write_json_atomic` calls killed mid-way left beside ``path``."""
    leftovers = [p for p in path.parent.glob(f".{path.name}.*") if len(p.name) == len(path.name) + 10]
    for p in leftovers:
        p.unlink(missing_ok=True)
    return leftovers


class Store:
    def __init__(self, root: Path) -> None:
        self.root = Path(root)
        self.objects = self.root / ".objects"
        self.tmp = self.root / ".tmp"
        for folder in (self.root, self.objects, self.tmp):
            folder.mkdir(parents=True, exist_ok=True)
        self._hand_manifests: dict[tuple, dict] = {}

    # -- start-up -----------------------------------------------------------------------
    def recover(self) -> list[str]:
        """Remove what interrupted pulls left behind; return what was removed."""
        removed = []
        for leftover in self.tmp.iterdir():
            shutil.rmtree(leftover, ignore_errors=True) if leftover.is_dir() else leftover.unlink()
            removed.append(str(leftover))
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
        return removed

    # -- reading ------------------------------------------------------------------------
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

    def _candidates(self) -> list[tuple[str, Path]]:
        """(name, entry) for every adapter-looking entry one or two levels down."""
        found = []
        for entry in sorted(self.root.iterdir()):
            if entry.name.startswith("."):
                continue
            if (entry / CONFIG_FILE).exists():
                found.append((entry.name, entry))
            elif entry.is_dir() and not entry.is_symlink():
                for sub in sorted(entry.iterdir()):
                    if not sub.name.startswith(".") and (sub / CONFIG_FILE).exists():
                        found.append((f"{entry.name}/{sub.name}", sub))
        return found

    def list(self) -> list[StoredAdapter]:
        adapters = []
        for name, entry in self._candidates():
            if not NAME_RE.match(name):
                _log.warning("ignoring %s: %r is not a valid adapter name", entry, name)
                continue
            try:
                adapters.append(self._load(name, entry))
            except LoractlError as e:
                _log.warning("ignoring %s: %s", entry, e.message)
        return adapters

    def has(self, name: str) -> bool:
        """Whether ``name`` is a valid name with an adapter in the store (not validated)."""
        return bool(NAME_RE.match(name)) and (self.root / name / CONFIG_FILE).exists()

    def get(self, name: str) -> StoredAdapter:
        validate_name(name)
        entry = self.root / name
        if not (entry / CONFIG_FILE).exists():
            raise AdapterNotFound(f"no adapter named {name!r} in the store",
                                  f"Pull it first: loractl pull ORG/REPO --name {name} (loractl ls lists the store).")
        return self._load(name, entry)

    def _load(self, name: str, entry: Path) -> StoredAdapter:
        real = entry.resolve()
        if not real.is_relative_to(self.root.resolve()):
            raise InvalidAdapter(f"{entry} leads out of the store (to {real})",
                                 "Copy the adapter into the store instead of linking to it.")
        for f in (CONFIG_FILE, WEIGHTS_FILE):
            if (real / f).is_symlink() and not (real / f).resolve().is_relative_to(self.root.resolve()):
                raise InvalidAdapter(f"{real / f} is a symlink out of the store", "Copy the file into the store.")
        hand_placed = not entry.is_symlink()
        if not hand_placed:
            manifest = json.loads((real / MANIFEST_FILE).read_text())
        else:
            manifest = self._hand_manifest(real)
        return StoredAdapter(name, real, manifest, hand_placed)

    def _hand_manifest(self, folder: Path) -> dict:
        """A manifest for a hand-placed adapter, computed (and cached by file stat), never written."""
        from loractld.store.sources import sha256_file

        files = [folder / n for n in (CONFIG_FILE, WEIGHTS_FILE) if (folder / n).is_file()]
        key = (str(folder), tuple((f.name, f.stat().st_size, f.stat().st_mtime_ns) for f in files))
        if key not in self._hand_manifests:
            config = read_config(folder)
            metadata = {}
            if (folder / SEED_METADATA_FILE).is_file():
                try:
                    metadata = json.loads((folder / SEED_METADATA_FILE).read_text())
                except ValueError:
                    metadata = {}
            records = [{"name": f.name, "size": f.stat().st_size, "sha256": sha256_file(f)} for f in files]
            self._hand_manifests[key] = {
                "source": "local", "ref": str(folder), "revision": "sha256:" + files_digest(records),
                "files": records, "pulled_at": max(f.stat().st_mtime for f in files),
                "base_model": config.get("base_model_name_or_path"), "rank": config.get("r"),
                "alpha": config.get("lora_alpha"), "target_modules": config.get("target_modules"),
                "metadata": metadata,
            }
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
        """Move a verified staging folder into the store under ``name``, atomically."""
        validate_name(name)
        entry = self.root / name
        if entry.exists() and not entry.is_symlink():
            raise InvalidAdapter(f"{name!r} is an adapter placed by hand in {entry}",
                                 "Remove that folder, or pull under another --name.")
        records = [r for r in manifest["files"]]
        manifest = {**manifest, "revision_digest": files_digest(records)}
        try:
            write_json_atomic(staged / MANIFEST_FILE, manifest)
            for f in staged.iterdir():
                with open(f, "rb") as fh:
                    os.fsync(fh.fileno())
            obj = self.objects / f"{int(time.time())}-{uuid.uuid4().hex[:12]}"
            os.rename(staged, obj)
            _fsync_dir(self.objects)
            entry.parent.mkdir(parents=True, exist_ok=True)
            link_tmp = entry.parent / f".{entry.name}.{uuid.uuid4().hex[:8]}"
            link_tmp.symlink_to(os.path.relpath(obj, entry.parent))
            killpoints.reached("store-install")
            os.replace(link_tmp, entry)
            _fsync_dir(entry.parent)
        except OSError as e:
            if e.errno == 28:  # ENOSPC
                raise DiskFull(f"the disk filled up while installing {name!r}") from e
            raise
        # The replaced revision's folder stays until collect_garbage: a running request may
        # still need vLLM to reload it from disk.
        return self._load(name, entry)

    def collect_garbage(self, keep: set[str] = frozenset()) -> list[str]:
        """Delete installed objects no name points to, except the folders in ``keep``."""
        referenced = {str(a.path) for a in self.list() if not a.hand_placed} | set(keep)
        removed = []
        for obj in self.objects.iterdir():
            if str(obj.resolve()) not in referenced and str(obj) not in referenced:
                shutil.rmtree(obj, ignore_errors=True)
                removed.append(str(obj))
        return removed

    def remove(self, name: str, *, keep_object: bool = False) -> StoredAdapter:
        """Remove ``name``. With ``keep_object`` a pulled adapter's folder stays for
        ``collect_garbage`` (requests that resolved it earlier may still need it)."""
        adapter = self.get(name)
        entry = self.root / name
        if adapter.hand_placed:
            shutil.rmtree(entry)
        else:
            entry.unlink()
            killpoints.reached("store-unlink")
            if not keep_object:
                shutil.rmtree(adapter.path, ignore_errors=True)
        parent = entry.parent
        if parent != self.root and not any(parent.iterdir()):
            parent.rmdir()
        return adapter


def files_digest(records: list[dict]) -> str:
    """The content digest of an adapter: sha256 over its files' names and sha256s."""
    import hashlib

    h = hashlib.sha256()
    for r in sorted(records, key=lambda r: r["name"]):
        h.update(f"{r['name']}\0{r['sha256']}\0".encode())
    return h.hexdigest()
