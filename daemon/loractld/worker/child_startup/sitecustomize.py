"""Run at the start of every Python interpreter the daemon starts (its PYTHONPATH names this
folder; ``loractld/worker/media_packages.py``): mark the media packages the daemon found broken
(``LORACTL_HIDDEN_MEDIA``; all three without it) absent before anything imports transformers,
then run the sitecustomize this one shadows, if
the environment has one. Standard library only; it must never fail an interpreter's start."""

import importlib.machinery
import importlib.util
import os
import sys

_hidden = os.environ.get("LORACTL_HIDDEN_MEDIA")
for _name in ("torchvision", "torchaudio", "torchcodec") if _hidden is None else _hidden.split(","):
    if _name:
        sys.modules.setdefault(_name, None)  # type: ignore[arg-type]


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


try:
    _chain()
except Exception:  # noqa: BLE001 - as site.py treats a failing sitecustomize: go on without it
    pass
