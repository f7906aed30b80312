"""Safetensors weight files read by their headers: each tensor's name, dtype and shape, the
header checked against the file's size (truncation, garbage, overlapping or out-of-range
tensors) without reading any data.

On the models floor (tests/test_layout.py), below the engine and the store: the base model's
shapes (``models.basemodel``, the engine's CPU defaults in ``models.defaults``) and an adapter's
(``store.validate``) are read by the same code. Refusals are :class:`InvalidAdapter`: a damaged
adapter is by far the usual case, and the store's validation passes them on as they are.
"""

from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import InvalidAdapter
from loractld.models.quantized import float_shapes, quantization_config

# A safetensors header is JSON parsed in one call that holds the GIL: bounded so that parsing one
# cannot stall the event loop (a 25 MB header of 200,000 tensors stalled every client 1.6 s).
# 8 MiB holds some 45,000 tensor entries: an all-linear LoRA of a 128-expert MoE model.
MAX_HEADER_BYTES = 8 << 20
_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


def read_safetensors_header(path: Path) -> dict[str, TensorInfo]:
    """Parse and check a safetensors file's header against the file's size.

    Catches truncation, garbage and overlapping or out-of-range tensors without reading data.
    """
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ValueError("file shorter than the 8-byte header length")
            (header_len,) = struct.unpack("<Q", head)
            if header_len > size - 8:  # the value itself is not shown: it is the file's first 8 bytes
                raise ValueError(f"its header length does not fit a {size}-byte file")
            if header_len > MAX_HEADER_BYTES:
                raise ValueError(f"its header is {header_len} bytes, over the {MAX_HEADER_BYTES >> 20} MiB a "
                                 "LoRA adapter's needs")
            header = json.loads(f.read(header_len))
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{path.name} is not a valid safetensors file: {e}",
                             "The file is corrupt or truncated: pull the adapter again.") from e
    if not isinstance(header, dict):
        raise InvalidAdapter(f"{path.name} is not a valid safetensors file: header is not an object",
                             "The file is corrupt: pull the adapter again.")
    data_len = size - 8 - header_len
    tensors: dict[str, TensorInfo] = {}
    spans = []
    for name, info in header.items():
        if name == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = info["dtype"], tuple(int(d) for d in info["shape"]), info["data_offsets"]
            nbytes = math.prod(shape) * _DTYPE_BYTES[dtype]
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidAdapter(f"{path.name}: tensor {name!r} has a malformed header entry",
                                 "The file is corrupt: pull the adapter again.") from e
        if not (0 <= start <= end <= data_len) or end - start != nbytes:
            raise InvalidAdapter(
                f"{path.name} is truncated or corrupt: tensor {name!r} spans bytes {start}-{end} "
                f"of a {data_len}-byte data section",
                "Pull the adapter again; if it persists, the source file itself is damaged.",
            )
        spans.append((start, end))
        tensors[name] = TensorInfo(dtype, shape)
    spans.sort()
    if any(a_end > b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:])):
        raise InvalidAdapter(f"{path.name} is corrupt: tensors overlap", "Pull the adapter again.")
    return tensors


def base_model_shapes(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """Weight shapes of a local base model, from its safetensors headers (no data read); a
    quantized checkpoint's packed layers also as the float ``X.weight`` adapters fit
    (``models.quantized``)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        shapes.update({name: info.shape for name, info in read_safetensors_header(file).items()})
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return shapes
    return float_shapes(shapes, quantization_config(config) if isinstance(config, dict) else None)
