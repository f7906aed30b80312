"""torchvision, torchaudio and torchcodec: installed beside vLLM, hidden from it when broken.

vLLM's CPU wheel requires all three, unpinned, so ``pip install 'loractl[cpu]'`` takes the
newest ones from the package index: builds made for another torch (a CUDA build of
torchvision beside torch+cpu, a torchaudio of an older release) that fail at import
(``operator torchvision::nms does not exist``). transformers imports torchvision as soon as it
sees it installed, and then cannot even import ``LlamaConfig``: the daemon died at start from a
plain wheel install. loractld serves text models only, so a media package that does not import
is treated as absent. One that imports stays: vLLM 0.26 on CUDA imports
``torchvision.transforms`` in its kernel warm-up for every model, and an engine with torchvision
hidden there failed to start (seen on an H200).

Invariants:
- ``hide_media_packages`` runs first thing in every process loractld starts that may import
  transformers or vLLM: the daemon (``loractld``), the GGUF conversion child, the demo build
  child and the self-check. vLLM's engine process is forked from the daemon and inherits it.
- A package is hidden only if it is installed and its import raises; the failed import's
  modules are dropped first. An absent one is marked absent too (harmless, and no search later).
- Interpreters started afresh below the daemon (vLLM inspects a model class in one,
  ``python -m vllm.model_executor.models.registry``, whose imports reach transformers before
  any plugin runs) hide the same names through ``child_startup/sitecustomize.py``: the daemon
  puts that folder first on ``PYTHONPATH`` and the names in ``LORACTL_HIDDEN_MEDIA``
  (comma-separated; without the variable a child hides all three, as before the probe).
- Absent reads as absent to every check: ``sys.modules[name] = None`` makes
  ``importlib.util.find_spec`` (what transformers' availability checks call) return None and
  ``import name`` raise ModuleNotFoundError, exactly as when the package is not installed.
- A package already imported, or already marked absent, is left alone.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from pathlib import Path

MEDIA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")
CHILD_STARTUP = Path(__file__).resolve().parent / "child_startup"
HIDDEN_ENV = "LORACTL_HIDDEN_MEDIA"


def hide_media_packages(children: bool = False) -> list[str]:
    """Mark the media packages that are absent or do not import absent in this process (and, with
    ``children``, in every Python interpreter it starts from now on); return the names newly
    hidden here."""
    hidden = []
    for name in MEDIA_PACKAGES:
        if name not in sys.modules and not _imports(name):
            sys.modules[name] = None  # type: ignore[assignment]
            hidden.append(name)
    if children:
        entries = [e for e in os.environ.get("PYTHONPATH", "").split(os.pathsep) if e and e != str(CHILD_STARTUP)]
        os.environ["PYTHONPATH"] = os.pathsep.join([str(CHILD_STARTUP), *entries])
        os.environ[HIDDEN_ENV] = ",".join(n for n in MEDIA_PACKAGES if n in sys.modules and sys.modules[n] is None)
    return hidden


def _imports(name: str) -> bool:
    """Whether ``name`` is installed and imports; a failed import leaves none of its modules."""
    if importlib.util.find_spec(name) is None:
        return False
    try:
        importlib.import_module(name)
        return True
    except Exception:  # noqa: BLE001 - any failure (a missing operator is a RuntimeError) means broken
        for module in [m for m in sys.modules if m == name or m.startswith(name + ".")]:
            del sys.modules[module]
        return False
