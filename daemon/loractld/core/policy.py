"""Who may change the daemon's state: decided here, for every door, and audited here.

A door (the socket, HTTP, Dynamo) says *who* is calling — a :class:`Caller`, as the kernel or
the API key identified it — and never decides itself whether that caller may pull, load, use a
folder or make the daemon download: the core's operations take the caller and ask
:func:`authorized`, which applies the one rule (``loractld.trust.peers.may_change_state``: root,
the daemon's user, its socket group; or the holder of the HTTP API key) and writes the audit
line however the operation ends. A new door or a new path to an operation cannot forget the
rule, because the operation carries it.

Invariants:
- An unknown caller (``None``, or no uid and no key) may read and generate from stored
  adapters, and nothing else: a lookup that fails refuses, it never grants.
- Every authorized operation, allowed or refused, writes exactly one audit line.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

from loractl.errors import PermissionDenied
from loractld.trust.audit import audited
from loractld.trust.peers import may_change_state


@dataclass(frozen=True)
class Caller:
    """Who a request came from, as its door knows it."""

    door: str                       # socket | http | dynamo
    uid: int | None = None          # from the kernel (SO_PEERCRED, or the loopback TCP table)
    gid: int | None = None          # the primary group, when the kernel reported it (the socket)
    pid: int | None = None
    peer: str = ""                  # the door's own address of the caller, for the audit line
    key_holder: bool = False        # sent the HTTP API key: granted what the key grants
    fleet: bool = False             # Dynamo's frontend placing a request on this worker

    @property
    def principal(self) -> str:
        parts = [f"uid={self.uid}" if self.uid is not None else "", f"pid={self.pid}" if self.pid is not None else "",
                 self.peer, "key" if self.key_holder else ""]
        return " ".join(p for p in parts if p) or f"{self.door}=-"


def may_change(caller: Caller | None, socket_gid: int | None) -> bool:
    """The rule, for state changes a caller asks for itself."""
    if caller is None:
        return False
    if caller.key_holder:
        return True
    return caller.uid is not None and may_change_state(caller.uid, caller.gid, socket_gid)


@contextlib.asynccontextmanager
async def authorized(caller: Caller | None, socket_gid: int | None, operation: str, target: str, *,
                     refusal: str, hint: str, also: bool = False):
    """Run the body as ``operation`` on ``target`` for ``caller``, audited; refuse with
    :class:`PermissionDenied` (``refusal`` is completed with who was refused) unless the rule
    allows it or ``also`` (a door-specific grant, e.g. a fleet's placement) does."""
    principal = caller.principal if caller is not None else "unknown"
    async with audited(principal, operation, target):
        if not (also or may_change(caller, socket_gid)):
            who = f"uid {caller.uid}" if caller is not None and caller.uid is not None else "this caller"
            raise PermissionDenied(f"{who} may not {refusal}", hint)
        yield
