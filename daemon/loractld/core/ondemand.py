"""Adapters on demand (``loractld --auto-pull``): a request that names a Hugging Face Hub
reference the store does not hold pulls it first, then runs on it.

Invariants:
- Off unless the daemon runs with ``--auto-pull``, and then decided for the request's caller by
  the one rule (``core.policy``: whoever may ``loractl pull``, the HTTP key's holder, a Dynamo
  fleet's placement), audited as ``op=auto-pull``. An unidentified caller (keyless HTTP) never
  makes the daemon download anything: its name is simply not found; an identified caller
  the rule refuses gets that refusal.
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
from loractld.core import policy

if TYPE_CHECKING:
    from loractld.core.disk_ops import DiskOps
    from loractld.generation import GenerationRequest

_log = logging.getLogger("loractld.core.ondemand")
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


async def adapter_name(core: DiskOps, request: GenerationRequest) -> str:
    """The name to resolve for ``request.lora``: itself, or the store name of the Hub reference
    it names, pulled first when allowed (see the module's invariants)."""
    lora, caller = request.lora, request.caller
    if not core.auto_pull or not lora or os.path.isabs(lora):
        return lora
    store = core.catalog.store
    if store.has(lora) or not _HUB_REF.match(lora):
        return lora
    known = stored_name_for(lora)
    if known is not None and store.has(known):
        return known
    if caller is None or (caller.uid is None and not caller.key_holder and not caller.fleet):
        return lora  # unidentified: no download, and the name is not found as any other
    _log.info("auto-pull: %s is not in the store; pulling it for a request", lora)
    name = None
    async with policy.authorized(caller, core.socket_gid, "auto-pull", lora, also=caller.fleet,
                                 refusal=f"make the daemon pull {lora!r}: it is not in the store",
                                 hint="Ask the daemon's owner to pull it (loractl pull), or name a stored adapter "
                                      "(loractl ls)."):
        try:
            async with contextlib.aclosing(core.pull(lora)) as events:
                async for event in events:
                    if event.adapter is not None and event.stage in ("done", "up_to_date"):
                        name = event.adapter.name
        except LoractlError as e:
            raise type(e)(f"{lora!r} is not in the store and pulling it failed: {e.message}", e.hint) from e
    return name or lora
