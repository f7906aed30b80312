"""``/v1/models`` and vLLM's ``/v1/load_lora_adapter`` / ``/v1/unload_lora_adapter``.

Profiles are listed as models too (``_profile_card``: what runs them and what they are made
of). Model cards carry the fields vLLM's server reports (``root``: the weights' folder, ``parent``:
the base model an adapter belongs to, ``max_model_len``) plus a ``loractl`` object that no
peer reports: the tier as read from the engine, the pin, the last use, the state.

The vLLM routes map onto the core's operations: load = pull (when ``lora_path`` is given)
then load onto the device; unload = evict from host RAM (the engine forgets it; the adapter
stays in the store and in ``/v1/models``, with tier ``disk``). Both answer in vLLM's words, so
scripts written for ``vllm serve`` keep working, and both are audited like the socket's calls.
"""

from __future__ import annotations

import contextlib
import json

from starlette.responses import PlainTextResponse

from loractl.errors import AdapterNotFound, InvalidRequest
from loractld.api.http.errors import from_domain, unknown_model
from loractld.api.http.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest
from loractld.trust.audit import audited
from loractld.core import Core, UnknownModel
from loractld.views import AdapterView

# What a card says of an adapter beyond OpenAI's and vLLM's fields.
_OWN_FIELDS = ("tier", "pinned", "pin", "slot", "last_used", "requests", "state", "error", "rank", "alpha", "size_bytes",
               "host_bytes", "source", "ref", "revision", "base_model")


async def list_models(core: Core) -> dict:
    adapters = await core.list_adapters()
    profiles = await core.list_profiles()
    owned = core.owned_adapters()   # a weighted profile's merge is listed as that profile only
    return {"object": "list", "data": [_base_card(core)] + [_adapter_card(core, a) for a in adapters
                                                             if a.name not in owned]
            + [_profile_card(core, p) for p in profiles]}


async def retrieve_model(core: Core, model: str) -> dict:
    if model in core.base_model_names():
        return _base_card(core)
    if core.profile_of(model) is not None:
        return _profile_card(core, await core.show_profile(model))
    for adapter in await core.list_adapters():
        if adapter.name == model:
            return _adapter_card(core, adapter)
    raise unknown_model(model, core.close_matches(model))


def _max_model_len(core: Core) -> int | None:
    return core.engine.max_model_len if core.engine is not None else None


def _base_card(core: Core) -> dict:
    root = core.catalog.base_model.model if core.catalog is not None else core.served_model_name
    return {"id": core.served_model_name, "object": "model", "created": int(core.started_wall), "owned_by": "loractl",
            "root": root, "parent": None, "max_model_len": _max_model_len(core), "permission": [],
            "loractl": {"kind": "base", "model_name": core.model_label,
                        "model_arg": core.model_name.asked if core.model_name else ""}}


def _adapter_card(core: Core, adapter: AdapterView) -> dict:
    return {"id": adapter.name, "object": "model", "created": int(adapter.pulled_at), "owned_by": "loractl",
            "root": adapter.path, "parent": core.served_model_name, "max_model_len": _max_model_len(core),
            "permission": [], "loractl": {"kind": "adapter", **{name: getattr(adapter, name) for name in _OWN_FIELDS}}}


def _profile_card(core: Core, profile: AdapterView) -> dict:
    """A profile's card: ``parent`` is what it runs (its adapter, or the base model); its
    ``loractl`` object says what it is made of (FROM, the ADAPTER lines, system prompt,
    parameters, the Modelfile)."""
    made_of = profile.profile
    return {"id": profile.name, "object": "model", "created": int(profile.pulled_at), "owned_by": "loractl",
            "root": made_of.adapter or core.served_model_name, "parent": made_of.adapter or core.served_model_name,
            "max_model_len": _max_model_len(core), "permission": [],
            "loractl": {"kind": "profile", "from": made_of.base, "adapter": made_of.adapter or None,
                        "adapters": made_of.adapters, "system": made_of.system,
                        "parameters": {k: json.loads(v) for k, v in made_of.parameters.items()},
                        "messages": made_of.messages, "modelfile": made_of.modelfile}}


async def load_adapter(core: Core, body: LoadLoraAdapterRequest, principal: str) -> PlainTextResponse:
    name = body.lora_name
    with _domain(param="lora_name"):
        if body.lora_path:
            async with audited(principal, "pull", f"{body.lora_path} as {name}"):
                async for _ in core.pull(body.lora_path, name=name):
                    pass
        async with audited(principal, "load", name):
            await core.load(name, "device")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' added successfully.")


async def unload_adapter(core: Core, body: UnloadLoraAdapterRequest, principal: str) -> PlainTextResponse:
    name = body.lora_name
    with _domain(param="lora_name"):
        async with audited(principal, "evict", name):
            await core.evict(name, "host")
    return PlainTextResponse(f"Success: LoRA adapter '{name}' removed successfully.")


@contextlib.contextmanager
def _domain(param: str):
    """Domain errors as HTTP errors that name the parameter at fault."""
    try:
        yield
    except UnknownModel as e:
        raise unknown_model(e.name, e.close_matches) from e
    except (AdapterNotFound, InvalidRequest) as e:
        raise from_domain(e, param=param) from e

