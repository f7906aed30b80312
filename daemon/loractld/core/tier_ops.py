"""The engine tiers' operations of :class:`loractld.core.core.Core`: load, evict, pin and unpin
by name, each vetted first (the name resolves and the engine's loader accepts its content), and
how an adapter is described to the user (its tier, pin, use and any failure).

A part of ``Core`` (a base class of it).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from loractl.errors import InvalidRequest, LoractlError
from loractld.serving.admission import DEFAULT_MAX_WAIT_S, POLICIES
from loractld.serving.policies import make_policy
from loractld.serving.residency import ON_DISK
from loractld.store.identity import Checking
from loractld.views import AdapterView, AdmissionView

if TYPE_CHECKING:
    from loractld.core.state import Catalog
    from loractld.serving.residency import EngineState
    from loractld.store.identity import AdapterRef
    from loractld.store.disk import StoredAdapter

_log = logging.getLogger("loractld.core")


class TierOps:
    async def load(self, name: str, to: str = "device") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.load(name, to or "device"))

    async def evict(self, name: str, source: str = "device") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.evict(name, source or "device"))

    async def pin(self, name: str, to: str = "host") -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.pin(name, to or "host"))

    async def unpin(self, name: str) -> AdapterView:
        return await self._tier_op(name, lambda tiers: tiers.unpin(name))

    async def set_admission(self, policy: str, max_wait_s: float | None = None) -> AdmissionView:
        """Change the admission policy while serving (``loractl admission POLICY``), until the
        daemon stops (``--admission`` sets it for good). Requests running or waiting stay; the
        bound in force is kept when none is given."""
        if policy not in POLICIES:
            raise InvalidRequest(f"unknown admission policy {policy!r}", f"Choose one of: {', '.join(POLICIES)}.")
        if max_wait_s is not None and not max_wait_s >= 0:
            raise InvalidRequest(f"--max-wait must be 0 or more seconds, not {max_wait_s}",
                                 "Example: loractl admission batching --max-wait 0.1")
        await self._wait_engine()
        gate = self.gate
        before = gate.policy.name
        bound = max_wait_s if max_wait_s is not None else getattr(gate.policy, "max_wait_s", DEFAULT_MAX_WAIT_S)
        gate.set_policy(make_policy(policy, bound, self.policy_context))
        mode, why = gate.mode()
        _log.info("admission policy %s -> %s (max wait %.3f s): %s, %s", before, policy, bound, mode, why)
        return self._admission_view()

    async def _tier_op(self, name: str, op) -> AdapterView:
        _, tiers = await self._wait_engine()
        async with self.engine_hold():   # the engine stays awake until the operation ends (--keep-alive)
            await self.vet(name)
            await op(tiers)
        catalog = await self._wait_catalog()
        adapter = await asyncio.to_thread(catalog.store.get, name)
        return self._described(catalog, adapter, tiers.last_state)

    async def vet(self, name: str) -> None:
        """Raise unless ``name`` resolves (an unknown name: with close matches) and the engine's
        loader accepts its content (``store.preflight``): before any tier operation, and for
        start-up's pins and preloads, which may name files changed while the daemon was down."""
        catalog = await self._wait_catalog()
        ref = await self._resolve_adapter(catalog, name, allow_folders=True)
        await catalog.preflight.check(ref.path, ref.digest, ref.label, ref.engine_id)

    # -- helpers --------------------------------------------------------------------------
    def _described(self, catalog: Catalog, adapter: StoredAdapter, state: EngineState | None,
                   ref: AdapterRef | LoractlError | Checking | None = None,
                   view: AdapterView | None = None) -> AdapterView:
        """``adapter`` as the user sees it; ``ref`` (its resolution, why it failed, or that a
        listing left it to be checked) and ``view`` (a fresh copy of its manifest's view) when a
        listing has them already."""
        view = view or AdapterView.of(adapter)
        if ref is None:
            try:
                ref = catalog.resolver.resolve(adapter.name)
            except LoractlError as e:
                ref = e
        if isinstance(ref, LoractlError):
            view.state, view.error = "failed", f"{ref.message} ({ref.hint})"
            return view
        if isinstance(ref, Checking):   # not validated yet, so never loaded: on disk
            view.state = "checking"
            return view
        refused = catalog.preflight.refusal(ref.digest, ref.engine_id, ref.label)
        if refused is not None:
            view.state, view.error = "failed", f"{refused.message} ({refused.hint})"
        if state is not None and (residency := state.residency(ref.engine_id)) is not ON_DISK:
            view.tier, view.pinned, view.slot, view.pin = residency.tier, residency.pinned, residency.slot, residency.pin
            view.host_bytes = residency.host_bytes
        if self.tiers is not None:
            usage = self.tiers.usage.get(adapter.name)
            if usage is not None:
                view.requests, view.last_used = usage.requests, usage.last_used
                if usage.state != "ready":
                    view.state, view.error = usage.state, usage.error
        return view
