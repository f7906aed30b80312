"""The request path of :class:`loractld.core.core.Core`: a generation's adapter resolved (pulled
on demand, authorized, leased, preflighted), its prompt prepared against the context, and its run
through the admission gate into the engine — for every door.

A part of ``Core`` (a base class of it), in its own module so the request path reads in one place.

Invariants (on top of :mod:`loractld.core.state`'s):
- Nothing on the request path reads the engine's tier state: a generation resolves its adapter
  from the resolver's in-memory index and only marks the tiers busy (``Tiers.note_activity``);
  the tier follower does the reading, off the path.
- Every generation passes the admission gate (``loractld.serving.admitted``, handed down to the
  engine's serving surface) before the engine sees it, and leaves it when it ends however it
  ends: the engine never holds requests for more distinct adapters than the device slots the
  pins leave free.
- An adapter's content reaches the engine in a request or a load only once the engine's own
  loader accepted it (``store.preflight``: once per content; a set lookup after that).
- An adapter folder a request may still need (vLLM reloads from disk after an eviction) is
  never deleted: a request takes a lease on its folder where it resolves its adapter
  (:meth:`RequestPath.resolve_model`), held until the request ends however it ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import difflib
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from loractl.errors import AdapterNotFound, InvalidRequest
from loractld.worker import hooks
from loractld.core import policy
from loractld.generation import GenerationRequest, Prepared, UnknownModel
from loractld.core import ondemand
from loractld.engine import vllm_requests

if TYPE_CHECKING:
    from loractld.core.state import Catalog
    from loractld.engine.openai_serving import OpenAISurface
    from loractld.engine.sampling import Delta
    from loractld.store.identity import AdapterRef
    from loractld.store.leases import Lease

ROLES = ("system", "user", "assistant")


class RequestPath:
    # -- generation -----------------------------------------------------------------------
    def base_model_names(self) -> set[str]:
        """Every name that means the base model: the served name, --model, its folder and ids."""
        names = {self.served_model_name} if self.served_model_name else set()
        if self.catalog is not None:
            names |= self.catalog.base_model.names | {self.catalog.base_model.model}
        return names

    async def openai_surface(self) -> OpenAISurface:
        """vLLM's OpenAI serving classes over this daemon's engine (built once per engine): the
        HTTP door's generation routes. Their engine requests pass the core's
        :class:`~loractld.serving.admitted.Admission`."""
        engine, _ = await self._wait_engine()
        if self._openai is None or self._openai[0] is not engine or self._openai[1].stale:  # stale: a new engine (a wake)
            from loractld.engine.openai_serving import OpenAISurface

            assert self.admission is not None
            surface = OpenAISurface(engine, engine.settings.openai, self.admission,
                                    [self.served_model_name or self.model_label])
            old, self._openai = self._openai, (engine, surface)
            if old is not None:   # the last engine's: its idle template renderers go (a keep-alive wake)
                await old[1].templates.close()
        return self._openai[1]

    async def sampling_defaults(self) -> dict:
        """The model's own defaults for sampling parameters a request leaves out."""
        engine, _ = await self._wait_engine()
        return engine.generation_defaults()

    async def resolve_model(self, lora: str, caller: policy.Caller | None, allow_folders: bool = False, *,
                            ondemand_request: GenerationRequest | None = None
                            ) -> tuple[AdapterRef | None, str | None, Lease | None]:
        """The adapter ``lora`` names ("" is the base model) as (adapter, store name, lease):
        pulled first when missing and allowed (``--auto-pull``), a folder only for a caller the
        policy lets name one, and accepted by the engine's own loader (the preflight). The lease
        holds the adapter's folder until released: the caller releases it when its request ends."""
        catalog = await self._wait_catalog()
        request = ondemand_request or GenerationRequest(prompt=" ", lora=lora, allow_folders=allow_folders,
                                                        caller=caller)
        lora = await ondemand.adapter_name(self, request)  # a missing Hub reference pulled first, when allowed
        if not lora:
            return None, None, None
        # A folder is read with the daemon's rights and takes an engine slot: a state change.
        folder_use = policy.authorized(caller, self.socket_gid, "generate-folder", lora,
                                       refusal="generate from an adapter folder on this daemon",
                                       hint="Name a stored adapter (loractl ls), or ask its owner to pull the folder.") \
            if os.path.isabs(lora) and allow_folders else contextlib.nullcontext()
        async with folder_use:
            adapter = await self._resolve_adapter(catalog, lora, allow_folders)
        name = lora if not os.path.isabs(lora) else None
        # Taken with no await since the resolve: from here on no rm or pull deletes the folder.
        lease = catalog.store.lease(adapter.path)
        try:
            await hooks.reached_async("resolved")
            # The engine's own loader has the last word, once per content.
            await catalog.preflight.check(adapter.path, adapter.digest, adapter.label, adapter.engine_id)
            await hooks.reached_async("preflighted")
        except BaseException:
            lease.release()
            raise
        return adapter, name, lease

    async def prepare(self, request: GenerationRequest) -> Prepared:
        async with self.engine_hold():   # awake, and not falling asleep while it renders (--keep-alive)
            return await self._prepare(request)

    async def _prepare(self, request: GenerationRequest) -> Prepared:
        """Everything that can refuse a request before the engine sees it: the adapter, the
        messages, the prompt's tokens against the context, the sampling parameters. The prompt is
        rendered and the sampling fields mapped by vLLM's serving classes, as for the HTTP door
        (:mod:`loractld.engine.vllm_requests`): every door's request takes the same path."""
        await self._wait_engine()
        given = [request.prompt != "", request.prompt_token_ids is not None, request.messages is not None]
        if sum(given) != 1:
            raise InvalidRequest("send exactly one of prompt, prompt token ids or messages")
        if request.messages is not None:
            if not request.messages:
                raise InvalidRequest("no messages", "Send at least one message.")
            for m in request.messages:
                if m["role"] not in ROLES:
                    raise InvalidRequest(f"unknown chat role {m['role']!r}", f"Use one of: {', '.join(ROLES)}.")
        surface = await self.openai_surface()
        # A profile's name: its adapter (or the base model), its defaults under the request's own.
        request, extra = await self.apply_profile(request)
        adapter, name, lease = await self.resolve_model(request.lora, request.caller, request.allow_folders,
                                                        ondemand_request=request)
        try:
            planned = await vllm_requests.plan(
                surface, model=surface.served_name, messages=request.messages, prompt=request.prompt or None,
                prompt_token_ids=request.prompt_token_ids, sampling=request.sampling, extra=extra)
        except BaseException:
            if lease is not None:
                lease.release()
            raise
        return Prepared(adapter, name, planned.prompt_ids, planned.sampling, lease, planned)

    async def run(self, prepared: Prepared) -> AsyncIterator[Delta]:
        """Stream a prepared request. Closing or cancelling the iteration aborts it in the engine.
        It enters the engine as an HTTP request's does: through the admitted engine client
        (admission, stop-string abort, broken-adapter check, token counts in one place)."""
        adapter, name = prepared.adapter, prepared.name
        # This run's own lease: the prepared one is shared by every copy of ``prepared``.
        lease = prepared.lease.share() if prepared.lease is not None else None
        try:
            surface = await self.openai_surface()
            planned = prepared.planned
            params = planned.params if prepared.sampling is planned.sampling else \
                vllm_requests.sampling_params(surface, planned, prepared.sampling)
            scope = surface.scope(name or (adapter.label if adapter else ""), adapter, name)
            async with contextlib.aclosing(vllm_requests.deltas(surface, planned, params, scope)) as deltas:
                async for delta in deltas:
                    yield delta
        finally:
            if lease is not None:
                # Both: the prepared lease too, now rather than when the last copy of ``prepared``
                # is dropped (an exception's traceback can hold it for long). A copy that runs
                # later takes its own (``share``), or hears that the adapter went.
                lease.release()
                prepared.lease.release()

    async def _resolve_adapter(self, catalog: Catalog, lora: str, allow_folders: bool) -> AdapterRef:
        """The adapter ``lora`` names; new content is hashed and validated off the event loop."""
        if os.path.isabs(lora) and not allow_folders:
            raise UnknownModel(lora, [])  # a network client never names the daemon's folders
        try:
            return await catalog.resolver.resolve_async(lora)
        except (AdapterNotFound, InvalidRequest) as e:
            if os.path.isabs(lora) or (isinstance(e, InvalidRequest) and allow_folders):
                raise  # a missing folder, or a malformed name typed at the CLI: its own message
            raise UnknownModel(lora, await asyncio.to_thread(self.close_matches, lora)) from e

    def close_matches(self, name: str, *, adapters_only: bool = False, cutoff: float = 0.6) -> list[str]:
        """Names the user may have meant (stored adapters, profiles and the served model's name;
        ``adapters_only``: stored adapters); reads the store, so only on the error path."""
        stored = {a.name for a in self.catalog.store.list()} if self.catalog is not None else set()
        if not adapters_only:
            stored |= {p.name for p in self.catalog.profiles.list()} if self.catalog is not None else set()
            stored |= {self.served_model_name} if self.served_model_name else set()
        known = sorted(stored)
        by_lower = {k.lower(): k for k in known}
        matches = difflib.get_close_matches(name.lower(), list(by_lower), n=3, cutoff=cutoff)
        return [by_lower[m] for m in matches]

    def not_stored(self, name: str) -> AdapterNotFound:
        """The refusal of a name that is neither a stored adapter nor a profile (``show``, ``rm``,
        ``cp``, a merge's source): its close matches, each said to be a profile where it is one;
        advice to pull under the name only when nothing is close (a typo is no new name)."""
        close = [c for c in self.close_matches(name) if c not in self.base_model_names()]
        if close:
            named = [f"{c!r} (a profile)" if self.profile_of(c) is not None else repr(c) for c in close]
            hint = (f"Did you mean {' or '.join(named)}? loractl ls lists the adapters and profiles; "
                    "loractl pull REF --name NAME adds one.")
        else:
            hint = f"Pull it first: loractl pull ORG/REPO --name {name} (loractl ls lists the store)."
        return AdapterNotFound(f"no adapter named {name!r} in the store", hint)
