"""GGUF files as base models: dequantized once into a Hugging Face folder that vLLM serves.

Many local users hold their models as GGUF (Ollama, llama.cpp). vLLM's own GGUF loader does
not take LoRA adapters, so loractld converts the file with transformers (which reads GGUF
through the ``gguf`` package) and serves the result like any Hugging Face folder; adapters are
then validated against the converted weights like against any base.

Invariants:

- A converted folder is keyed by the GGUF file's sha256 (``models/gguf-<sha256[:24]>``): the
  same file is converted once, a changed file is converted again.
- A folder is complete exactly when its ``loractl-gguf.json`` marker exists. Conversion writes
  into a temporary sibling renamed into place, so a crash or a full disk leaves nothing that
  looks converted (leftovers are removed on the next conversion).
- The converted tokenizer adds BOS exactly when the GGUF's ``tokenizer.ggml.add_bos_token``
  says so (transformers' conversion can drop that setting, and a model that needs BOS then
  answers in loops). It is checked after writing; a mismatch refuses the model.
- Disk space for the converted weights is checked before anything is written.
- The conversion runs in a child process (``python -m loractld.models.gguf``): the daemon's own
  memory does not keep the dequantized model, and the child's transformers noise stays out of
  the daemon's log unless it fails.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from loractl.errors import DiskFull, EngineUnavailable

_log = logging.getLogger("loractld.gguf")

MARKER = "loractl-gguf.json"
CONVERTER_VERSION = 2  # bump when the converted output changes
# Dequantized weights above this many parameters are stored as bfloat16: float32 would double
# the disk and RAM for no accuracy a 4-bit source has. Small models stay float32, so HF +
# PEFT references in float32 match vLLM token for token.
FLOAT32_MAX_PARAMETERS = 2_000_000_000
_FLOAT_TYPES = {"F32", "F16", "BF16"}


class ModelRefused(EngineUnavailable):
    """A --model that loractld cannot serve, for a reason the user can act on."""


@dataclass(frozen=True)
class GgufInfo:
    path: Path
    architecture: str
    name: str
    tensor_types: frozenset[str]
    parameters: int
    context_length: int | None
    add_bos: bool | None
    bos_id: int | None
    eos_id: int | None
    tensors: int = 0

    @property
    def dtype(self) -> str:
        return "float32" if self.parameters <= FLOAT32_MAX_PARAMETERS else "bfloat16"

    @property
    def converted_bytes(self) -> int:
        return self.parameters * (4 if self.dtype == "float32" else 2)


def _field(reader, key: str):
    field = reader.fields.get(key)
    if field is None:
        return None
    try:
        return field.contents()
    except Exception:  # a malformed value reads as absent; the conversion reports worse ones
        return None


def inspect(path: Path) -> GgufInfo:
    """Read a GGUF file's header (memory-mapped; no tensor data is read)."""
    try:
        import gguf
    except ImportError as e:
        raise ModelRefused(f"{path.name}: reading GGUF files needs the 'gguf' package",
                           "Install it beside loractld (pip install gguf), or pass a Hugging Face folder.") from e
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise ModelRefused(f"{path} is not a readable GGUF file: {e}",
                           "Check the file (a partial download?) or pass a Hugging Face folder.") from e
    arch = str(_field(reader, "general.architecture") or "")
    ctx = _field(reader, f"{arch}.context_length")
    return GgufInfo(
        path=path,
        architecture=arch,
        name=str(_field(reader, "general.name") or path.stem),
        tensor_types=frozenset(t.tensor_type.name for t in reader.tensors),
        parameters=sum(int(t.n_elements) for t in reader.tensors),
        context_length=int(ctx) if ctx is not None else None,
        add_bos=_field(reader, "tokenizer.ggml.add_bos_token"),
        bos_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        tensors=len(reader.tensors),
    )


def check_convertible(info: GgufInfo) -> None:
    """Refuse, in one line, what transformers cannot dequantize or map to its model classes."""
    import gguf.quants
    from transformers.integrations.ggml import GGUF_CONFIG_MAPPING

    architectures = set(GGUF_CONFIG_MAPPING) - {"general", "tokenizer"}
    if info.architecture not in architectures:
        raise ModelRefused(
            f"{info.path.name}: GGUF architecture {info.architecture or '(none)'!r} cannot be converted",
            f"Convertible architectures: {', '.join(sorted(architectures))}; or pass the model's Hugging Face folder.")
    known = {t.name for t in gguf.quants._type_traits} | _FLOAT_TYPES
    unknown = sorted(info.tensor_types - known)
    if unknown:
        raise ModelRefused(f"{info.path.name}: tensor type(s) {', '.join(unknown)} cannot be dequantized",
                           "Use a GGUF with a common quantization (Q4_K_M, Q8_0, F16), or the Hugging Face folder.")


def sha256_of(path: Path, chunk: int = 8 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            digest.update(block)
    return digest.hexdigest()


_HUB_GGUF = re.compile(r"^(?:hf://)?(?P<repo>[\w.-]+/[\w.-]+)/(?P<file>[^\s]+\.gguf)$", re.IGNORECASE)


def hub_gguf(model: str) -> tuple[str, str] | None:
    """``(repo, file)`` when ``model`` names a GGUF file in a Hub repo (``[hf://]org/repo/file.gguf``)
    rather than a local file; a path that exists, or starts with / . or ~, is local."""
    if model.startswith(("/", ".", "~")) or Path(model).exists():
        return None
    match = _HUB_GGUF.match(model)
    return (match["repo"], match["file"]) if match else None


def download_hub_gguf(repo: str, filename: str) -> Path:
    """The GGUF file from the Hub (huggingface_hub's cache; HF_ENDPOINT and HF_TOKEN honoured)."""
    from huggingface_hub import errors as hf
    from huggingface_hub import hf_hub_download

    _log.info("downloading %s from the Hub repo %s (once; huggingface_hub's cache keeps it)", filename, repo)
    try:
        return Path(hf_hub_download(repo_id=repo, filename=filename))
    except hf.RepositoryNotFoundError as e:
        raise ModelRefused(f"no repo {repo!r} on the Hub, or it is private",
                           "Check the id; for a private repo set HF_TOKEN.") from e
    except hf.EntryNotFoundError as e:
        raise ModelRefused(f"the Hub repo {repo} has no file {filename!r}",
                           "Give the file's path in the repo: --model org/repo/file.gguf.") from e
    except (hf.HfHubHTTPError, OSError) as e:
        raise ModelRefused(f"cannot download {filename} from the Hub repo {repo}: {str(e).splitlines()[0]}",
                           "Check the network, HF_ENDPOINT and HF_TOKEN.") from e


def _memory_cost(path: Path, served_bytes: int) -> str:
    """The one line on what keeping a GGUF quantized would save, said at every start that uses it."""
    return (f"served unquantized: {served_bytes / 1e9:.2f} GB of weights on the device, against "
            f"{path.stat().st_size / 1e9:.2f} GB in the GGUF file (vLLM 0.32 has no GGUF method that keeps it quantized)")


def _folder_bytes(folder: Path) -> int:
    return sum(f.stat().st_size for f in folder.glob("*.safetensors"))


def ensure_converted(path: Path, models_dir: Path, *, name_or_path: str | None = None, report=None) -> Path:
    """The Hugging Face folder for GGUF file ``path``, converting it on first use; ``report``
    (``loractld.startup``'s update) hears the stage and the tensors converted so far."""
    report = report or (lambda *args, **kwargs: None)
    path = path.expanduser().absolute()
    if not path.is_file():
        raise ModelRefused(f"GGUF file {path} does not exist", "Check the path given to --model.")
    started = time.monotonic()
    report("convert", f"checking {path.name} for a converted copy")
    _log.info("hashing %s (%.0f MB) to find its converted copy", path.name, path.stat().st_size / 1e6)
    digest = sha256_of(path)
    target = models_dir / f"gguf-{digest[:24]}"
    if _complete(target):
        _log.info("using %s, converted from %s earlier; %s", target, path.name, _memory_cost(path, _folder_bytes(target)))
        return target
    info = inspect(path)
    check_convertible(info)
    models_dir.mkdir(parents=True, exist_ok=True)
    for leftover in models_dir.glob(".convert-*"):
        shutil.rmtree(leftover, ignore_errors=True)
    need = info.converted_bytes + (64 << 20)  # + tokenizer files and slack
    free = shutil.disk_usage(models_dir).free
    if free < need:
        raise DiskFull(f"converting {path.name} needs {need / 1e9:.1f} GB under {models_dir}, "
                       f"{free / 1e9:.1f} GB are free",
                       "Free space, or put loractl's data elsewhere with LORACTL_HOME.")
    if target.exists():  # converted by an older loractld: convert again
        shutil.rmtree(target)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=models_dir))
    _log.info("converting %s (%s, %.0fM parameters, %s) to a %s Hugging Face folder: a one-time step; %s",
              path.name, info.architecture, info.parameters / 1e6, "/".join(sorted(info.tensor_types)), info.dtype,
              _memory_cost(path, info.converted_bytes))
    cmd = [sys.executable, "-m", "loractld.models.gguf", str(path), str(tmp), "--dtype", info.dtype]
    if name_or_path:
        cmd += ["--name-or-path", name_or_path]
    message = f"converting {path.name} to a Hugging Face folder (once)"
    report("convert", message, total=info.tensors, unit="tensors")
    returncode, output = _run_converter(cmd, lambda done, total: report("convert", message, done=done, total=total,
                                                                        unit="tensors"))
    if returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        last = (output.strip().splitlines() or ["(no output)"])[-1]
        if "No space left" in output:
            raise DiskFull(f"the disk filled up while converting {path.name}",
                           "Free space, or put loractl's data elsewhere with LORACTL_HOME.")
        raise ModelRefused(f"converting {path.name} failed: {last}",
                           "Pass the model's Hugging Face folder instead; the daemon log has the details.")
    try:
        _check_tokenizer(tmp, info)
    except ModelRefused:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    (tmp / MARKER).write_text(json.dumps({
        "source": str(path), "sha256": digest, "architecture": info.architecture, "dtype": info.dtype,
        "tensor_types": sorted(info.tensor_types), "converter_version": CONVERTER_VERSION,
        "converted_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }, indent=2))
    try:
        tmp.rename(target)
    except OSError:  # another daemon converted the same file meanwhile: keep its copy
        shutil.rmtree(tmp, ignore_errors=True)
        if not _complete(target):
            raise
    _log.info("converted %s into %s in %.0f s", path.name, target, time.monotonic() - started)
    return target


def _run_converter(cmd: list[str], on_tensors) -> tuple[int, str]:
    """Run the converter child; its ``tensors: N/M`` lines go to ``on_tensors``, the rest is
    returned (stdout and stderr in one pipe: two pipes could fill one while we read the other)."""
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    kept: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        counted = _TENSORS_LINE.match(line)
        if counted:
            on_tensors(int(counted["done"]), int(counted["total"]))
        else:
            kept.append(line)
    return proc.wait(), "".join(kept)


_TENSORS_LINE = re.compile(r"^tensors: (?P<done>\d+)/(?P<total>\d+)$")


def _count_tensors() -> None:
    """Print ``tensors: N/M`` as transformers dequantizes each GGUF tensor: its loop iterates
    ``tqdm(reader.tensors)``, replaced here (a transformers without that hook just reports none)."""
    from transformers import modeling_gguf_pytorch_utils as loader

    if not hasattr(loader, "tqdm"):
        return

    def counting(iterable, *args, **kwargs):
        items = list(iterable)
        for done, item in enumerate(items, 1):
            yield item
            print(f"tensors: {done}/{len(items)}", flush=True)

    loader.tqdm = counting


def _complete(folder: Path) -> bool:
    try:
        return json.loads((folder / MARKER).read_text()).get("converter_version") == CONVERTER_VERSION
    except (OSError, ValueError):
        return False


def _check_tokenizer(folder: Path, info: GgufInfo) -> None:
    if info.add_bos is None or info.bos_id is None:
        return
    from transformers import AutoTokenizer

    ids = AutoTokenizer.from_pretrained(folder).encode("Hello")
    if (ids[:1] == [info.bos_id]) != bool(info.add_bos):
        raise ModelRefused(f"{info.path.name}: the converted tokenizer does not {'add' if info.add_bos else 'omit'} "
                           "BOS as the GGUF says", "Pass the model's Hugging Face folder instead.")


# ---- the child process ----------------------------------------------------------------

def _convert(src: Path, out: Path, dtype: str, name_or_path: str | None) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    info = inspect(src)
    _count_tensors()
    kwargs = {"gguf_file": src.name}
    tokenizer = AutoTokenizer.from_pretrained(src.parent, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(src.parent, dtype=getattr(torch, dtype), **kwargs)
    # transformers refuses to save a GGUF-loaded model while it still describes itself as
    # quantized; the weights in memory are already plain tensors.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out, safe_serialization=True)
    # What the folder is, for adapters whose base_model_name_or_path names it: transformers
    # does not write _name_or_path itself.
    config_file = out / "config.json"
    config = json.loads(config_file.read_text())
    config["_name_or_path"] = name_or_path or info.name
    config_file.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    if info.eos_id is not None:
        generation = GenerationConfig(bos_token_id=info.bos_id, eos_token_id=info.eos_id)
        generation.save_pretrained(out)
    tokenizer.save_pretrained(out)
    if info.add_bos is not None and info.bos_id is not None:
        _set_add_bos(out, bool(info.add_bos), info.bos_id)


def _set_add_bos(folder: Path, add_bos: bool, bos_id: int) -> None:
    """Make the saved tokenizer add BOS as the GGUF says, in both places tokenizers look."""
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text()) if config_path.is_file() else {}
    config["add_bos_token"] = add_bos
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False))
    tok_path = folder / "tokenizer.json"
    if not tok_path.is_file():
        return
    tok = json.loads(tok_path.read_text())
    bos = next((t["content"] for t in tok.get("added_tokens", []) if t.get("id") == bos_id), None)
    if add_bos and bos is not None:
        # The fast tokenizer's post-processor is what vLLM's tokenizer really runs.
        tok["post_processor"] = {
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [{"SpecialToken": {"id": bos, "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                     {"SpecialToken": {"id": bos, "type_id": 1}}, {"Sequence": {"id": "B", "type_id": 1}}],
            "special_tokens": {bos: {"id": bos, "ids": [bos_id], "tokens": [bos]}},
        }
    elif not add_bos and (tok.get("post_processor") or {}).get("type") == "TemplateProcessing":
        tok["post_processor"] = None
    tok_path.write_text(json.dumps(tok, ensure_ascii=False))


def main(argv: list[str] | None = None) -> None:
    from loractld.worker.media_packages import hide_media_packages

    hide_media_packages()  # this child imports transformers (worker/media_packages.py)
    p = argparse.ArgumentParser(prog="python -m loractld.models.gguf",
                                description="Convert a GGUF file into a Hugging Face folder (loractld's GGUF import).")
    p.add_argument("gguf", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--name-or-path", help="what the folder is (its config's _name_or_path)")
    args = p.parse_args(argv)
    _convert(args.gguf.absolute(), args.out, args.dtype, args.name_or_path)


if __name__ == "__main__":
    main()
