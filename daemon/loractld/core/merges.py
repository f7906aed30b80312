"""Weighted merges of stored adapters (``loractl merge``) in :class:`loractld.core.core.Core`.

A part of ``Core`` (a base class of it), beside :mod:`loractld.core.disk_ops`: a merge is a pull
whose files are made here (``loractld.store.merge``) instead of downloaded, and installs as a pull
does: validated against the base model, checked by the engine's own loader, stored by content,
announced (``DOWNLOADED_TO_DISK``), a replaced revision's pin moved.

Invariants, on top of Core's:
- The content is a function of the sources' contents and weights only, not of the order they
  were named in nor of their names: the sources are merged in the order of their digests (then
  weights), so merging the same sources with the same weights again gives the same digest, and
  a name already holding that content is left as it is (``up to date``).
- The manifest records the sources (name, digest, weight), the method and, for ``svd``, the
  measured relative error: what ``show`` reports.
- A merge and a pull (or an ``rm``) of one name take turns (the puller's per-name lock); once
  its files are being made, the merge runs to its end even if its caller goes away.
- Who may merge: the door decides as for a pull (gRPC ``@mutating("merge")``); a caller passed
  here (another door, a profile's create) is judged by ``core.policy`` and audited.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING

from loractl.errors import Cancelled, InvalidRequest
from loractl.names import validate_name
from loractld.core import policy
from loractld.store.disk import files_digest
from loractld.store.merge import merge_adapters
from loractld.store.pulls import PullEvent, installed_records, origin
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE
from loractld.views import AdapterView

if TYPE_CHECKING:
    from loractld.core.state import Catalog
    from loractld.store.disk import StoredAdapter

_log = logging.getLogger("loractld.core")


class MergeOps:
    async def merge(self, name: str, sources: list[tuple[str, float]], *, method: str = "cat",
                    svd_rank: int | None = None, caller: policy.Caller | None = None,
                    force: bool = False) -> AdapterView:
        """Store under ``name`` the adapter whose delta is ``sum(weight * delta(source))``
        (``method`` ``cat``: exact; ``svd``: truncated to ``svd_rank``, its error reported).
        A name holding another adapter is refused unless ``force``; one holding a merge of the
        same sources and weights is updated (a source's new revision), a profile's always refused."""
        validate_name(name)
        if caller is None:   # the door authorized and audited it (gRPC's @mutating)
            return await self._merge(name, sources, method, svd_rank, force)
        async with policy.authorized(caller, self.socket_gid, "merge", name, refusal="merge adapters",
                                     hint="Ask the daemon's owner, or use the HTTP API key."):
            return await self._merge(name, sources, method, svd_rank, force)

    async def _merge(self, name: str, sources: list[tuple[str, float]], method: str,
                     svd_rank: int | None, force: bool = False) -> AdapterView:
        catalog = await self._wait_catalog()
        engine, _ = await self._wait_engine()   # its rank limit, and its loader's word (preflight)
        if not sources:
            raise InvalidRequest("nothing to merge", "Name the adapters: loractl merge NEW A=0.7 B=0.3.")
        if name in {source for source, _ in sources}:
            raise InvalidRequest(f"{name!r} is one of the merge's sources",
                                 "Give the merge a new name (or loractl rm the old one afterwards).")
        stored = []
        for source, weight in sources:
            profile = self.profile_of(source)
            if profile is not None:
                raise InvalidRequest(f"{source!r} is a profile, not an adapter: a merge takes stored adapters",
                                     f"Merge the adapter it runs ({profile.adapter})." if profile.adapter else
                                     f"It runs the base model, which has no delta to merge; loractl show {source}.")
            adapter = await asyncio.to_thread(self._stored_or_close, catalog, source)   # AdapterNotFound, damaged
            stored.append((files_digest(adapter.manifest["files"]), float(weight), adapter))
        stored.sort(key=lambda s: (s[0], s[1]))   # the content does not depend on the order given
        stop = threading.Event()
        with self._tracked("the daemon is shutting down; the merge was stopped (nothing was installed)"):
            # Once started it holds its name's lock to its end, and an install is announced whoever
            # waits for it. A caller that leaves (Ctrl-C: the stream reset cancels this task) stops
            # it at its next source or module, before the install: nothing is left. One that leaves
            # after the install point gets the merge completed, and the audit says ok.
            made = asyncio.ensure_future(self._make(catalog, name, stored, method, svd_rank,
                                                    engine.settings.max_lora_rank, force, stop))
            try:
                adapter = await self._after_installs(made)
            except asyncio.CancelledError:
                stop.set()
                while not made.done():   # the thread's next check, or the install's end
                    with contextlib.suppress(asyncio.CancelledError):   # the door may cancel again
                        await asyncio.wait({made})
                if made.cancelled() or made.exception() is not None:
                    _log.info("merge %s cancelled by its caller: nothing was installed", name)
                    raise
                adapter = made.result()
                _log.info("merge %s completed after its caller left", name)
        state = await self.tiers.sync() if self.tiers else None
        return self._described(catalog, adapter, state)

    async def _make(self, catalog: Catalog, name: str, stored: list, method: str, svd_rank: int | None,
                    max_lora_rank: int, force: bool = False,
                    stop: threading.Event | None = None) -> StoredAdapter:
        loop = asyncio.get_running_loop()
        stop = stop or threading.Event()
        async with catalog.puller.lock(name), contextlib.AsyncExitStack() as leases:
            other = catalog.puller.other_holder(name)   # under the name's lock, as a create asks the store
            if other is not None:
                raise InvalidRequest(f"{name!r} is taken: {other} has that name", "Give the merge another name "
                                     "(adapters and profiles share one name space; loractl ls lists them).")
            current = _current(catalog, name)
            if current is not None and not current.hand_placed and not force and not (
                    current.manifest.get("source") == "merge" and
                    current.manifest.get("ref") == _ref(stored, method, svd_rank)):
                # The same sources and weights again: an update (a source's new revision); else another adapter.
                raise InvalidRequest(f"{name!r} is taken: it holds {origin(current)}",
                                     "Give the merge another name, or replace it with --force "
                                     f"(loractl show {name} says what it is).")
            for _, _, adapter in stored:   # no GC deletes a source's folder while it is read
                leases.callback(catalog.store.lease(adapter.path).release)

            def work() -> StoredAdapter | None:
                with catalog.store.staging() as staged:
                    report = merge_adapters([(a.path, w) for _, w, a in stored], staged, max_lora_rank=max_lora_rank,
                                            method=method, svd_rank=svd_rank, labels=[a.name for _, _, a in stored],
                                            stopped=stop.is_set)
                    records = installed_records(staged, [{"name": CONFIG_FILE}, {"name": WEIGHTS_FILE}])
                    digest = files_digest(records)
                    if current is not None and current.manifest.get("files") and \
                            files_digest(current.manifest["files"]) == digest:
                        return None   # this name holds this content already
                    facts = catalog.puller.validate(staged, any(a.manifest.get("forced") for _, _, a in stored))
                    asyncio.run_coroutine_threadsafe(catalog.preflight.check(staged, digest, name), loop).result()
                    merged = {"method": method, "rank": report.rank, "relative_error": report.relative_error,
                              "sources": [{"name": a.name, "digest": d, "weight": w,
                                           "revision": str(a.manifest.get("revision") or "")} for d, w, a in stored]}
                    manifest = {
                        "name": name, "source": "merge", "ref": _ref(stored, method, svd_rank),
                        "revision": "sha256:" + digest, "files": records, "pulled_at": time.time(),
                        "base_model": facts.base_model, "rank": facts.rank, "alpha": facts.alpha,
                        "target_modules": facts.target_modules, "forced": False, "merge": merged,
                    }
                    if stop.is_set():   # the last point where nothing is left behind
                        raise Cancelled("the merge was cancelled: nothing was installed", "Run it again.")
                    return catalog.store.install(name, staged, manifest)

            adapter = await loop.run_in_executor(None, work)
            if adapter is None:
                _log.info("merge %s: up to date", name)
                return current
            _log.info("merged %s from %s", name, adapter.manifest["ref"])
            await self._installed(catalog, PullEvent("done", message=f"merged {name}", adapter=adapter,
                                                     previous=current))
            return adapter


def _current(catalog: Catalog, name: str) -> StoredAdapter | None:
    try:
        return catalog.store.get(name)
    except Exception:   # none, or damaged: the merge replaces it as a pull would
        return None


def _ref(stored: list, method: str, svd_rank: int | None) -> str:
    """The merge in words, as ``loractl merge`` takes it: ``a/v1=0.7 b/v1=0.3`` (``svd:R``)."""
    terms = " ".join(f"{a.name}={w:g}" for _, w, a in stored)
    return f"{terms} (svd, rank {svd_rank})" if method == "svd" else terms
