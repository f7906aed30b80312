"""Adapter identity: what loractl hands vLLM for an adapter, and why it is safe.

vLLM keys prefix-cache blocks by the ``LoRARequest``'s name (0.26) or name and path (0.32),
treats requests with equal names as one adapter, and needs an integer id unique per adapter.
So the name and id loractl gives vLLM are derived from the adapter's *content* (sha256 of its
config and weights):

- the same content gets the same name and id, in every run of the daemon;
- changed content (a new revision under the same user-facing name) gets a new name and id,
  so no KV block computed with the old weights is ever reused for the new ones.

Python's ``hash()`` is salted per process and is never used for this.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import AdapterNotFound, InvalidAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_ID_BITS = 31  # vLLM stores ids in int32 tensors on some paths; keep them positive int32


@dataclass(frozen=True)
class AdapterRef:
    """A resolved adapter: where it is, what it is, and its content-derived engine identity."""

    label: str          # what the user called it
    path: Path
    digest: str         # sha256 over config and weights
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    base_model: str | None
    engine_id: int

    @property
    def engine_name(self) -> str:
        return f"{self.label}@{self.digest[:16]}"


def content_digest(folder: Path) -> str:
    h = hashlib.sha256()
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        h.update(name.encode() + b"\0")
        with open(folder / name, "rb") as f:
            while chunk := f.read(1 << 20):
                h.update(chunk)
    return h.hexdigest()


class AdapterResolver:
    """Turns a local adapter folder into an :class:`AdapterRef`, caching digests by file stat.

    Invariant: two different digests never share an ``engine_id`` within this process; the id
    is the digest's leading bits unless that is taken, so it is stable across restarts too.
    """

    def __init__(self, max_lora_rank: int) -> None:
        self.max_lora_rank = max_lora_rank
        self._digests: dict[tuple, str] = {}
        self._ids: dict[str, int] = {}
        self._taken: dict[int, str] = {}

    def resolve_path(self, raw: str) -> AdapterRef:
        path = Path(raw)
        if not path.is_absolute():
            raise AdapterNotFound(
                f"adapter {raw!r} is not an absolute path",
                "Pass the folder's path, e.g. loractl run --lora ./my-adapter (the CLI makes it absolute).",
            )
        if not path.is_dir():
            raise AdapterNotFound(f"no adapter folder at {path}")
        missing = [n for n in (CONFIG_FILE, WEIGHTS_FILE) if not (path / n).is_file()]
        if missing:
            hint = (
                "Only safetensors weights are loaded; convert adapter_model.bin with safetensors."
                if WEIGHTS_FILE in missing and (path / "adapter_model.bin").exists()
                else None
            )
            raise InvalidAdapter(f"{path} is not a PEFT LoRA adapter: missing {', '.join(missing)}", hint)
        try:
            config = json.loads((path / CONFIG_FILE).read_text())
            if not isinstance(config, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise InvalidAdapter(f"{path / CONFIG_FILE} is not valid JSON: {e}") from e
        peft_type = str(config.get("peft_type", "LORA")).upper()
        if peft_type != "LORA":
            raise InvalidAdapter(f"{path} is a {peft_type} adapter, not LoRA", "Only PEFT LoRA adapters are supported.")
        rank = config.get("r")
        if not isinstance(rank, int) or rank < 1:
            raise InvalidAdapter(f"{path / CONFIG_FILE} has no valid rank 'r' ({rank!r})")
        if rank > self.max_lora_rank:
            raise InvalidAdapter(
                f"adapter rank {rank} is above the daemon's max LoRA rank {self.max_lora_rank}",
                f"Restart the daemon with --max-lora-rank {_next_supported_rank(rank)}.",
            )
        digest = self._digest(path)
        targets = config.get("target_modules") or ()
        return AdapterRef(
            label=path.name if path.parent.name in ("", "/") else f"{path.parent.name}/{path.name}",
            path=path,
            digest=digest,
            rank=rank,
            alpha=float(config.get("lora_alpha", rank)),
            target_modules=tuple(targets) if isinstance(targets, list) else (str(targets),),
            base_model=config.get("base_model_name_or_path"),
            engine_id=self._id_for(digest),
        )

    def _digest(self, path: Path) -> str:
        stats = tuple(
            (s.st_ino, s.st_size, s.st_mtime_ns) for s in ((path / n).stat() for n in (CONFIG_FILE, WEIGHTS_FILE))
        )
        key = (str(path), stats)
        if key not in self._digests:
            self._digests[key] = content_digest(path)
        return self._digests[key]

    def _id_for(self, digest: str) -> int:
        if digest in self._ids:
            return self._ids[digest]
        candidate = int(digest[:8], 16) & ((1 << _ID_BITS) - 1) or 1
        while candidate in self._taken:
            candidate = candidate % ((1 << _ID_BITS) - 1) + 1
        self._ids[digest] = candidate
        self._taken[candidate] = digest
        return candidate


def _next_supported_rank(rank: int) -> int:
    for supported in (8, 16, 32, 64, 128, 256, 320, 512):
        if supported >= rank:
            return supported
    return rank
