"""How PEFT writes a LoRA adapter down: its two files, its tensor keys, its ranks (``r`` and the
per-module ``rank_pattern``) and the patterns its config holds, read as PEFT and vLLM read them.

The shared vocabulary of the store's checks (``validate``, ``semantics``, ``normalize``), below
all of them so none imports another for it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from loractl.errors import InvalidAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

# base_model.model.<module path>.lora_A.weight (PEFT), optionally with an adapter name segment.
LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")
# An embedding's LoRA: base_model.model.<module>.lora_embedding_A (PEFT), likewise.
EMBEDDING_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_embedding_(?P<ab>[AB])(?:\.[^.]+)?$")


@dataclass(frozen=True)
class Ranks:
    """``r`` with PEFT's per-module ``rank_pattern`` (a key matches a module name's dotted
    suffix, the first match wins: PEFT's ``get_pattern_key``, which vLLM's PEFTHelper follows)."""

    r: int
    pattern: dict

    @classmethod
    def of(cls, config: dict) -> Ranks:
        rank = config.get("r")
        if not positive_int(rank):
            raise InvalidAdapter(f"{CONFIG_FILE} has no valid rank 'r' ({rank!r})", "Fix or re-pull the adapter.")
        pattern = config.get("rank_pattern") or {}
        if not isinstance(pattern, dict) or not all(positive_int(v) for v in pattern.values()):
            raise InvalidAdapter(f"{CONFIG_FILE} has an invalid rank_pattern ({pattern!r})", "Fix or re-pull the adapter.")
        for field_name in ("rank_pattern", "alpha_pattern"):
            for key in (config.get(field_name) or {}) if isinstance(config.get(field_name), dict) else ():
                compiled_pattern(field_name, rf"(.*\.)?({key})$", key)
        return cls(rank, dict(pattern))

    @property
    def largest(self) -> int:
        return max([self.r, *self.pattern.values()])

    def check_limit(self, max_lora_rank: int) -> None:
        if self.largest <= max_lora_rank:
            return
        source = "" if self.largest == self.r else \
            f" (rank_pattern's largest, for {next(k for k, v in self.pattern.items() if v == self.largest)!r}; r is {self.r})"
        raise InvalidAdapter(f"adapter rank {self.largest}{source} is above the daemon's max LoRA rank {max_lora_rank}",
                             f"Restart the daemon with --max-lora-rank {next_supported_rank(self.largest)}.")

    def of_module(self, module: str) -> int:
        for key, rank in self.pattern.items():
            if re.match(rf"(.*\.)?({key})$", module):
                return rank
        return self.r


def compiled_pattern(field_name: str, pattern: str, shown: str | None = None) -> re.Pattern:
    try:
        return re.compile(pattern)
    except (re.error, TypeError) as e:
        raise InvalidAdapter(f"{CONFIG_FILE}: {field_name} holds an invalid pattern ({shown or pattern!r}: {e})",
                             "Fix the adapter's config: PEFT reads these keys as regular expressions.") from e


def positive_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


# What PEFT saves that is not a plain LoRA pair: (pattern on the key, what it is).


def next_supported_rank(rank: int) -> int:
    for supported in (8, 16, 32, 64, 128, 256, 320, 512):
        if supported >= rank:
            return supported
    return rank
