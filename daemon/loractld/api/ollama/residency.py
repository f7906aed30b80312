"""``keep_alive`` as loractl's tiers, and who may ask for it.

- ``0`` (or ``"0s"``): the adapter leaves the engine (host RAM and its device slot) once the
  answer is complete, before the last line is sent: ``loractl evict NAME --from host``;
- a negative value (``-1``, ``"-1m"``): the adapter is pinned in host RAM before the answer
  (``loractl pin NAME``): kept loaded until unpinned, its device slot still given by use;
- a positive duration, or none: nothing changes; the adapter stays loaded as any adapter in
  use, until the least-recently-used rule needs its place (loractl evicts by need, not by a clock);
- on the base model: ``-1`` and durations hold (it is loaded while the daemon runs); ``0`` is
  refused (it cannot be unloaded without stopping the daemon).

A pin and an eviction change state for every client: they follow the one rule of every door
(``core.policy``: root, the daemon's user, its socket group, or the HTTP API key's holder), are
decided before the request runs (a refusal is a 403 before any token), and audited as
``op=pin`` / ``op=evict``. A request with nothing to generate (no prompt, no messages) loads
the model (``op=load``) or, with ``keep_alive`` 0, unloads it, as Ollama does.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from starlette.requests import Request

from loractld.api.ollama.options import KeepAlive, refusal
from loractld.trust.peers import tcp_peer_uid
from loractld.core import policy

if TYPE_CHECKING:
    from loractld.core import Core

_HINT = ("Leave keep_alive out, or send it with the daemon's API key (--api-key-file), or as root, the daemon's "
         "user or a member of its socket group.")


async def caller_of(request: Request, key_required: bool, peer_uid_key: str) -> policy.Caller:
    """Who sent ``request``, as the core's policy judges callers: the key's holder when the
    door wants a key (the guard checked it), else the loopback peer's uid from the kernel."""
    scope = request.scope
    client, server = scope.get("client"), scope.get("server")
    peer = f"http={client[0]}:{client[1]}" if client else "http=-"
    if key_required:
        return policy.Caller("http", peer=peer, key_holder=True)
    uid = scope.get(peer_uid_key)
    if uid is None and client and server:
        uid = await asyncio.to_thread(tcp_peer_uid, tuple(client), tuple(server))
    return policy.Caller("http", uid=uid, peer=peer)


class KeepAliveEffect:
    """What one request's ``keep_alive`` does to its adapter: :meth:`before` the answer (the
    decision, and a pin), :meth:`after` it (an eviction)."""

    def __init__(self, core: Core, adapter: str | None, keep: KeepAlive, caller: policy.Caller | None) -> None:
        self.core, self.adapter, self.keep, self.caller = core, adapter, keep, caller

    def _authorized(self, operation: str, target: str):
        asked = f" (keep_alive {self.keep.text})" if self.keep.text else ""
        return policy.authorized(self.caller, self.core.socket_gid, operation, target,
                                 refusal=f"{operation} adapters over HTTP{asked}", hint=_HINT)

    async def before(self) -> None:
        action, name = self.keep.action, self.adapter
        if action is None:
            return
        if name is None:
            if action == "evict":
                raise refusal("keep_alive 0: the base model stays loaded while the daemon runs",
                              "Leave keep_alive out for the base model; stop loractld to unload it.",
                              param="keep_alive")
            return
        if not policy.may_change(self.caller, self.core.socket_gid):
            async with self._authorized(action, name):   # refuses, with its audit line
                pass
        if action == "pin":
            async with self._authorized("pin", name):
                await self.core.pin(name, "host")
        elif (await self.core.show(name)).pinned:
            raise refusal(f"keep_alive 0: {name!r} is pinned", f"Unpin it first (loractl unpin {name}), or leave "
                          "keep_alive out.", param="keep_alive")

    async def after(self) -> None:
        if self.keep.action == "evict" and self.adapter is not None:
            async with self._authorized("evict", self.adapter):
                await self.core.evict(self.adapter, "host")

    async def load_only(self) -> str:
        """A request with nothing to generate: load (or unload) the model; Ollama's ``done_reason``."""
        await self.before()
        if self.keep.action == "evict":
            await self.after()
            return "unload"
        if self.adapter is not None and self.keep.action != "pin":
            async with self._authorized("load", self.adapter):
                await self.core.load(self.adapter, "device")
        return "load"
