"""Adapter validation: everything checked before an adapter is installed or loaded.

Each check refuses with one :class:`InvalidAdapter` line and a hint, and reads only what it
needs: JSON files and safetensors *headers*. Weights are never unpickled (``.bin`` is refused)
and tensor data is never read here, except to hash files.

Invariant: an adapter that passes ``validate_adapter`` against a base model's shapes has only
LoRA A/B tensors for modules the base model has, with shapes that fit them, a rank within the
daemon's limit, and well-formed, complete safetensors files.
"""

from __future__ import annotations

import json
import math
import re
import struct
from dataclasses import dataclass, field
from pathlib import Path

from loractl.errors import InvalidAdapter

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
MAX_HEADER_BYTES = 100 << 20
DEFAULT_MAX_WEIGHTS_BYTES = 4 << 30

_DTYPE_BYTES = {
    "F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
    "F8_E4M3": 1, "F8_E5M2": 1, "U16": 2, "U32": 4, "U64": 8,
}
# base_model.model.<module path>.lora_A.weight (PEFT), optionally with an adapter name segment.
_LORA_KEY = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+?)\.lora_(?P<ab>[AB])(?:\.[^.]+)?\.weight$")


@dataclass(frozen=True)
class TensorInfo:
    dtype: str
    shape: tuple[int, ...]


@dataclass
class AdapterFacts:
    """What validation learned about an adapter."""

    rank: int
    alpha: float
    target_modules: list[str]
    base_model: str | None
    peft_config: dict = field(repr=False, default_factory=dict)


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
            if header_len > min(MAX_HEADER_BYTES, size - 8):
                raise ValueError(f"header length {header_len} does not fit a {size}-byte file")
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
    """Weight shapes of a local base model, from its safetensors headers (no data read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(model_dir.glob("*.safetensors")):
        shapes.update({name: info.shape for name, info in read_safetensors_header(file).items()})
    return shapes


def model_names_match(adapter_base: str, model_names: set[str]) -> bool:
    """Whether an adapter's ``base_model_name_or_path`` names the running model.

    Compares whole ids and last path components, case-insensitively, so that
    ``meta-llama/Llama-3.1-8B`` matches a local folder ``/models/Llama-3.1-8B``.
    """
    def forms(name: str) -> set[str]:
        name = name.strip().rstrip("/").lower()
        return {name, name.rsplit("/", 1)[-1]} - {""}

    wanted = forms(adapter_base)
    return any(wanted & forms(n) for n in model_names)


def read_config(folder: Path) -> dict:
    path = folder / CONFIG_FILE
    if not path.is_file():
        bin_only = (folder / "adapter_model.bin").exists()
        raise InvalidAdapter(
            f"not a PEFT LoRA adapter: {CONFIG_FILE} is missing in {folder}",
            "Only PEFT adapters are supported: a folder with adapter_config.json and adapter_model.safetensors."
            if not bin_only else "This looks like a PEFT adapter without its config; pull the complete adapter.",
        )
    if path.stat().st_size > MAX_CONFIG_BYTES:
        raise InvalidAdapter(f"{CONFIG_FILE} is larger than {MAX_CONFIG_BYTES} bytes",
                             "That is not an adapter config; check the source.")
    try:
        config = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise InvalidAdapter(f"{CONFIG_FILE} is not valid JSON: {e}", "Fix or re-pull the adapter.") from e
    if not isinstance(config, dict):
        raise InvalidAdapter(f"{CONFIG_FILE} is not a JSON object", "Fix or re-pull the adapter.")
    return config


def validate_adapter(
    folder: Path,
    *,
    max_lora_rank: int,
    base_shapes: dict[str, tuple[int, ...]] | None = None,
    model_names: set[str] | None = None,
    force: bool = False,
    max_weights_bytes: int = DEFAULT_MAX_WEIGHTS_BYTES,
) -> AdapterFacts:
    """Check an adapter folder; return its facts or raise :class:`InvalidAdapter`.

    ``base_shapes`` (weight name -> shape) enables the module and shape checks;
    ``model_names`` enables the base-model check, which ``force`` skips.
    """
    config = read_config(folder)
    peft_type = str(config.get("peft_type", "")).upper()
    if peft_type != "LORA":
        raise InvalidAdapter(f"not a LoRA adapter: peft_type is {config.get('peft_type')!r}",
                             "Only PEFT LoRA adapters (peft_type LORA) are supported.")
    weights = folder / WEIGHTS_FILE
    if not weights.is_file():
        if (folder / "adapter_model.bin").exists():
            raise InvalidAdapter(
                "the adapter's weights are only in pickle format (adapter_model.bin), which loractl never loads",
                "Convert them to safetensors (PEFT's save_pretrained(safe_serialization=True)) and pull again.",
            )
        raise InvalidAdapter(f"{WEIGHTS_FILE} is missing", "Pull the complete adapter.")
    if weights.stat().st_size > max_weights_bytes:
        raise InvalidAdapter(
            f"{WEIGHTS_FILE} is {weights.stat().st_size} bytes, over the cap of {max_weights_bytes}",
            "Raise the daemon's --max-adapter-size if this adapter is really that large.",
        )
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise InvalidAdapter(f"{CONFIG_FILE} has no valid rank 'r' ({rank!r})", "Fix or re-pull the adapter.")
    if rank > max_lora_rank:
        raise InvalidAdapter(f"adapter rank {rank} is above the daemon's max LoRA rank {max_lora_rank}",
                             f"Restart the daemon with --max-lora-rank {next_supported_rank(rank)}.")
    base = config.get("base_model_name_or_path") or None
    if base and model_names and not force and not model_names_match(str(base), model_names):
        raise InvalidAdapter(
            f"the adapter was trained for {base!r}, but the daemon runs {sorted(model_names)[0]!r}",
            "Pull an adapter for this model, or add --force if you know the architectures match.",
        )
    tensors = read_safetensors_header(weights)
    modules = _check_tensors(tensors, rank, base_shapes)
    alpha = config.get("lora_alpha", rank)
    return AdapterFacts(rank=rank, alpha=float(alpha) if isinstance(alpha, (int, float)) else float(rank),
                        target_modules=sorted(modules), base_model=base, peft_config=config)


def _check_tensors(tensors: dict[str, TensorInfo], rank: int, base_shapes: dict | None) -> set[str]:
    if not tensors:
        raise InvalidAdapter(f"{WEIGHTS_FILE} holds no tensors", "Pull the complete adapter.")
    pairs: dict[str, dict[str, tuple[int, ...]]] = {}
    for name, info in tensors.items():
        match = _LORA_KEY.match(name)
        if not match:
            if base_shapes is not None:
                raise InvalidAdapter(
                    f"tensor {name!r} is not a LoRA A/B weight",
                    "Adapters with extra trained modules (modules_to_save, embeddings) are not supported.",
                )
            continue
        if len(info.shape) != 2:
            raise InvalidAdapter(f"tensor {name!r} has shape {list(info.shape)}, expected 2 dimensions",
                                 "The adapter is malformed.")
        pairs.setdefault(match["module"], {})[match["ab"]] = info.shape
    short_names = set()
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise InvalidAdapter(f"module {module!r} has lora_{'A' if 'A' in ab else 'B'} but not its pair",
                                 "The adapter is incomplete: pull it again.")
        (a_rank, a_in), (b_out, b_rank) = ab["A"], ab["B"]
        if a_rank != rank or b_rank != rank:
            raise InvalidAdapter(f"module {module!r} has rank {a_rank}/{b_rank}, but the config says r={rank}",
                                 "The adapter's config does not match its weights.")
        short_names.add(module.rsplit(".", 1)[-1])
        if base_shapes is None:
            continue
        base = base_shapes.get(f"{module}.weight")
        if base is None:
            raise InvalidAdapter(
                f"the base model has no module {module!r} (targeted by the adapter)",
                "This adapter was trained for a different architecture; pull one for this model.",
            )
        if len(base) != 2 or (b_out, a_in) != (base[0], base[1]):
            raise InvalidAdapter(
                f"module {module!r}: the adapter's shape {b_out}x{a_in} does not fit the base model's "
                f"{'x'.join(map(str, base))}",
                "This adapter was trained for a different model size; pull one for this model.",
            )
    return short_names


def next_supported_rank(rank: int) -> int:
    for supported in (8, 16, 32, 64, 128, 256, 320, 512):
        if supported >= rank:
            return supported
    return rank
