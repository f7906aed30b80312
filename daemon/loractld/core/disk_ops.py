"""The disk tier's operations of :class:`loractld.core.core.Core`: pull, list, show and remove, and
what a new revision changes in the engine (its pin moved, the old revision dropped).

A part of ``Core`` (a base class of it), in its own module only to keep each readable in one
sitting: it uses Core's catalog, tiers, engine, events and request bookkeeping. Invariants, on
top of Core's:

- what follows an install (``DOWNLOADED_TO_DISK``, the pin moved to the new revision, the old
  revision dropped from the engine) runs to its end whoever waits for it: a router's registry
  fed by the events must hear of every install;
- an ``rm`` that holds the name's claim runs to its end even if its caller goes away: the name
  never ends gone from disk with its pin still recorded or no ``DELETED_FROM_DISK``;
- an ``rm`` and a pull of one name take turns (the puller's per-name lock), so their events
  come in the order their changes took;
- an engine id stays in the engine while another name with its content, or a pin, holds it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from loractl.errors import AdapterNotFound, InvalidRequest, LoractlError
from loractld.events import Event
from loractld.store.identity import CHECKING
from loractld.views import AdapterView, RemovedView

if TYPE_CHECKING:
    from loractld.core.state import Catalog
    from loractld.serving.tiers import Tiers
    from loractld.store.disk import StoredAdapter
    from loractld.store.identity import AdapterRef
    from loractld.store.pulls import PullEvent

_log = logging.getLogger("loractld.core")
# What a listing spends validating new content before it lists the rest as ``checking``
# (validated in the background): a store of 10,000 new adapters took 6 s to validate.
LISTING_VALIDATION_S = 0.25
# The background validation's pause after each adapter: the loop's requests come first (about
# 1 ms each validation takes on the tiny model's adapters: it runs at half speed, 10,000 in ~15 s).
CHECKING_PAUSE_S = 0.001


class DiskOps:
    async def pull(self, ref: str, *, name: str = "", revision: str = "", force: bool = False,
                   token: str | None = None, endpoint: str | None = None) -> AsyncIterator[PullEvent]:
        catalog = await self._wait_catalog()
        if not ref:
            raise InvalidRequest("nothing to pull", "Give a Hub id (org/repo), hf://org/repo, or a folder.")
        with self._tracked("the daemon is shutting down; the pull was stopped (nothing was installed)"):
            async with contextlib.aclosing(catalog.puller.pull(
                    ref, name=name, revision=revision, force=force, token=token, endpoint=endpoint,
                    installed=lambda done: self._installed(catalog, done))) as events:
                async for event in events:
                    if event.adapter is not None:
                        _log.info("pull %s: %s", event.stage, event.message)
                    yield event

    async def _installed(self, catalog: Catalog, done: PullEvent) -> None:
        """A pull installed ``done.adapter``: announce it and move what the replaced revision held
        (:meth:`_replaced`), to the end even if the pull's caller goes away meanwhile (or went
        away after the install): the new revision is on disk either way, and a router's
        registry, fed by the events, must hear of it; a pin left on the old revision unannounced
        would hold its place with nothing saying so."""
        async def announce_and_replace() -> None:
            self.events.publish(Event("DOWNLOADED_TO_DISK", done.adapter.name, message=done.message))
            await self._replaced(catalog, done.adapter.name, done.previous)
        await self._after_installs(announce_and_replace())

    async def list_adapters(self) -> list[AdapterView]:
        """Every stored adapter's view. Shared parts (files, target modules) are the listing's
        own: read them, never change them. An unchanged store costs a check of its stats
        (``Store.list``), dictionary lookups (``resolve_listed``) and a copy of each adapter's
        manifest view, made once per store entry (``_manifest_views``)."""
        with self.in_foreground():
            return await self._list_adapters()

    async def _list_adapters(self) -> list[AdapterView]:
        catalog = await self._wait_catalog()
        adapters = await asyncio.to_thread(catalog.store.list)
        deadline = time.monotonic() + LISTING_VALIDATION_S
        refs = await asyncio.to_thread(catalog.resolver.resolve_listed, adapters, deadline)
        checking = [name for name, ref in refs.items() if ref is CHECKING]
        if checking:
            self.warm_in_background(catalog, checking)
        state = await self.tiers.sync() if self.tiers else None
        known = self._manifest_views
        views: dict[int, tuple[StoredAdapter, AdapterView]] = {}
        described = []
        for a in adapters:
            held = known.get(id(a))
            if held is None or held[0] is not a:   # id() is only a key while the object lives: kept in the value
                held = (a, AdapterView.of(a))
            views[id(a)] = held
            described.append(self._described(catalog, a, state, refs.get(a.name), held[1].copy()))
        self._manifest_views = views   # this listing's entries only: nothing stays for a removed one
        return described

    def warm_in_background(self, catalog: Catalog, names: list[str]) -> None:
        """Validate ``names`` off the loop, one warm-up at a time (a listing that finds some still
        unchecked while one runs leaves them to it or to the next), then keep what it learned
        for the next start (``store.known``).

        It yields to the requests: it pauses after each adapter, and waits while a listing runs
        (:meth:`in_foreground`). On two cores a validation thread beside the first ``ls`` took
        the GIL from it (1-1.7 s instead of 0.4 s at 10,000 adapters). Start-up's listing leaves
        its names for after READY (:meth:`start_checking`): validated while the engine started,
        10,000 adapters made the start 1.2-1.6x as long."""
        if not self.started_up:
            self._unchecked = names
            return
        if self._warming is not None and not self._warming.done():
            return

        async def warm() -> None:
            await asyncio.to_thread(catalog.resolver.warm, names, CHECKING_PAUSE_S, self._listing_now)
            await asyncio.to_thread(catalog.store.save_known)
        self._warming = asyncio.create_task(warm())

    def start_checking(self) -> None:
        """Start-up is over: validate what its listing left unchecked (:meth:`warm_in_background`)."""
        names, self._unchecked = self._unchecked, []
        if names and self.catalog is not None:
            self.warm_in_background(self.catalog, names)

    @contextlib.contextmanager
    def in_foreground(self):
        """A listing runs: the background validation waits meanwhile (:meth:`warm_in_background`)."""
        self._foreground += 1
        try:
            yield
        finally:
            self._foreground -= 1

    def _listing_now(self) -> bool:
        return self._foreground > 0

    async def checked_in_background(self) -> bool:
        """Wait for the background validation a listing started (:meth:`warm_in_background`), if
        one runs; whether one did."""
        task = self._warming
        if task is None:
            return False
        with contextlib.suppress(Exception):
            await asyncio.shield(task)
        return True

    async def show(self, name: str) -> AdapterView:
        catalog = await self._wait_catalog()
        if catalog.profiles.get(name) is not None:
            return await self.show_profile(name)
        adapter = await asyncio.to_thread(self._stored_or_close, catalog, name)
        await asyncio.to_thread(catalog.resolver.warm, [name])
        state = await self.tiers.sync() if self.tiers else None
        return self._described(catalog, adapter, state)

    def _stored_or_close(self, catalog: Catalog, name: str) -> StoredAdapter:
        """``catalog.store.get(name)``; a name neither stored nor a profile is refused with its close
        matches, profiles among them (``Core.not_stored``), not with advice to pull under it."""
        try:
            return catalog.store.get(name)
        except AdapterNotFound:
            raise self.not_stored(name) from None

    async def remove(self, name: str, *, force: bool = False) -> RemovedView:
        catalog = await self._wait_catalog()
        if catalog.profiles.get(name) is not None:
            return await self.remove_profile(name)
        await asyncio.to_thread(self._stored_or_close, catalog, name)  # AdapterNotFound before anything else
        users = self.profiles_using(name)
        if users and not force:
            raise InvalidRequest(f"{name!r} is used by profile{'s' if len(users) > 1 else ''} {', '.join(users)}",
                                 f"Remove {'them' if len(users) > 1 else 'it'} first (loractl rm {users[0]}), "
                                 "or remove the adapter anyway with --force (the profiles then fail until "
                                 "recreated).")
        # New content is hashed and validated off the loop (the checks below then ask its caches).
        await asyncio.to_thread(catalog.resolver.warm, [name])
        serving = self.admission.serving[name] if self.admission is not None else 0
        if serving > 0:
            raise InvalidRequest(f"{name!r} is serving {serving} request(s)",
                                 "Wait for them to finish, then remove it.")
        # A stopped engine (asleep after --keep-alive idle, on the CPU) holds nothing: no wake.
        _, tiers = await self._wait_engine(wake=not self._engine_stopped_asleep())
        if name in tiers.pinned_names() and not force:
            raise InvalidRequest(f"{name!r} is pinned", f"Unpin it first (loractl unpin {name}), "
                                 "or remove it anyway with --force.")
        ref = self._resolve_quietly(catalog, name)
        pulling = catalog.puller.lock(name)
        if pulling.locked():
            # Each would undo the other on disk, and their events could come in the other order
            # (DELETED_FROM_DISK last while the new revision stands: a registry withdraws it).
            raise InvalidRequest(f"{name!r} is being pulled", "Wait for the pull to finish, then remove it.")
        with contextlib.ExitStack() as claim:
            claim.enter_context(tiers.claimed(name))  # no pin of it starts or ends meanwhile (busy: refused now)
            # From here the removal runs to its end even if its caller goes away (a cancelled
            # RPC): cut short, it left the name gone from disk with its pin still recorded (a
            # device pin's gate place held for good), and no DELETED_FROM_DISK (a router's
            # registry kept advertising the adapter).
            return await tiers.to_the_end(self._remove_claimed(catalog, tiers, name, ref, claim.pop_all()))

    async def _remove_claimed(self, catalog: Catalog, tiers: Tiers, name: str, ref: AdapterRef | None,
                              claim: contextlib.ExitStack) -> RemovedView:
        unloaded = False
        # The pull lock was free (checked above): a pull of the name now waits for the rm.
        async with catalog.puller.lock(name):
            with claim:
                # The name goes first, so no new request resolves it; the folder stays while a
                # request that resolved it earlier holds its lease: vLLM reloads an evicted adapter
                # from disk mid-request, and a missing folder kills the engine core (bench/soak.py).
                removed = await asyncio.to_thread(catalog.store.remove, name)
                if ref is not None:
                    # Another name with the same content is the same adapter in the engine: keep it.
                    shared = await asyncio.to_thread(self._other_names_of, catalog, ref.digest)
                    unloaded = await tiers.forget(name, ref, unload=not shared)
                    catalog.resolver.relabel(name, ref.engine_id, shared)
            self.events.publish(Event("DELETED_FROM_DISK", name))
        _log.info("removed %s (%s)", name, removed.path)
        return RemovedView(AdapterView.of(removed), unloaded)

    # -- helpers --------------------------------------------------------------------------
    @staticmethod
    def _resolve_quietly(catalog: Catalog, name: str) -> AdapterRef | None:
        try:
            return catalog.resolver.resolve(name)
        except LoractlError:
            return None

    async def _replaced(self, catalog: Catalog, name: str, previous: StoredAdapter | None) -> None:
        """After a new revision of ``name`` is installed: move its pin over, drop the old
        revision from the engine unless a running request still uses it, delete its folder
        once nothing uses it."""
        from loractld.store.disk import files_digest

        try:
            if previous is not None and previous.manifest.get("files") and self.tiers is not None and \
                    self.engine is not None:
                old_digest = files_digest(previous.manifest["files"])
                old_id = catalog.resolver.id_for(old_digest)
                try:
                    # A pinned name's new revision is pinned in the engine: woken for it (--keep-alive).
                    async with self.engine_hold() if self.tiers.pin_of(name) else contextlib.nullcontext():
                        await self.tiers.repin(name)
                except LoractlError as e:  # the new revision is installed: the pull stands
                    _log.warning("pull %s: the pin was not moved to the new revision: %s", name, e.message)
                    self.events.publish(Event("FAILED", name, message=f"pin not moved: {e.message}",
                                              reason="new revision"))
                if not catalog.store.leases.held(previous.path) and not self.tiers.holds_pin(old_id) and \
                        not await asyncio.to_thread(self._other_names_of, catalog, old_digest):
                    await self.engine.remove_adapter(old_id)
        finally:
            await asyncio.to_thread(catalog.store.collect_garbage)

    @staticmethod
    def _other_names_of(catalog: Catalog, digest: str) -> list[str]:
        """Stored names whose content is ``digest`` (they share one adapter in the engine)."""
        from loractld.store.disk import files_digest

        return [a.name for a in catalog.store.list() if a.manifest.get("files") and
                files_digest(a.manifest["files"]) == digest]
