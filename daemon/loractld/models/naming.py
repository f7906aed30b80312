"""The base model's name as users know it, beside the folder vLLM serves.

``--model demo`` is served from a cache folder (``models/gguf-b179c9523d0e6a0f98a330c7``) that
nobody recognises; the user asked for the demo, which is SmolLM2-135M-Instruct. ``status``, the
registry entry, ``/v1/models`` and the metrics' ``model_name`` label name the model by
:attr:`ModelName.name`; the folder stays a detail (``status``'s model folder, a card's ``root``).

The name, first match wins:
- ``--served-model-name``: the user said what it is;
- ``demo`` and ``tiny``: their Hub ids (the tiny one is loractl's own, not on the Hub);
- a GGUF file: the Hub id it came from (a ``hf://org/repo/file.gguf``'s repo, or what the
  converted config names, when that is a Hub id), else the file's name;
- a local folder: its config's ``_name_or_path`` when that is a Hub id, else the folder as given;
- anything else (a Hub id): itself.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class ModelName:
    name: str     # what users know the model by
    asked: str    # --model as given
    path: str     # the folder (or Hub id) vLLM serves


def _config_name(folder: Path) -> str:
    try:
        name = json.loads((folder / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError, AttributeError):
        return ""
    return name if isinstance(name, str) and _HUB_ID.match(name) else ""


def name_model(asked: str, resolved: str, served_name: str | None = None) -> ModelName:
    """How to call the model that ``--model asked`` resolved to (see the module's rules)."""
    if served_name:
        name = served_name
    elif asked == "demo":
        from loractld.models.demo import MODEL_ID

        name = MODEL_ID
    elif asked == "tiny":
        from loractld.models.tiny import DEMO_MODEL_ID

        name = DEMO_MODEL_ID
    elif asked.lower().endswith(".gguf"):
        from loractld.models.gguf import hub_gguf

        on_hub = hub_gguf(asked)
        name = on_hub[0] if on_hub else _config_name(Path(resolved)) or Path(asked).name
    elif Path(asked).expanduser().is_dir():
        name = _config_name(Path(asked).expanduser()) or asked
    else:
        name = asked
    return ModelName(name=name, asked=asked, path=resolved)


def _label_value(value: str) -> str:
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def relabel_model(prometheus_text: str, served_path: str, name: str) -> str:
    """vLLM's series with ``model_name`` saying ``name`` instead of the folder vLLM was given
    (vLLM labels every series with the model it loaded, a cache path for the demo)."""
    if not served_path or served_path == name:
        return prometheus_text
    return prometheus_text.replace(f'model_name="{_label_value(served_path)}"', f'model_name="{_label_value(name)}"')
