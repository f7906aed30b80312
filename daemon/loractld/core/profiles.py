"""Profiles in :class:`loractld.core.core.Core`: create, copy, list, show and remove them, and what
a profile adds to a request on its way to the engine (for every door).

A part of ``Core`` (a base class of it). A profile is a model like an adapter: one name space
for both, the same naming rules. Who may create or copy is decided by the door as for a pull
(gRPC ``@mutating``; HTTP ``policy.authorized``): one rule, audited.

Invariants:
- A profile is written only once everything it names is known: its FROM (the base model, a
  stored adapter or a profile, whose content it takes over), its adapters (stored names; several,
  or a weight other than 1, become one merged adapter by ``Core.merge`` first), its Modelfile
  lines. A refused create changes nothing but a merged adapter it made.
- A profile's name is never an adapter's, and an adapter a profile runs is not removed unless
  forced (:meth:`ProfileOps.profiles_using`, asked by ``remove``).
- On the request path a profile's values are defaults: the request's own sampling values win;
  a request's system message replaces the profile's (as Ollama does); the few-shot messages go
  before the request's; the template is that request's chat template. A profile whose adapter
  name now holds other content than it was made with is refused, never run on the new content.

What of a profile reaches the engine, per door (the same request path: ``apply_profile`` for
gRPC, ``loractl run/chat``, GenerateMany and Dynamo; ``profile_body`` for the HTTP doors, which
Ollama's /api/chat and /api/generate go through):
- a chat (messages: gRPC, /v1/chat/completions, /api/chat, /api/generate) takes all of it: the
  adapter, the parameters, the system prompt, the few-shot turns and the template; /tokenize
  with messages renders the same prompt;
- a raw prompt (gRPC's prompt or token ids, /v1/completions, /api/generate with ``raw``, and the
  Dynamo door, whose frontend sends token ids it rendered itself) takes the adapter and the
  parameters only: its text goes to the model as sent, as vLLM's /v1/completions and Ollama's
  ``raw`` do, so there is no place for a system prompt, turns or a template (Ollama's own
  /v1/completions renders its template; vLLM's, which loractl serves, never does). Dynamo's
  frontend renders with the base model's template, so only a profile without SYSTEM, MESSAGE
  or TEMPLATE lines gets a card there (``api.dynamo.worker``);
- /v1/responses and Anthropic's /v1/messages take the system prompt as ``instructions`` /
  ``system`` and the turns before the input, under their own field names (``max_output_tokens``,
  ``stop_sequences``); a part they have no field for (a template; on /v1/messages a seed, min_p or
  a penalty) is refused by name, never dropped.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import time
from typing import TYPE_CHECKING, Any

from loractl.errors import AdapterNotFound, InvalidRequest
from loractl.names import validate_name
from loractld.core.profile_sources import adapter_taken, sourced
from loractld.events import Event
from loractld.store.modelfile import (PARAMETERS, Modelfile, adapter_weight, checked_template, openai_fields, parse,
                                      refused)
from loractld.store.modelfile import _set_parameter as set_parameter
from loractld.store.blobs import Blobs, blob_hex  # noqa: F401 - blob_hex: the Ollama door's, from here
from loractld.store.peft import CONFIG_FILE  # noqa: F401 - the Ollama door's, from here
from loractld.store.profiles import Profile
from loractld.store.sources import ADAPTER_FILES  # noqa: F401 - the Ollama door's, from here
from loractld.store.validate import DEFAULT_MAX_WEIGHTS_BYTES
from loractld.views import AdapterView, ProfileView, RemovedView

if TYPE_CHECKING:
    from loractld.core.state import Catalog
    from loractld.generation import GenerationRequest

SAMPLING_FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                   "seed": "seed", "max_tokens": "max_tokens", "stop": "stop",
                   "repetition_penalty": "repetition_penalty", "presence_penalty": "presence_penalty",
                   "frequency_penalty": "frequency_penalty"}


def combined(text: str = "", *, base: str | None = None, adapters: list[str] = (), system: str | None = None,
             template: str | None = None, parameters: list[str] = (), messages: list[dict] = (),
             license: list[str] = ()) -> Modelfile:
    """A Modelfile's text with the fields given beside it (``loractl create --from ... --param
    k=v``, Ollama's /api/create): a field overrides its line, parameters and messages add."""
    m = parse(text, require_from=False) if text.strip() else Modelfile()
    if base:
        m.base = base
    m.adapters += [adapter_weight(a) for a in adapters]
    if system is not None:
        m.system = system
    if template is not None:
        m.template = checked_template(template)
    if any(item.partition("=")[0].strip().lower() == "stop" for item in parameters):
        m.parameters.pop("stop", None)   # stops given beside the Modelfile replace its stops
    for item in parameters:
        name, sep, value = item.partition("=")
        if not sep:
            raise InvalidRequest(f"parameter {item!r} is not NAME=VALUE", "Write e.g. --param temperature=0.")
        set_parameter(m.parameters, name.strip().lower(), value, 0)
    for message in messages:
        if message.get("role") not in ("system", "user", "assistant"):
            raise InvalidRequest(f"message role {message.get('role')!r} is not system, user or assistant",
                                 "Give few-shot turns as user and assistant messages.")
        m.messages.append({"role": message["role"], "content": str(message.get("content", ""))})
    m.license += list(license)
    if not m.base:
        raise refused(0, "no FROM line", "Give FROM (or --from): the base model, a stored adapter or a profile.")
    return m


MERGED = "-merged"   # a weighted profile's merged adapter: <profile>-merged


def owned_adapter(profile: Profile) -> str | None:
    """The adapter ``profile`` owns: its merge of weighted ADAPTER lines, ``<name>-merged``."""
    return profile.adapter if profile.adapter == f"{profile.name}{MERGED}" else None


def profile_taken(name: str, *, copy: bool = False) -> InvalidRequest:
    return InvalidRequest(f"{name!r} is taken: a profile has that name" + ("" if copy else ", made otherwise"),
                          f"{'Copy' if copy else 'Create it'} under another name, or replace it with --force "
                          f"(loractl show {name} --modelfile prints it; loractl rm {name} removes it).")


def _stored_or_none(catalog: Catalog, name: str):
    try:
        return catalog.store.get(name)
    except AdapterNotFound:
        return None


def profile_view(profile: Profile) -> AdapterView:
    return AdapterView(
        name=profile.name, kind="profile", base_model=profile.base, pulled_at=profile.created_at,
        profile=ProfileView(
            base=profile.base, adapter=profile.adapter or "", digest=profile.digest,
            adapters=[{"name": n, "weight": w} for n, w in profile.adapters], system=profile.system,
            template=profile.template, parameters={k: json.dumps(v) for k, v in profile.parameters.items()},
            messages=list(profile.messages), license=list(profile.license), modelfile=profile.modelfile_text(),
            created_at=profile.created_at))


class ProfileOps:
    async def blob_store(self) -> Blobs:
        """The store's uploaded blobs (Ollama's /api/blobs), opened once, at the first use (two
        first uploads at once share one: its holds and quota are the only ones): one adapter's
        weights and its config in flight or waiting for their create, twice over."""
        async with self._blobs_opening:
            if self._blobs is None:
                catalog = await self._wait_catalog()
                limit = catalog.resolver.max_bytes or DEFAULT_MAX_WEIGHTS_BYTES
                self._blobs = await asyncio.to_thread(Blobs, catalog.store.root, max_blob_bytes=limit,
                                                      quota_bytes=2 * limit + (1 << 20),
                                                      check_free_space=catalog.store.check_free_space)
            return self._blobs

    # -- reading --------------------------------------------------------------------------
    def profile_of(self, name: str) -> Profile | None:
        """The profile ``name`` names, from memory (the request path asks this for every name)."""
        catalog = self.catalog
        return catalog.profiles.get(name) if catalog is not None and name and "/" not in name[:1] else None

    async def list_profiles(self) -> list[AdapterView]:
        catalog = await self._wait_catalog()
        return [profile_view(p) for p in await asyncio.to_thread(catalog.profiles.list)]

    async def show_profile(self, name: str) -> AdapterView:
        catalog = await self._wait_catalog()
        return profile_view(catalog.profiles.require(name))

    def profiles_using(self, adapter: str) -> list[str]:
        return self.catalog.profiles.users_of(adapter) if self.catalog is not None else []

    # -- writing --------------------------------------------------------------------------
    async def create(self, name: str, modelfile: Modelfile, *, caller=None, force: bool = False,
                     listed_as: str = "") -> AdapterView:
        """Make the profile ``name`` from ``modelfile`` (see the module's invariants), its ADAPTER
        folders and Hub refs pulled first, and removed again if it fails (core/profile_sources.py).
        A profile of that name is replaced by the same Modelfile (an update: its adapters' new
        revisions), by another only with ``force``; an adapter's name is refused."""
        async with sourced(self, name, modelfile, caller) as modelfile:
            return await self._create_profile(name, modelfile, caller=caller, force=force, listed_as=listed_as)

    async def _create_profile(self, name: str, modelfile: Modelfile, *, caller=None, force: bool = False,
                              listed_as: str = "") -> AdapterView:
        catalog = await self._wait_catalog()
        validate_name(name)
        if await asyncio.to_thread(catalog.store.has, name):
            raise adapter_taken(name)
        profile, sources = await self._planned(catalog, name, modelfile)
        existing = catalog.profiles.get(name)
        if existing is not None and not force and existing.modelfile_text() != profile.modelfile_text():
            raise profile_taken(name)
        owned = owned_adapter(existing) if existing is not None else None
        profile.adapter = await self._one_adapter(name, sources, caller, replace=owned is not None)
        if profile.adapter:
            ref = await catalog.resolver.resolve_async(profile.adapter)
            profile.digest = ref.digest
        profile.created_at = time.time()
        # An Ollama name its store name cannot say (org/m:v1), kept by a create from another door.
        profile.listed_as = listed_as or (existing.listed_as if existing is not None else "")
        async with catalog.puller.lock(name):   # a pull or merge of this name checks for a profile under it
            if await asyncio.to_thread(catalog.store.has, name):
                raise adapter_taken(name)
            await asyncio.to_thread(catalog.profiles.put, profile)
        self.events.publish(Event("DOWNLOADED_TO_DISK", name, reason="profile", message=f"profile {name} created"))
        if owned is not None and profile.adapter != owned:
            await self._remove_owned(name, owned)   # the replaced profile's own merge: nothing runs it now
        return profile_view(profile)

    async def _planned(self, catalog: Catalog, name: str, modelfile: Modelfile,
                       stored: bool = True) -> tuple[Profile, list[tuple[str, float]]]:
        """The profile ``modelfile`` makes (but its one adapter) and the adapters it runs, with
        weights; ``stored``: each ADAPTER must be a stored adapter's name."""
        profile = Profile(name=name, base=modelfile.base, adapters=[[n, w] for n, w in modelfile.adapters])
        sources: list[tuple[str, float]] = []
        origin = catalog.profiles.get(modelfile.base)
        if modelfile.base in self.base_model_names():
            pass
        elif origin is not None:
            # FROM a profile: its adapter and defaults, which this Modelfile's lines then override.
            sources = [(origin.adapter, 1.0)] if origin.adapter else []
            profile.system, profile.template = origin.system, origin.template
            profile.parameters, profile.messages = dict(origin.parameters), list(origin.messages)
            profile.license = list(origin.license)
        elif await asyncio.to_thread(catalog.store.has, modelfile.base):
            sources = [(modelfile.base, 1.0)]
        else:
            # Named as the user started it (--model as given: demo), not the folder it resolved to.
            asked = self.model_name.asked if getattr(self, "model_name", None) is not None else ""
            known = [asked] if asked else sorted(self.base_model_names() - {""})
            raise refused(0, f"FROM {modelfile.base!r} names neither the base model nor a stored adapter or profile",
                          f"This daemon serves {known[0] if known else 'its --model'}: FROM that, an adapter or a "
                          "profile (loractl ls lists them); pull an adapter first with loractl pull.")
        for adapter, weight in modelfile.adapters:
            if stored and not await asyncio.to_thread(catalog.store.has, adapter):
                raise InvalidRequest(f"ADAPTER {adapter!r} is not a stored adapter",
                                     f"Pull it first (loractl pull REF --name NAME), then name it in ADAPTER.")
            sources.append((adapter, weight))
        if modelfile.system is not None:
            profile.system = modelfile.system
        if modelfile.template is not None:
            profile.template = modelfile.template
        profile.parameters.update(modelfile.parameters)
        self._check_context(profile.parameters, getattr(modelfile, "parameter_lines", {}))
        profile.messages += modelfile.messages
        profile.license += modelfile.license
        return profile, sources

    async def check_create(self, name: str, modelfile: Modelfile, *, force: bool = False) -> None:
        """Refuse now what :meth:`create` would refuse for ``name`` being taken (a door's 4xx before
        its first status line): an adapter's name, a profile made from another Modelfile. ADAPTER
        names are not asked for: a door may pull them between this and the create."""
        catalog = await self._wait_catalog()
        validate_name(name)
        await asyncio.to_thread(catalog.profiles.check_writable, name)
        if await asyncio.to_thread(catalog.store.has, name):
            raise adapter_taken(name)
        existing = catalog.profiles.get(name)
        if existing is not None and not force:
            profile, _ = await self._planned(catalog, name, modelfile, stored=False)
            if existing.modelfile_text() != profile.modelfile_text():
                raise profile_taken(name)

    def _check_context(self, parameters: dict[str, Any], lines: dict[str, int]) -> None:
        """num_ctx and num_predict that the context in force cannot hold are refused, not clipped
        (as the Ollama door refuses options.num_ctx): the profile would promise what no request gets."""
        engine = getattr(self, "engine", None)
        context = getattr(engine, "max_model_len", None) if engine is not None else None
        if not isinstance(context, int) or context < 1:
            return
        if parameters.get("num_ctx", 0) > context:
            raise refused(lines.get("num_ctx", 0), f"PARAMETER num_ctx {parameters['num_ctx']} is larger than the "
                          f"context in force ({context} tokens); refused, not clipped",
                          f"Give at most PARAMETER num_ctx {context} (or leave it out), or restart loractld with "
                          "a larger --max-model-len.")
        if parameters.get("num_predict", 0) >= context:
            raise refused(lines.get("num_predict", 0), f"PARAMETER num_predict {parameters['num_predict']} leaves no "
                          f"room for a prompt in the context of {context} tokens; refused, not clipped",
                          f"Give fewer than {context} tokens, or -1 for as many as the context leaves.")

    async def _one_adapter(self, name: str, sources: list[tuple[str, float]], caller,
                           replace: bool = False) -> str | None:
        """The one adapter a profile runs: none, the one source, or their merge (``Core.merge``),
        stored as ``<name>-merged``: the profile's own (``owned_adapter``; ``replace``: the
        profile being replaced owns it, so it is made anew)."""
        if not sources:
            return None
        if len(sources) == 1 and sources[0][1] == 1.0:
            return sources[0][0]
        merge = getattr(self, "merge", None)
        if merge is None:
            raise InvalidRequest("several adapters (or a weighted one) need loractl merge, which this daemon lacks",
                                 "Give one ADAPTER line, or upgrade loractl.")
        merged = f"{name}{MERGED}"
        await merge(merged, sources, caller=caller, force=replace)
        return merged

    def owned_adapters(self) -> dict[str, str]:
        """The adapters profiles own (a weighted profile's ``<name>-merged``) -> their profile:
        listed with their profile, not as models of their own, and removed with it."""
        catalog = self.catalog
        if catalog is None:
            return {}
        return {adapter: p.name for p in catalog.profiles.list() if (adapter := owned_adapter(p)) is not None}

    async def _remove_owned(self, profile: str, adapter: str) -> None:
        """Remove ``profile``'s own merged ``adapter`` unless another profile runs it."""
        catalog = await self._wait_catalog()
        if [p for p in self.profiles_using(adapter) if p != profile] or \
                not await asyncio.to_thread(catalog.store.has, adapter):
            return
        await self.remove(adapter, force=True)

    async def copy(self, source: str, destination: str, *, force: bool = False, listed_as: str = "") -> AdapterView:
        """``destination``: a new name for ``source``'s content (a profile, or an adapter). A name
        of the other kind is refused; one of the same kind only replaced with ``force``."""
        catalog = await self._wait_catalog()
        validate_name(source)
        validate_name(destination)
        profile = catalog.profiles.get(source)
        if profile is None and not await asyncio.to_thread(catalog.store.has, source):
            raise await asyncio.to_thread(self.not_stored, source)
        if destination == source:
            raise InvalidRequest(f"{source!r} is copied onto itself", "Copy it to another name.")
        if profile is not None:
            return await self._copy_profile(catalog, profile, destination, force, listed_as)
        if catalog.profiles.get(destination) is not None:
            raise profile_taken(destination, copy=True)
        return await self._copy_adapter(catalog, source, destination, force)

    async def _copy_profile(self, catalog: Catalog, profile: Profile, destination: str, force: bool,
                            listed_as: str = "") -> AdapterView:
        await asyncio.to_thread(catalog.profiles.check_writable, destination)
        if await asyncio.to_thread(catalog.store.has, destination):
            raise adapter_taken(destination)
        existing = catalog.profiles.get(destination)
        if existing is not None and not force:
            raise profile_taken(destination, copy=True)
        copied = Profile(**{**profile.__dict__, "name": destination, "created_at": time.time(), "listed_as": listed_as})
        own, old_own = owned_adapter(profile), owned_adapter(existing) if existing is not None else None
        if own is not None:   # the copy gets its own merged adapter (the same content): each removed alone
            copied.adapter = f"{destination}{MERGED}"
            await self._copy_adapter(catalog, own, copied.adapter, force=old_own == copied.adapter)
        async with catalog.puller.lock(destination):
            if await asyncio.to_thread(catalog.store.has, destination):
                raise adapter_taken(destination)
            await asyncio.to_thread(catalog.profiles.put, copied)
        self.events.publish(Event("DOWNLOADED_TO_DISK", destination, reason="profile",
                                  message=f"profile {destination} copied from {profile.name}"))
        if old_own is not None and old_own != copied.adapter:
            await self._remove_owned(destination, old_own)
        return profile_view(copied)

    async def _copy_adapter(self, catalog: Catalog, source: str, destination: str, force: bool) -> AdapterView:
        from loractld.store.pulls import PullEvent, origin

        async with catalog.puller.lock(destination):
            other = catalog.puller.other_holder(destination)
            if other is not None:
                raise InvalidRequest(f"{destination!r} is taken: {other} has that name", "Copy to another name "
                                     "(adapters and profiles share one name space; loractl ls lists them).")
            current = await asyncio.to_thread(_stored_or_none, catalog, destination)
            if current is not None and not force:
                raise InvalidRequest(f"{destination!r} is taken: it holds {origin(current)}",
                                     f"Copy to another name, or replace it with --force (loractl show {destination} "
                                     "says what it is).")
            stored = await asyncio.to_thread(catalog.store.copy, source, destination, replace=force)
            await self._installed(catalog, PullEvent("done", message=f"copied {destination} from {source}",
                                                     adapter=stored, previous=current))
        return await self.show(stored.name)

    async def remove_profile(self, name: str) -> RemovedView:
        """Remove the profile ``name`` and its own merged adapter (``owned_adapter``), that first:
        an adapter that cannot go now (serving requests) leaves the profile as it was."""
        catalog = await self._wait_catalog()
        own = owned_adapter(catalog.profiles.require(name))
        if own is not None:
            await self._remove_owned(name, own)
        profile = await asyncio.to_thread(catalog.profiles.remove, name)
        self.events.publish(Event("DELETED_FROM_DISK", name, reason="profile"))
        return RemovedView(profile_view(profile), False)

    # -- the request path -----------------------------------------------------------------
    async def profile_target(self, profile: Profile) -> str:
        """The name a profile's requests resolve: its adapter ("" the base model), refused when
        that name now holds other content than the profile was made with."""
        if not profile.adapter:
            return ""
        catalog = await self._wait_catalog()
        try:
            ref = await catalog.resolver.resolve_async(profile.adapter)
        except AdapterNotFound as e:
            raise AdapterNotFound(f"profile {profile.name!r} runs adapter {profile.adapter!r}, which is gone",
                                  f"Pull it again, or recreate the profile (loractl create {profile.name} ...).") from e
        if profile.digest and ref.digest != profile.digest:
            raise InvalidRequest(f"profile {profile.name!r} was made with other content of {profile.adapter!r} "
                                 "than the store now holds", f"Recreate it on the new revision: loractl show "
                                 f"{profile.name} --modelfile > Modelfile; loractl create {profile.name} -f Modelfile")
        return profile.adapter

    @staticmethod
    def profiled_messages(profile: Profile, messages: list[dict] | None) -> list[dict] | None:
        """The request's messages with the profile's system prompt (unless the request has its
        own) and few-shot turns before them."""
        if messages is None:
            return None
        own_system = [m for m in messages[:1] if m.get("role") == "system"]
        rest = messages[len(own_system):]
        system = own_system or ([{"role": "system", "content": profile.system}] if profile.system is not None else [])
        return [*system, *[dict(m) for m in profile.messages], *rest]

    async def apply_profile(self, request: GenerationRequest) -> tuple[GenerationRequest, dict[str, Any]]:
        """``request`` as its profile makes it (see the module's invariants), and the extra
        request fields (the chat template) for vLLM's request; unchanged when ``request.lora``
        is no profile."""
        profile = self.profile_of(request.lora)
        if profile is None:
            return request, {}
        sampling = request.sampling
        given = request.given_sampling
        defaults = {f.name: f.default for f in dataclasses.fields(type(sampling))
                    if f.default is not dataclasses.MISSING}
        changes = {}
        for field_name, value in openai_fields(profile.parameters).items():
            target = SAMPLING_FIELDS[field_name]
            current = getattr(sampling, target)
            unset = target not in given if given is not None else \
                (current == defaults.get(target) if target in defaults else not current)
            if unset:
                changes[target] = list(value) if target == "stop" else value
        extra = {"chat_template": profile.template} if profile.template is not None and \
            request.messages is not None else {}
        lora = await self.profile_target(profile)
        return dataclasses.replace(request, lora=lora, sampling=dataclasses.replace(sampling, **changes),
                                   messages=self.profiled_messages(profile, request.messages)), extra

    def profile_body(self, profile: Profile, route: str, body: dict) -> dict:
        """An HTTP door's request ``body`` for ``route`` as ``profile`` makes it (see the module's
        rule per route): its absent fields from the profile's parameters, under the route's own
        names; its messages with the system prompt and few-shot turns; the profile's template as
        its chat template. A profile's value the route has no field for is refused, never dropped."""
        out = dict(body)
        if route in ("tokenize", "detokenize"):
            fields: dict[str, Any] = {}
        else:
            fields = openai_fields(profile.parameters)
        renames = ROUTE_FIELDS.get(route, {})
        for field_name, value in fields.items():
            target = renames.get(field_name, field_name)
            if target is None:
                ollama_name = next(k for k, (_, f) in PARAMETERS.items() if f == field_name)
                raise _no_field(profile, route, f"PARAMETER {ollama_name}")
            if out.get(target) is None:
                out[target] = list(value) if field_name == "stop" else value
        if route in ("chat", "tokenize") and isinstance(out.get("messages"), list):
            out["messages"] = self.profiled_messages(profile, out["messages"])
            if profile.template is not None and out.get("chat_template") is None:
                out["chat_template"] = profile.template
        elif route in ("responses", "messages"):
            if profile.template is not None:
                raise _no_field(profile, route, "TEMPLATE")
            system = "instructions" if route == "responses" else "system"
            if out.get(system) is None and profile.system is not None:
                out[system] = profile.system
            if profile.messages and not out.get("previous_response_id"):   # a later turn has them already
                turns = out.get("input" if route == "responses" else "messages")
                if route == "responses" and isinstance(turns, str):
                    turns = [{"role": "user", "content": turns}]
                if not isinstance(turns, list) or (route == "messages" and any(
                        m.get("role") == "system" for m in profile.messages)):
                    raise _no_field(profile, route, "MESSAGE")
                out["input" if route == "responses" else "messages"] = [dict(m) for m in profile.messages] + turns
        return out


# A profile's parameter (as an OpenAI chat field) under each route's own name; None: the route
# has no such field (Anthropic's /v1/messages carries no seed, min_p or penalties).
ROUTE_FIELDS: dict[str, dict[str, str | None]] = {
    "responses": {"max_tokens": "max_output_tokens"},
    "messages": {"stop": "stop_sequences", "seed": None, "min_p": None, "repetition_penalty": None,
                 "presence_penalty": None, "frequency_penalty": None},
}
ROUTE_PATHS = {"responses": "/v1/responses", "messages": "/v1/messages"}


def _no_field(profile: Profile, route: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"profile {profile.name!r} has a {what} line, which {ROUTE_PATHS.get(route, route)} "
                          "cannot carry", "Send it to /v1/chat/completions (or Ollama's /api/chat), which takes "
                          "every part of a profile.")
