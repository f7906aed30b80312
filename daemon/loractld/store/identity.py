"""Adapter identity: what loractl hands vLLM for an adapter, and why it is safe.

vLLM keys prefix-cache blocks by the ``LoRARequest``'s name (0.26) or name and path (0.32),
treats requests with equal names as one adapter, and needs an integer id unique per adapter.
So the name and id loractl gives vLLM are derived from the adapter's *content* (sha256 over
its files' sha256 digests):

- the same content gets the same name and id, in every run of the daemon;
- changed content (a new revision under the same user-facing name) gets a new name and id,
  so no KV block computed with the old weights is ever reused for the new ones.

Python's ``hash()`` is salted per process and is never used for this.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

from loractl.errors import AdapterNotFound, LoractlError
from loractld.engine.adapter import AdapterRef
from loractld.store.copies import stat_key, stat_key_size
from loractld.store.disk import Store, files_digest
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE, AdapterFacts

_ID_MASK = (1 << 31) - 1
INLINE_NEW = 32   # new adapters a listing always validates itself, past its deadline too
HOLD_POLL_S = 0.005   # how often a held warm-up looks again


class Checking:
    """An adapter a listing did not validate (its deadline had passed): shown as ``checking``."""

    def __repr__(self) -> str:
        return "CHECKING"


CHECKING = Checking()  # vLLM keeps ids in int32 tensors on some paths: stay positive int32


class AdapterResolver:
    """Turns a store name or an absolute folder into a validated :class:`AdapterRef`.

    Invariant: two different digests never share an ``engine_id`` within this process; the id
    is the digest's leading bits unless those are taken, so it is stable across restarts too.
    Validation results are cached by digest, so a request pays for hashing and validation
    once per content, not once per request.

    Store names resolve from an in-memory index, so a request reads no manifest: an entry
    stands while its name's store entry is unchanged — the same symlink target for a pulled
    adapter (a pull or rm always swaps or removes the link), the same files (inode, size,
    mtime and ctime: a rewrite that restores the mtime still moves the ctime) for one placed by
    hand or a folder. Checking that costs one or two system calls.

    Hashing and validating new content reads every byte (seconds for a large folder), so it
    never runs on the event loop: the daemon calls :meth:`resolve_async`, which answers a known
    name at once and runs anything else in a thread; one lock serializes the threads (the id
    table's check-then-take), and a folder's size is checked against ``max_bytes`` before its
    files are hashed.
    """

    def __init__(self, store: Store, validate: Callable[[Path, bool], AdapterFacts],
                 max_bytes: int | None = None, fingerprint: Callable[[], str] | None = None) -> None:
        """``fingerprint()``: what ``validate`` checks against now (``store.known``); None keeps
        no facts across runs."""
        self.store = store
        self.validate = validate
        self.max_bytes = max_bytes
        self.fingerprint = fingerprint
        self._lock = threading.RLock()
        self._facts: dict[tuple[str, bool], AdapterFacts | LoractlError] = {}
        self._ids: dict[str, int] = {}
        self._taken: set[int] = set()
        self._labels: dict[int, str] = {}
        self._weights: dict[int, int] = {}   # engine id -> its weights file's bytes (the exchange metrics)
        self._by_name: dict[str, tuple[tuple, AdapterRef]] = {}

    async def resolve_async(self, lora: str) -> AdapterRef:
        """:meth:`resolve` for a use (a request, a tier operation): anything but a known name's
        answer off the event loop, including the private copy of an adapter used in place (made
        here, ahead of the lease that keeps it: ``Store.lease`` makes it again if it went)."""
        ref = self.cached(lora)
        copies = self.store.copies
        if ref is not None and (not copies.is_copy(ref.path) or (ref.path / WEIGHTS_FILE).exists()):
            return ref
        return await asyncio.to_thread(self._resolve_for_use, lora)

    def _resolve_for_use(self, lora: str) -> AdapterRef:
        ref = self.resolve(lora)
        if self.store.copies.is_copy(ref.path):
            self.store.copies.materialize(ref.path)
        return ref

    def warm(self, names: list[str], pause_s: float = 0.0, hold: Callable[[], bool] | None = None) -> None:
        """Resolve ``names`` now, in the caller's thread (hashing and validating new content reads
        every byte), so that the event loop's later asks are answered from the caches; a name
        that does not resolve is left to fail again, from its cached answer, where it is asked.
        ``pause_s``: a sleep after each, which hands the GIL to the event loop at once; ``hold()``:
        while true, wait (a request runs that this thread would slow down)."""
        for name in names:
            try:
                self.resolve(name)
            except LoractlError:
                pass
            if pause_s:
                time.sleep(pause_s)
            while hold is not None and hold():
                time.sleep(HOLD_POLL_S)

    def resolve_listed(self, adapters: list, deadline: float | None = None
                       ) -> dict[str, AdapterRef | LoractlError | Checking]:
        """Each of ``adapters`` (what ``Store.list`` just returned) resolved, or why not: a name
        resolved under the entry key that listing read (``Store.listed_key``) is answered with no
        system call (the listing checked those stats); any other is resolved now, hashing and
        validating new content, until ``deadline`` (``time.monotonic()``) has passed and
        :data:`INLINE_NEW` new ones were: the rest are :data:`CHECKING` (validated by whoever
        warms them: ``warm``). A listing of 10,000 new adapters answers in a fraction of a second
        instead of the 6 s their validation takes."""
        answers: dict[str, AdapterRef | LoractlError | Checking] = {}
        new = 0
        # The lock held for the whole listing, not taken per adapter: a background warm-up
        # (``warm``) takes it per adapter, and two threads handing one lock back and forth under
        # the GIL wait a switch interval per hand-over (10,000 of them were 10 s at start-up).
        with self._lock:
            for adapter in adapters:
                new = self._listed_answer(adapter, answers, deadline, new)
        return answers

    def _listed_answer(self, adapter, answers: dict, deadline: float | None, new: int) -> int:
        """``resolve_listed``'s answer for one adapter, into ``answers``; returns ``new`` plus one
        if it was resolved the slow way (hashed or validated now)."""
        known, listed = self._by_name.get(adapter.name), self.store.listed_key(adapter.name)
        if known is not None and listed is not None and known[0] == listed:
            answers[adapter.name] = known[1]
            return new
        if listed is not None and (ref := self._listed_ref(adapter, listed)) is not None:
            answers[adapter.name] = ref
            return new
        if deadline is not None and new >= INLINE_NEW and time.monotonic() > deadline:
            answers[adapter.name] = CHECKING
            return new
        try:
            answers[adapter.name] = self.resolve(adapter.name)
        except LoractlError as e:
            answers[adapter.name] = e
        return new + 1

    def _listed_ref(self, adapter, listed: tuple | bytes) -> AdapterRef | None:
        """:meth:`resolve`'s answer for a store entry a listing just read under ``listed`` whose
        content's validation is known (in this run, or kept from the last: ``store.known``),
        from what the listing read: no system call (the listing checked the stats), where
        ``resolve`` took ten (1.2 s for 10,000 after a restart). None: resolve it."""
        files = adapter.manifest.get("files")
        if not files:
            return None
        digest, forced = files_digest(files), bool(adapter.manifest.get("forced"))
        facts = self._facts.get((digest, forced))
        if facts is None and (facts := self._kept_facts(digest, forced)) is not None:
            self._facts[(digest, forced)] = facts
        if not isinstance(facts, AdapterFacts):
            return None
        path = adapter.path
        if adapter.hand_placed:   # served from its private copy (``_snapshot``), made when leased
            path = self.store.copies.known_source(adapter.path, digest)
        with self._lock:
            ref = AdapterRef(label=adapter.name, path=path, digest=digest, engine_id=self._id_for(digest))
            self._labels[ref.engine_id] = adapter.name
            self._weights[ref.engine_id] = next((f["size"] for f in files if f["name"] == WEIGHTS_FILE), 0)
            self._by_name[adapter.name] = (listed, ref)
        return ref

    def known(self, adapters: list) -> dict[str, AdapterRef | LoractlError | int | None]:
        """What is known of ``adapters`` (what ``Store.list`` returned) without validating
        anything: a name's answer where it was resolved under the key that listing read, else its
        content's engine id from its manifest's digests (None: no files listed, damaged). For the
        registry entry at start-up: validating 10,000 adapters before READY took 6 s."""
        answers: dict[str, AdapterRef | LoractlError | int | None] = {}
        with self._lock:   # once, not per adapter (see resolve_listed)
            for adapter in adapters:
                answers[adapter.name] = self._known_answer(adapter)
        return answers

    def _known_answer(self, adapter) -> AdapterRef | LoractlError | int | None:
        known, listed = self._by_name.get(adapter.name), self.store.listed_key(adapter.name)
        if known is not None and listed is not None and known[0] == listed:
            return known[1]
        if files := adapter.manifest.get("files"):
            digest = files_digest(files)
            refused = self._facts.get((digest, bool(adapter.manifest.get("forced"))))
            return refused if isinstance(refused, LoractlError) else self._id_for(digest)
        return None

    def cached(self, lora: str) -> AdapterRef | None:
        """The answer for a store name whose entry is unchanged since it was resolved; else None."""
        if os.path.isabs(lora):
            return None
        cached = self._by_name.get(lora)
        if cached is None:
            return None
        key = self._entry_key(lora)
        return cached[1] if key is not None and cached[0] == key else None

    def resolve(self, lora: str) -> AdapterRef:
        ref = self.cached(lora)
        if ref is not None:
            return ref
        with self._lock:
            key = None if os.path.isabs(lora) else self._entry_key(lora)
            ref = self._resolve(lora)
            if key is not None:
                self._by_name[lora] = (key, ref)
            return ref

    def _entry_key(self, name: str) -> tuple | bytes | None:
        """What identifies the store entry behind ``name`` right now; None: look on disk."""
        return self.store.entry_key(name)

    def _resolve(self, lora: str) -> AdapterRef:
        if os.path.isabs(lora):
            source = Path(lora)
            if not source.is_dir():
                raise AdapterNotFound(f"no adapter folder at {source}")
            path, digest = self._snapshot(source)
            label = f"{source.parent.name}/{source.name}" if source.parent.name else source.name
            forced, files = False, source
        else:
            stored = self.store.get(lora)
            if stored.hand_placed:  # used in place, like a folder: served from a private copy
                path, digest = self._snapshot(stored.path)
                files = stored.path
            else:  # pulled: an installed object, never rewritten
                path, digest = stored.path, files_digest(stored.manifest["files"])
                files = path
            label = lora
            # A pull --force accepted another base model's name once; every use honours it.
            forced = bool(stored.manifest.get("forced"))
        # Raises for content that does not validate; an adapter used in place is read there (its
        # copy is made only for a use), and its stats are checked again below.
        self._facts_for(digest, files, forced)
        if files != path and self.store.copies.path_for(files, stat_key(files))[1] != digest:
            # Rewritten while validated: these facts may be the new content's. Validated again at
            # the next resolve; a use is safe regardless (its copy must hash to ``digest``, and the
            # preflight loads that copy).
            self._facts.pop((digest, forced), None)
        else:
            self._keep_facts(digest, forced)
        ref = AdapterRef(label=label, path=path, digest=digest, engine_id=self.id_for(digest))
        self._labels[ref.engine_id] = label
        with contextlib.suppress(OSError):
            self._weights[ref.engine_id] = os.stat(files / WEIGHTS_FILE).st_size
        return ref

    def weights_bytes(self, engine_id: int) -> int:
        """The size of the weights file an engine id was last resolved from (what a load from disk
        reads); 0 if unknown."""
        return self._weights.get(engine_id, 0)

    def label_of(self, engine_id: int) -> str | None:
        """The name an engine id was last resolved from (for events and listings)."""
        return self._labels.get(engine_id)

    def relabel(self, removed: str, engine_id: int, others: list[str]) -> None:
        """``removed`` is gone: an id labelled by it takes another name of the same content, if
        any (events must not name an adapter that no longer exists)."""
        if self._labels.get(engine_id) == removed:
            if others:
                self._labels[engine_id] = others[0]
            else:
                del self._labels[engine_id]

    def _facts_for(self, digest: str, path: Path, forced: bool = False) -> AdapterFacts:
        key = (digest, forced)
        if key not in self._facts and (kept := self._kept_facts(digest, forced)) is not None:
            self._facts[key] = kept
        if key not in self._facts:
            try:
                self._facts[key] = self.validate(path, forced)
            except LoractlError as e:
                self._facts[key] = e
        result = self._facts[key]
        if isinstance(result, LoractlError):
            raise result
        return result

    def _kept_facts(self, digest: str, forced: bool) -> AdapterFacts | None:
        """The facts the last run validated for this content under the same fingerprint."""
        if self.fingerprint is None:
            return None
        kept = self.store.known.facts(digest, forced, self.fingerprint())
        try:
            return None if kept is None else AdapterFacts(*kept)
        except TypeError:   # another shape of facts: validate again
            return None

    def _keep_facts(self, digest: str, forced: bool) -> None:
        facts = self._facts.get((digest, forced))
        if self.fingerprint is not None and isinstance(facts, AdapterFacts):
            self.store.known.keep_facts(digest, forced, self.fingerprint(),
                                        [facts.rank, facts.alpha, list(facts.target_modules), facts.base_model])

    def _snapshot(self, path: Path) -> tuple[Path, str]:
        """Where the private copy of the adapter used in place at ``path`` is (or will be: made
        when leased, ``loractld.store.copies``) and its digest: the folder is hashed in place
        once per content, found again while the files' stats are unchanged."""
        key = stat_key(path)
        if key is None or (self.max_bytes is not None and stat_key_size(key) > self.max_bytes):
            # Before hashing: raises the precise reason (missing config, pickle only, over the cap).
            self.validate(path, False)
        return self.store.copies.path_for(path, key)

    def id_for(self, digest: str) -> int:
        with self._lock:
            return self._id_for(digest)

    def _id_for(self, digest: str) -> int:
        if digest not in self._ids:
            candidate = int(digest[:8], 16) & _ID_MASK or 1
            while candidate in self._taken:
                candidate = candidate % _ID_MASK + 1
            self._ids[digest] = candidate
            self._taken.add(candidate)
        return self._ids[digest]
