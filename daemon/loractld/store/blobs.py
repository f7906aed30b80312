"""Uploaded blobs (Ollama's ``/api/blobs/sha256:<hex>``): files a client sends by digest so that a
later ``/api/create`` can name them (an adapter's ``adapter_config.json`` and weights).

Layout: ``<store>/.blobs/sha256-<hex>``, beside the adapters and out of their listing (a dot
folder); an upload in flight is ``.blobs/.part-<uuid>``; an adapter folder being assembled from
blobs for a create is ``.blobs/.assembled-<digest>/`` (hard links, else copies).

Invariants:
- A blob on disk is whole and its content's sha256 is its name: it is written to a part file
  while its digest is computed, and renamed into place only when the digest matches; a part
  file that fails (wrong digest, too large, over quota, short of disk, the client gone) is
  removed, so a refused upload leaves nothing. Part files left by a killed daemon are removed
  when the blobs are next opened.
- No upload makes the disk fill: each blob is bounded by ``max_blob_bytes`` (the daemon's
  ``--max-adapter-size``), all blobs together (those stored and those in flight) by
  ``quota_bytes``, and every write first checks that the store's disk keeps its free margin
  (``Store.check_free_space``). Blobs no create used within ``UNUSED_TTL_S`` are removed
  when the quota needs their room, and at start.
- A blob a create has checked is held (:meth:`hold`) until that create ends (:meth:`release`):
  creates that name the same blobs run side by side, and the one that finishes first removes
  nothing the others still need; the last one out removes what a successful create used.
- What a killed daemon leaves (``.part-*`` uploads, ``.assembled-*`` folders of hard links) is
  removed at the next start (:func:`clear_leftovers`, called when the store is opened).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import shutil
import threading
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Callable, Iterable
from pathlib import Path

from loractl.errors import InvalidRequest

BLOBS_DIR = ".blobs"
FLUSH_BYTES = 4 << 20
UNUSED_TTL_S = 3600.0   # an upload no create used in this long is given up when its room is wanted
_DIGEST = re.compile(r"^sha256[:-]([0-9a-f]{64})$")


def blob_hex(digest: str) -> str:
    """``sha256:<hex>`` (or ``sha256-<hex>``) -> ``<hex>``; refused when it is no sha256 digest."""
    match = _DIGEST.match(digest.strip().lower()) if isinstance(digest, str) else None
    if match is None:
        raise InvalidRequest(f"{digest!r} is not a sha256 digest", "Name a blob as sha256:<64 hex digits>.")
    return match.group(1)


def clear_leftovers(store_root: Path) -> list[Path]:
    """Remove what a daemon killed mid-upload or mid-create left under ``<store>/.blobs``: part
    files and assembled folders (never a blob). Returns what it removed."""
    root = Path(store_root) / BLOBS_DIR
    removed = []
    for leftover in [*root.glob(".part-*"), *root.glob(".assembled-*")]:
        if leftover.is_dir() and not leftover.is_symlink():
            shutil.rmtree(leftover, ignore_errors=True)
        else:
            leftover.unlink(missing_ok=True)
        removed.append(leftover)
    return removed


class Blobs:
    def __init__(self, store_root: Path, *, max_blob_bytes: int, quota_bytes: int,
                 check_free_space: Callable[[int], None]) -> None:
        self.root = Path(store_root) / BLOBS_DIR
        self.root.mkdir(parents=True, exist_ok=True)
        self.max_blob_bytes = max_blob_bytes
        self.quota_bytes = quota_bytes
        self._check_free_space = check_free_space
        self._lock = threading.Lock()
        self._in_flight: dict[str, int] = {}
        self._held: Counter[str] = Counter()   # blob hex -> creates in flight that name it
        self._used: set[str] = set()           # held blobs a finished create installed: removed at the last release
        clear_leftovers(store_root)
        self._prune(time.time() - UNUSED_TTL_S)

    def _prune(self, before: float) -> None:
        """Remove the blobs uploaded before ``before`` that no create used (one that did removed
        its own): the quota is never held for good by uploads nobody came back for."""
        for blob in self.root.glob("sha256-*"):
            with contextlib.suppress(OSError):
                if blob.name.removeprefix("sha256-") not in self._held and blob.stat().st_mtime < before:
                    blob.unlink()

    def path(self, digest: str) -> Path:
        return self.root / f"sha256-{blob_hex(digest)}"

    def has(self, digest: str) -> bool:
        return self.path(digest).is_file()

    def stored_bytes(self) -> int:
        return sum(p.stat().st_size for p in self.root.glob("sha256-*") if p.is_file())

    def _claim(self, key: str, size: int) -> None:
        """Count ``size`` more bytes of upload ``key`` against the bounds, or refuse."""
        with self._lock:
            if size > self.max_blob_bytes:
                raise InvalidRequest(f"the blob is larger than {self.max_blob_bytes} bytes",
                                   "An adapter's file must fit loractld --max-adapter-size.")
            others = sum(v for k, v in self._in_flight.items() if k != key)
            if self.stored_bytes() + others + size > self.quota_bytes:
                self._prune(time.time() - UNUSED_TTL_S)
            if self.stored_bytes() + others + size > self.quota_bytes:
                raise InvalidRequest(f"the uploaded blobs would pass their quota of {self.quota_bytes} bytes",
                                   "Create the model from the blobs sent so far (they are removed once used), "
                                   "or raise loractld --max-adapter-size.")
            self._check_free_space(size - self._in_flight.get(key, 0))
            self._in_flight[key] = size

    async def write(self, digest: str, chunks: AsyncIterator[bytes], declared: int | None = None) -> bool:
        """Store the blob ``digest`` from ``chunks`` (see the module's invariants); False when it
        was stored already (``chunks`` is then not read)."""
        final = self.path(digest)
        if final.is_file():
            os.utime(final)   # sent again: wanted again (not pruned as unused)
            return False
        key = uuid.uuid4().hex
        part = self.root / f".part-{key}"
        sha, size, buffer = hashlib.sha256(), 0, bytearray()
        try:
            if declared is not None:
                self._claim(key, declared)
            with open(part, "wb") as f:
                async for chunk in chunks:
                    size += len(chunk)
                    if declared is not None and size > declared:
                        raise InvalidRequest("the body is longer than its Content-Length", "Send the file as is.")
                    sha.update(chunk)
                    buffer += chunk
                    if len(buffer) >= FLUSH_BYTES:
                        if declared is None:
                            self._claim(key, size)
                        await asyncio.to_thread(f.write, bytes(buffer))
                        buffer.clear()
                if declared is None:
                    self._claim(key, size)
                await asyncio.to_thread(_finish, f, bytes(buffer))
            if sha.hexdigest() != blob_hex(digest):
                raise InvalidRequest(f"the uploaded content's digest is sha256:{sha.hexdigest()}, not {digest}",
                                     "Upload the file whose sha256 the path names.")
            os.replace(part, final)
            return True
        finally:
            with self._lock:
                self._in_flight.pop(key, None)
            part.unlink(missing_ok=True)

    def remove(self, digests: list[str]) -> None:
        with self._lock:
            for digest in digests:
                if blob_hex(digest) not in self._held:
                    self.path(digest).unlink(missing_ok=True)

    def hold(self, digests: Iterable[str]) -> None:
        """Hold these blobs for one create (see the module's invariants); InvalidRequest naming the
        first that is not uploaded, holding none."""
        hexes = [blob_hex(d) for d in digests]
        with self._lock:
            missing = next((h for h in hexes if not (self.root / f"sha256-{h}").is_file()), None)
            if missing is not None:
                raise InvalidRequest(f"blob sha256:{missing} is not uploaded", f"POST /api/blobs/sha256:{missing} first.")
            self._held.update(hexes)

    def release(self, digests: Iterable[str], *, used: bool) -> None:
        """One create is done with the blobs it held; ``used``: it installed them, so they go once
        no other create holds them (their content is in the store)."""
        with self._lock:
            for h in (blob_hex(d) for d in digests):
                if used:
                    self._used.add(h)
                self._held[h] -= 1
                if self._held[h] > 0:
                    continue
                del self._held[h]
                if h in self._used:
                    self._used.discard(h)
                    (self.root / f"sha256-{h}").unlink(missing_ok=True)

    def assembled_path(self, files: dict[str, str]) -> Path:
        """Where :meth:`assemble` puts ``files``: named by their content (what a pull of it records as its ref)."""
        key = hashlib.sha256("".join(f"{n}\0{blob_hex(d)}\n" for n, d in sorted(files.items())).encode()).hexdigest()
        return self.root / f".assembled-{key[:32]}"

    def assemble(self, files: dict[str, str]) -> Path:
        """A folder holding ``files`` (name -> blob digest), named by its content, for a pull. Its
        caller holds the blobs (:meth:`hold`) and is the only one assembling these files."""
        folder = self.assembled_path(files)
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir()
        for name, digest in files.items():
            try:
                os.link(self.path(digest), folder / name)
            except OSError:   # a file system without hard links
                shutil.copyfile(self.path(digest), folder / name)
        return folder


def _finish(f, tail: bytes) -> None:
    f.write(tail)
    f.flush()
    os.fsync(f.fileno())
