"""Pulling adapters: resolve, download, verify, validate, install — streamed as events.

Invariants:
- One pull per adapter name at a time (a per-name lock): a second client pulling the same
  name waits, then finds it up to date instead of racing the first.
- Everything between resolve and install runs in a worker thread against a staging folder
  inside the store; the staging folder is removed on any failure or cancellation, and only
  ``Store.install`` (atomic) makes the adapter visible.
- Checksums are verified against what the source reported (sha256 for LFS files, the git
  blob id for small files, sha256 for local copies) before validation; then key spellings
  are normalised (``normalize``): the manifest's ``files`` are the installed copy's, and
  ``original_files`` the source's.
- Once the engine is up, nothing is installed that its own loader refuses (``preflight``);
  a pull during the engine's start is checked at first use instead.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidAdapter, InvalidRequest
from loractl.names import validate_name
from loractld.store.sources import (AdapterSource, PullCancelled, Resolved, git_blob_sha1, pick_source, sha256_file)
from loractld.store.disk import StoredAdapter, Store, files_digest
from loractld.store.normalize import normalize_folder
from loractld.store.preflight import Preflight
from loractld.store.validate import AdapterFacts

_log = logging.getLogger("loractld.pulls")
PROGRESS_INTERVAL_S = 0.1

# validate(folder, force) -> facts; raises InvalidAdapter
Validator = Callable[[Path, bool], AdapterFacts]


@dataclass
class PullEvent:
    stage: str                  # resolving, downloading, verifying, checking, installing, done, up_to_date
    file: str = ""
    done: int = 0
    total: int = 0
    message: str = ""
    adapter: StoredAdapter | None = None
    previous: StoredAdapter | None = None   # done: the revision this pull replaced, if any


class Puller:
    def __init__(self, store: Store, sources: list[AdapterSource], validate: Validator,
                 preflight: Preflight | None = None) -> None:
        self.store = store
        self.sources = sources
        self.validate = validate
        self.preflight = preflight
        self._locks: dict[str, asyncio.Lock] = {}
        # What else holds a name, in words ("profile 'x'"), or None: adapters and profiles share
        # one name space (the catalog sets it; asked under the name's lock, as a create asks the store).
        self.other_holder: Callable[[str], str | None] = lambda name: None

    async def pull(self, ref: str, *, name: str = "", revision: str = "", force: bool = False,
                   token: str | None = None, endpoint: str | None = None,
                   installed: Callable[[PullEvent], Awaitable[None]] | None = None) -> AsyncIterator[PullEvent]:
        """Stream the pull's events. ``installed(done)`` runs once the adapter is installed, before
        the ``done`` event, and also when the caller went away after the install (the store's
        install cannot be called back): what follows an install (events, moving a pin to the new
        revision) never depends on the caller staying."""
        if name:
            validate_name(name)
        source = pick_source(self.sources, ref)
        yield PullEvent("resolving", message=f"resolving {ref}")
        resolved = await asyncio.to_thread(source.resolve, ref, revision or None, token=token, endpoint=endpoint)
        name = name or resolved.default_name
        lock = self.lock(name)
        async with lock:
            other = self.other_holder(name)
            if other is not None:
                raise InvalidRequest(f"{name!r} is taken: {other} has that name",
                                     "Pull under another --name (adapters and profiles share one name space; "
                                     "loractl ls lists them).")
            current = self._current(name)
            if current and current.manifest.get("ref") == resolved.ref and \
                    current.manifest.get("revision") == resolved.revision:
                yield PullEvent("up_to_date", message=f"{name} is up to date at {resolved.revision[:12]}",
                                adapter=current)
                return
            if current is not None and not current.hand_placed and not force and not same_source(current, resolved):
                # A new revision of the same source is an update; another source is another adapter.
                raise InvalidRequest(f"{name!r} is taken: it holds {origin(current)}, not {resolved.ref}",
                                     f"Pull under another --name, or replace it with --force "
                                     f"(loractl show {name} says what it is).")
            self.store.check_free_space(resolved.total_bytes)
            async for event in self._run(source, resolved, name, force, token, endpoint, current, installed):
                yield event

    def lock(self, name: str) -> asyncio.Lock:
        """Held by a pull of ``name`` from its resolve to its end (and by an rm of it: one of
        them at a time, so their events come in the order their changes took)."""
        return self._locks.setdefault(name, asyncio.Lock())

    def _current(self, name: str) -> StoredAdapter | None:
        try:
            return self.store.get(name)
        except Exception:
            return None

    async def _run(self, source, resolved: Resolved, name: str, force: bool, token, endpoint,
                   current: StoredAdapter | None, installed):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        cancel = threading.Event()
        last_sent: dict[str, float] = {}

        def emit(event: PullEvent) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, event)

        def progress(file: str, done: int, total: int) -> None:
            now = time.monotonic()
            if done >= total or now - last_sent.get(file, 0) >= PROGRESS_INTERVAL_S:
                last_sent[file] = now
                emit(PullEvent("downloading", file=file, done=done, total=total))

        def work() -> StoredAdapter:
            with self.store.staging() as staged:
                for f in resolved.files:
                    emit(PullEvent("downloading", file=f.name, done=0, total=f.size))
                source.download_to_disk(resolved, staged, progress, cancel, token=token, endpoint=endpoint)
                emit(PullEvent("verifying", message="verifying sha256 digests"))
                records = verify_files(staged, resolved)
                normalized = normalize_folder(staged)
                if normalized:
                    emit(PullEvent("verifying", message="normalised: " + "; ".join(normalized)))
                installed = installed_records(staged, records) if normalized else records
                facts = self.validate(staged, force)
                if self.preflight is not None and self.preflight.engine is not None:
                    emit(PullEvent("checking", message="loading it with the engine's own loader"))
                    # On the loop, which owns the engine; this thread waits for the answer.
                    asyncio.run_coroutine_threadsafe(
                        self.preflight.check(staged, files_digest(installed), name), loop).result()
                if cancel.is_set():
                    raise PullCancelled("the pull was cancelled")
                emit(PullEvent("installing", message=f"installing {name}"))
                manifest = {
                    "name": name, "source": resolved.source, "ref": resolved.ref, "revision": resolved.revision,
                    "files": installed, "pulled_at": time.time(), "base_model": facts.base_model, "rank": facts.rank,
                    "alpha": facts.alpha, "target_modules": facts.target_modules, "forced": bool(force),
                }
                if normalized:  # what was rewritten, and the files as the source had them
                    manifest.update(normalized=normalized, original_files=records)
                return self.store.install(name, staged, manifest)

        future = loop.run_in_executor(None, work)
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
        def done(adapter: StoredAdapter) -> PullEvent:
            return PullEvent("done", message=f"pulled {name} at {resolved.revision[:12]}", adapter=adapter,
                             previous=current)

        try:
            while (event := await queue.get()) is not None:
                yield event
            adapter = await future
        except (asyncio.CancelledError, GeneratorExit):
            cancel.set()  # the client went away: stop the download, keep holding the lock until it has
            while not future.done():
                # Until the thread has ended: a second cancel (the door's, a create's undo) that
                # cut this wait short let the install land after a create's undo had looked.
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait([future])
            with contextlib.suppress(BaseException):
                if future.exception() is None and installed is not None:
                    # Installed before the cancel reached the thread: the install stands, and so
                    # does what follows it (``installed`` finishes it even if this is cut short).
                    await installed(done(future.result()))
            raise
        event = done(adapter)
        if installed is not None:
            await installed(event)
        yield event


def same_source(current: StoredAdapter, resolved: Resolved) -> bool:
    """Whether ``resolved`` is (a revision of) where ``current`` was pulled from."""
    return not current.hand_placed and current.manifest.get("source") == resolved.source and \
        current.manifest.get("ref") == resolved.ref


def origin(adapter: StoredAdapter) -> str:
    """Where a stored adapter came from, in words: "the adapter pulled from /x", "the merge of a=0.5 b=0.5"."""
    manifest = adapter.manifest
    if adapter.hand_placed:
        return f"an adapter placed by hand in {adapter.path}"
    if "damaged" in manifest:
        return "a damaged adapter"
    if manifest.get("copied_from"):
        return f"a copy of {manifest['copied_from']}"
    if manifest.get("source") == "merge":
        return f"the merge of {manifest.get('ref', '')}"
    return f"the adapter pulled from {manifest.get('ref', '?')}"


def installed_records(folder: Path, records: list[dict]) -> list[dict]:
    """``records`` for the files as they are now in ``folder`` (after normalising)."""
    return [{"name": r["name"], "size": (folder / r["name"]).stat().st_size, "sha256": sha256_file(folder / r["name"])}
            for r in records]


def verify_files(folder: Path, resolved: Resolved) -> list[dict]:
    """Check every downloaded file's size and checksum against the source's listing."""
    records = []
    for f in resolved.files:
        path = folder / f.name
        size = path.stat().st_size if path.exists() else -1
        if size != f.size:
            raise InvalidAdapter(f"{f.name} has {size} bytes, the source listed {f.size}",
                                 "The download was damaged: pull again.")
        digest = sha256_file(path)
        if f.sha256 and digest != f.sha256:
            raise InvalidAdapter(f"{f.name}: sha256 {digest[:12]}… does not match the source's {f.sha256[:12]}…",
                                 "The download was damaged or the source changed: pull again.")
        if f.git_sha1 and git_blob_sha1(path) != f.git_sha1:
            raise InvalidAdapter(f"{f.name}: content does not match the source's blob id {f.git_sha1[:12]}…",
                                 "The download was damaged or the source changed: pull again.")
        records.append({"name": f.name, "size": size, "sha256": digest})
    return records
