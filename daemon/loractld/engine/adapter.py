"""What the engine is handed for an adapter: :class:`AdapterRef`, its folder and its
content-derived identity.

On the engine floor (tests/test_layout.py) so the engine takes it without knowing the store;
the store's resolver (``loractld.store.identity``) makes every one of them, from content it
validated, and says why the name and id are safe to hand vLLM.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class AdapterRef:
    """A resolved adapter: where it is, what the user called it, and its content-derived engine
    identity (``engine_id`` unique per content in this process; see ``store.identity``)."""

    label: str          # what the user called it: a store name or a folder
    path: Path
    digest: str
    engine_id: int

    @property
    def engine_name(self) -> str:
        return f"{self.label}@{self.digest[:16]}"
