"""torchvision, torchaudio and torchcodec: installed beside vLLM, never imported by loractld.

vLLM's CPU wheel requires all three, unpinned, so ``pip install 'loractl[cpu]'`` takes the
newest ones from the package index: builds made for another torch (a CUDA build of
torchvision beside torch+cpu, a torchaudio of an older release) that fail at import
(``operator torchvision::nms does not exist``). transformers imports torchvision as soon as it
sees it installed, and then cannot even import ``LlamaConfig``: the daemon died at start from a
plain wheel install. loractld serves text models only, and nothing on that path needs them
(``scripts/setup.sh`` removes them, and every test ran without them), so loractl's processes
treat them as absent.

Invariants:
- ``hide_media_packages`` runs first thing in every process loractld starts that may import
  transformers or vLLM: the daemon (``loractld``), the GGUF conversion child, the demo build
  child and the self-check. vLLM's engine process is forked from the daemon and inherits it.
- Interpreters started afresh below the daemon (vLLM inspects a model class in one,
  ``python -m vllm.model_executor.models.registry``, whose imports reach transformers before
  any plugin runs) get the same through ``child_startup/sitecustomize.py``: the daemon puts
  that folder first on ``PYTHONPATH`` for its children, and the module runs the environment's
  own sitecustomize after it.
- Absent reads as absent to every check: ``sys.modules[name] = None`` makes
  ``importlib.util.find_spec`` (what transformers' availability checks call) return None and
  ``import name`` raise ModuleNotFoundError, exactly as when the package is not installed.
- A package already imported is left alone (someone imported it on purpose before us).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
CHILD_STARTUP = Path(__file__).resolve().parent / "child_startup"


def hide_media_packages(children: bool = False) -> list[str]:
    """Mark the media packages absent in this process (and, with ``children``, in every Python
    interpreter it starts from now on); return the names newly hidden here."""
    hidden = []
    for name in MEDIA_PACKAGES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    if children:
        entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(CHILD_STARTUP)]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(CHILD_STARTUP), *entries])
    return hidden
