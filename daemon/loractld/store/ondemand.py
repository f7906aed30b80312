"""Adapters on demand (``loractld --auto-pull``): a request that names a Hugging Face Hub
reference the store does not hold pulls it first, then runs on it.

Invariants:
- Off unless the daemon runs with ``--auto-pull`` and the door allows it for its caller
  (``GenerationRequest.allow_pull``): the socket and a Dynamo fleet do, the HTTP API only with an
  API key — a keyless HTTP client never makes the daemon download anything.
- Only Hub references pull (``org/repo``, ``hf://org/repo[@rev][/sub]``); a folder never does,
  and a name the store holds never touches the network, so a Hub outage leaves stored adapters
  served. ``org/repo`` is stored under its default name (``Org/Repo`` -> ``org/repo``), which is
  what later requests find.
- A failed pull is the request's answer: one line naming the reference and the pull's cause.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
from typing import TYPE_CHECKING

from loractl.errors import InvalidRequest, LoractlError
from loractl.names import default_name

if TYPE_CHECKING:
    from loractld.core import Core, GenerationRequest

_log = logging.getLogger("loractld.store.ondemand")
_HUB_REF = re.compile(r"^(hf://)?[A-Za-z0-9][\w.-]*/[\w.-]+(@[\w.-]+)?(/[\w./-]+)?$")


def stored_name_for(ref: str) -> str | None:
    """The store name a plain ``org/repo`` (or ``hf://org/repo``) is pulled under; None for refs
    with a revision or subfolder, whose name only the pull knows."""
    bare = ref.removeprefix("hf://")
    if "@" in bare or bare.count("/") != 1:
        return None
    try:
        return default_name(bare)
    except InvalidRequest:
        return None


async def adapter_name(core: Core, request: GenerationRequest) -> str:
    """The name to resolve for ``request.lora``: itself, or the store name of the Hub reference
    it names, pulled first when allowed (see the module's invariants)."""
    lora = request.lora
    if not (core.auto_pull and request.allow_pull) or not lora or os.path.isabs(lora):
        return lora
    store = core.catalog.store
    if store.has(lora) or not _HUB_REF.match(lora):
        return lora
    known = stored_name_for(lora)
    if known is not None and store.has(known):
        return known
    _log.info("auto-pull: %s is not in the store; pulling it for a request", lora)
    name = None
    try:
        async with contextlib.aclosing(core.pull(lora)) as events:
            async for event in events:
                if event.adapter is not None and event.stage in ("done", "up_to_date"):
                    name = event.adapter.name
    except LoractlError as e:
        raise type(e)(f"{lora!r} is not in the store and pulling it failed: {e.message}", e.hint) from e
    return name or lora
