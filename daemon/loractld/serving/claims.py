"""Claims: which names have a pin, an unpin or an ``rm`` in progress, and for which engine id.

Owned by :class:`loractld.serving.tiers.Tiers`, the only caller. Invariants:

- one claim per name at a time; a second command on a busy name is refused in one line;
- the pin caps are checked against recorded pins *and* pins in progress, and the claim is
  taken in the same synchronous call: of two pins racing for the last place exactly one wins;
- a claim is ended only through the token its taker got (:class:`Claim`), so a command that
  gave its claim up early (or was refused as busy) can never end a later command's claim.
"""

from __future__ import annotations

from dataclasses import dataclass

from loractl.errors import InvalidRequest
from loractld.serving.pins import PersistentState


@dataclass(eq=False)
class Claim:
    """One command's hold on ``name``: ``to`` "host"/"device" for a pin, "" for an unpin or rm;
    ``engine_id`` the revision a pin in progress is for (None: not a pin)."""
    name: str
    to: str
    engine_id: int | None


class PinClaims:
    def __init__(self, state: PersistentState, *, max_pins: int, max_device_pins: int) -> None:
        self.state = state
        self.max_pins = max_pins
        self.max_device_pins = max_device_pins
        self._held: dict[str, Claim] = {}

    def busy(self, name: str) -> bool:
        return name in self._held

    def take(self, name: str, to: str, current: str, engine_id: int | None = None) -> Claim:
        """Check the caps for ``name`` going from ``current`` ``to`` a tier and claim the name;
        raise :class:`InvalidRequest` (busy, or a cap reached) instead."""
        if name in self._held:
            raise InvalidRequest(f"{name!r} is busy with another command (pin, unpin or rm)",
                                 "Wait for it to finish, then retry.")
        if to and to != current:
            held = set(self.state.pins if to == "host" else self.state.device_pins)
            held |= {n for n, c in self._held.items() if c.to == to}
            held.discard(name)
            if to == "host" and len(held) >= self.max_pins:
                raise InvalidRequest(
                    f"cannot pin {name!r} in host RAM: {len(held)} of at most {self.max_pins} host pins are in use "
                    f"(max_cpu_loras - max_loras: host RAM must keep room for a full step of other adapters)",
                    "Unpin one (loractl unpin NAME), or restart the daemon with a larger --max-cpu-loras.")
            if to == "device" and len(held) >= self.max_device_pins:
                raise InvalidRequest(
                    f"cannot pin {name!r} to the device: {len(held)} of at most {self.max_device_pins} device pins "
                    f"are in use (max_loras - 1: other adapters need a slot)",
                    "Unpin one (loractl unpin NAME), pin it --to host, or restart with a larger --max-loras.")
        claim = self._held[name] = Claim(name, to, engine_id)
        return claim

    def end(self, claim: Claim) -> None:
        """End ``claim`` if it is still its name's. Idempotent: the claim ends where the work
        ends, which may be after its caller left, when a later command may hold the name."""
        if self._held.get(claim.name) is claim:
            del self._held[claim.name]

    def pins_of(self, engine_id: int) -> set[str]:
        """The tiers that pins in progress want for ``engine_id``."""
        return {c.to for c in self._held.values() if c.engine_id == engine_id and c.to}
