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

from loractld.store.validate import base_model_shapes

_log = logging.getLogger("loractld.basemodel")


@dataclass
class BaseModel:
    model: str                                   # what --model resolved to
    names: set[str] = field(default_factory=set)
    shapes: dict[str, tuple[int, ...]] | None = None


def describe(model_arg: str, resolved: str, served_name: str | None = None) -> BaseModel:
    from loractld.models.tiny import DEMO_MODEL_ID

    info = BaseModel(model=resolved, names={model_arg, resolved} | ({served_name} if served_name else set()))
    if model_arg == "tiny":
        info.names.add(DEMO_MODEL_ID)
    folder = Path(resolved)
    if not folder.is_dir():
        folder = _cached_snapshot(resolved)
    if folder is not None and folder.is_dir():
        config = folder / "config.json"
        if config.is_file():
            try:
                name = json.loads(config.read_text()).get("_name_or_path")
                if name:
                    info.names.add(str(name))
            except ValueError:
                pass
        try:
            info.shapes = base_model_shapes(folder) or None
        except Exception as e:  # an unreadable base model is vLLM's to report; checks just get weaker
            _log.warning("could not read the base model's weight shapes: %s", e)
    info.names -= {"demo", "tiny"}
    return info


def _cached_snapshot(repo_id: str) -> Path | None:
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(repo_id, local_files_only=True, allow_patterns=["*.json", "*.safetensors"]))
    except Exception:
        return None
