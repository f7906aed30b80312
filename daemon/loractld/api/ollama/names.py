"""Ollama's model names and loractl's: one mapping, both ways.

Ollama names a model ``[namespace/]model[:tag]`` (no tag means ``:latest``); loractl names an
adapter ``name`` or ``name/version`` (lowercase, at most one ``/``). The mapping:

- an adapter ``sql-expert/v1`` is listed as ``sql-expert:v1`` (the one ``/`` becomes the tag's
  ``:``); ``pirate`` (no ``/``) as ``pirate:latest``, unless ``pirate/latest`` is stored too, when
  it is listed bare (``pirate``) so that each listed name means one adapter;
- the base model is listed under its served name (``--served-model-name``, default ``--model``),
  with ``:latest`` when that has no tag;
- a request may name a model as listed, or as loractl spells it (``sql-expert/v1``), or as
  Ollama's Hub integration does (``hf.co/ORG/REPO[:TAG]``: the adapter ``loractl pull ORG/REPO``
  stores, ``org/repo``); case does not matter for adapters (loractl's names are lowercase).

Every name ``/api/tags`` lists resolves back to the model it lists (tests/test_ollama.py).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Container
from dataclasses import dataclass

from loractl.errors import InvalidRequest
from loractl.names import default_name

LATEST = "latest"
_HUB = re.compile(r"^(?:https?://)?(?:hf\.co|huggingface\.co)/([^/:]+/[^/:]+)(?::([^/:]+))?$", re.IGNORECASE)


@dataclass(frozen=True)
class Target:
    """What an Ollama name means: the base model (``adapter`` None) or a stored adapter."""

    adapter: str | None


def listed_name(store_name: str, stored: set[str]) -> str:
    """The name ``/api/tags`` lists a stored adapter under."""
    if "/" in store_name:
        return store_name.replace("/", ":", 1)
    return store_name if f"{store_name}/{LATEST}" in stored else f"{store_name}:{LATEST}"


def base_listed_name(served_name: str) -> str:
    return served_name if ":" in served_name.rsplit("/", 1)[-1] else f"{served_name}:{LATEST}"


def resolve(name: str, base_names: Container[str], is_stored: Callable[[str], bool]) -> Target | None:
    """The model ``name`` means, or None when it means none of them (``is_stored``: whether the
    store holds an adapter of that name)."""
    if not isinstance(name, str):
        return None
    if name in base_names or (name.endswith(f":{LATEST}") and name[:-len(LATEST) - 1] in base_names):
        return Target(None)
    for candidate in candidates(name.strip().lower()):
        if is_stored(candidate):
            return Target(candidate)
    return None


def candidates(name: str) -> list[str]:
    """The store names an Ollama name may mean, the likeliest first."""
    hub = _HUB.match(name)
    if hub:
        stored_as = hub_store_name(hub.group(1))
        return [stored_as] if stored_as else []
    if ":" not in name:
        return [name]
    model, _, tag = name.rpartition(":")
    found = [f"{model}/{tag}"] if "/" not in model else []
    if tag == LATEST:
        found.append(model)
    elif "/" in model:
        found.append(f"{model}-{tag}")   # org/m:v1, created as the profile org/m-v1 (one '/' in a name)
    return found


def hub_reference(name: str) -> tuple[str, str] | None:
    """``hf.co/ORG/REPO[:TAG]`` -> (``ORG/REPO``, revision); the tag ``latest`` is no revision."""
    hub = _HUB.match(name.strip())
    if hub is None:
        return None
    tag = hub.group(2) or ""
    return hub.group(1), "" if tag.lower() == LATEST else tag


def hub_store_name(repo: str) -> str:
    """The name ``loractl pull ORG/REPO`` stores a Hub repository under (``Org/Repo`` -> ``org/repo``);
    "" when it has none."""
    try:
        return default_name(repo)
    except InvalidRequest:
        return ""
