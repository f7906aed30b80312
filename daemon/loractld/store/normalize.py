"""Normalising what is only spelling, in a pulled adapter's installed copy.

The same LoRA weights are saved under several key spellings. PEFT's ``save_pretrained``
writes ``base_model.model.<module>.lora_A.weight``; saving a raw ``state_dict()`` (common in
notebooks and training scripts) keeps PEFT's in-memory adapter name
(``...lora_A.default.weight``), which vLLM's loader refuses inside a step; export scripts drop
or double the ``base_model.model.`` prefix. A pull rewrites these keys to PEFT's standard
layout before validation, so the adapter is served exactly as PEFT loads it.

Invariants:
- Only tensor *names* change: the safetensors header is rewritten and the data section is
  copied byte for byte, so every weight is bit-identical to the original.
- Nothing that is more than spelling is rewritten: keys of several adapters, or two keys
  that would become one, are refused (``InvalidAdapter``), never merged.
- vLLM 0.32 reads rsLoRA scaling and ``rank_pattern``/``alpha_pattern`` itself (its
  ``PEFTHelper``), so nothing is folded into the weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import struct
from pathlib import Path

from loractl.errors import InvalidAdapter
from loractld.models.weights import read_safetensors_header
from loractld.store.peft import WEIGHTS_FILE

PREFIX = "base_model.model."
# A LoRA weight with an adapter-name segment: <head>.lora_A.<adapter>.weight or
# <head>.lora_embedding_A.<adapter> (PEFT keeps the embedding's factors in a ParameterDict).
_NAMED = (re.compile(r"^(?P<head>.+\.lora_[AB])\.(?P<adapter>[^.]+)\.weight$"),
          re.compile(r"^(?P<head>.+\.lora_embedding_[AB])\.(?P<adapter>[^.]+)$"))


def plan(keys: list[str]) -> tuple[dict[str, str], list[str]]:
    """The renames that bring ``keys`` to the standard layout, and what they do, in words."""
    renames: dict[str, str] = {}
    adapters: set[str] = set()
    added = doubled = 0
    for key in keys:
        new = key
        for pattern in _NAMED:
            match = pattern.match(new)
            if match and match["adapter"] != "weight":
                adapters.add(match["adapter"])
                new = match["head"] + (".weight" if pattern is _NAMED[0] else "")
        stripped = new
        while stripped.startswith(PREFIX):
            stripped = stripped[len(PREFIX):]
        depth = (len(new) - len(stripped)) // len(PREFIX)
        added += depth == 0
        doubled += depth > 1
        new = PREFIX + stripped
        if new != key:
            renames[key] = new
    if len(adapters) > 1:
        raise InvalidAdapter(f"the weights hold several adapters ({', '.join(sorted(adapters))})",
                             "Save one adapter alone (PEFT's save_pretrained(..., selected_adapters=[NAME])).")
    targets = [renames.get(k, k) for k in keys]
    if len(set(targets)) != len(targets):
        raise InvalidAdapter("two tensors of the weights are spellings of the same weight",
                             "The adapter is malformed: save it again with PEFT's save_pretrained.")
    changes = []
    if adapters:
        changes.append(f"removed the adapter name '.{next(iter(adapters))}.' from the tensor keys")
    if added:
        changes.append(f"added the '{PREFIX}' prefix to {added} tensor key(s)")
    if doubled:
        changes.append(f"removed a doubled '{PREFIX}' prefix from {doubled} tensor key(s)")
    return renames, changes


def needs_normalizing(keys: list[str]) -> list[str]:
    """What a pull would rewrite in these keys, besides the prefix vLLM reads either way."""
    _, changes = plan(keys)
    return [c for c in changes if not c.startswith("added")]


def normalize_folder(folder: Path) -> list[str]:
    """Rewrite ``folder``'s weights to the standard key layout in place; return what changed."""
    path = folder / WEIGHTS_FILE
    if not path.is_file():
        return []  # validation names what is missing
    keys = list(read_safetensors_header(path))  # refuses a damaged file before we read it further
    renames, changes = plan(keys)
    if renames:
        _rename_tensors(path, renames)
    return changes


def _rename_tensors(path: Path, renames: dict[str, str]) -> None:
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(length))
        renamed = {renames.get(k, k): v for k, v in header.items()}
        encoded = json.dumps(renamed, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # the data section stays 8-byte aligned
        tmp = path.with_name(f".{path.name}.normalizing")
        with open(tmp, "wb") as out:
            out.write(struct.pack("<Q", len(encoded)))
            out.write(encoded)
            shutil.copyfileobj(f, out, 1 << 20)
    os.replace(tmp, path)
