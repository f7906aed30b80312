"""What the daemon knows of its base model, for adapter compatibility checks.

Names: every way an adapter's ``base_model_name_or_path`` may legitimately refer to the
model (the id given to ``--model``, the folder, the config's ``_name_or_path``, ``--served-model-name``,
the tiny model's id). The demo's converted folder names its Hub id in ``_name_or_path``.
Shapes: weight name -> shape, read from the model's safetensors headers when the files are on
this machine (a local folder, or the Hugging Face cache after vLLM downloaded them).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path

from loractld.models import quantized
from loractld.models.moe import ExpertBase, expert_base
from loractld.models.weights import base_model_shapes

_log = logging.getLogger("loractld.basemodel")


@dataclass
class BaseModel:
    model: str                                   # what --model resolved to
    names: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] | None = None
    experts: int = 0                             # routed experts per layer (models.moe); 0: a dense model
    moe: ExpertBase | None = None                # its experts as expert adapters are checked (models.moe)
    device: str = "cpu"                          # where the engine runs: cpu or cuda
    quantization: str = ""                       # as its config declares it (models.quantized); "": float

    def parameters(self) -> int:
        """The parameters as the float model counts them (a packed layer by its float shape)."""
        return quantized.parameter_count(self.shapes or {})


def describe(model_arg: str, resolved: str, served_name: str | None = None, device: str = "cpu") -> BaseModel:
    """What the daemon knows of ``resolved`` (``device``: where the engine runs, ``cpu`` or
    ``cuda``, which decides the expert adapters a mixture-of-experts base takes)."""
    from loractld.models.tiny import DEMO_MODEL_ID

    info = BaseModel(model=resolved, device=device, names={model_arg, resolved} | ({served_name} if served_name else set()))
    if model_arg == "tiny":
        info.names.add(DEMO_MODEL_ID)
    folder = Path(resolved)
    if not folder.is_dir():
        folder = _cached_snapshot(resolved)
    if folder is not None and folder.is_dir():
        config = folder / "config.json"
        if config.is_file():
            try:
                parsed = json.loads(config.read_text())
                name = parsed.get("_name_or_path")
                if name:
                    info.names.add(str(name))
                info.moe = expert_base(parsed, device)
                info.experts = info.moe.experts if info.moe else 0
                info.quantization = quantized.describe(quantized.quantization_config(parsed))
            except ValueError:
                pass
        try:
            info.shapes = base_model_shapes(folder) or None
        except Exception as e:  # an unreadable base model is vLLM's to report; checks just get weaker
            _log.warning("could not read the base model's weight shapes: %s", e)
    if info.quantization:   # an adapter trained on the float model (or QLoRA on it) names that model
        info.names |= {quantized.float_name(n) for n in info.names}
    info.names -= {"demo", "tiny"}
    return info


def refresh_shapes(info: BaseModel) -> None:
    """Read the shapes once the engine has the model on disk, if they were unknown at start.

    A Hub id not yet in the cache has no files when the catalog opens (the engine downloads
    them); without this, shape and module checks stayed off for the daemon's whole life. The
    validator reads ``info.shapes`` at each call, so every later check has them; the engine's
    own loader (``store.preflight``) covers adapters validated before.
    """
    if info.shapes is not None:
        return
    refreshed = describe(info.model, info.model, device=info.device)
    if refreshed.shapes:
        info.shapes = refreshed.shapes
        info.names |= refreshed.names
        info.experts, info.moe = refreshed.experts, refreshed.moe
        _log.info("base model shapes read after the engine's download: %d weights", len(info.shapes))


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:
        return None
