"""Which media packages the daemon hides (loractld/worker/media_packages.py), with stand-in
packages on a real interpreter's path: a torchvision whose import fails as a torchvision built
for another torch does, and a torchaudio that imports. The broken one must read as absent in the
daemon and in every interpreter it starts; the working one must stay importable in both (vLLM
0.26 on CUDA imports torchvision.transforms at engine start: hiding a working torchvision kept
the engine from starting on an H200)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

PROBE = r"""
import importlib, json, os, subprocess, sys
from loractld.worker.media_packages import hide_media_packages
hidden = hide_media_packages(children=True)
def state(name):
    try:
        importlib.import_module(name)
        return "imports"
    except ModuleNotFoundError:
        return "absent"
child = subprocess.run([sys.executable, "-c",
    "import importlib, json\n"
    "def state(n):\n"
    "    try:\n"
    "        importlib.import_module(n); return 'imports'\n"
    "    except ModuleNotFoundError:\n"
    "        return 'absent'\n"
    "print(json.dumps({n: state(n) for n in ('torchvision', 'torchaudio', 'torchcodec')}))"],
    capture_output=True, text=True, check=True)
print(json.dumps({"hidden": hidden, "env": os.environ["LORACTL_HIDDEN_MEDIA"],
                  "here": {n: state(n) for n in ("torchvision", "torchaudio", "torchcodec")},
                  "leftover": sorted(m for m in sys.modules if m.startswith("torchvision.")),
                  "child": json.loads(child.stdout)}))
"""


def _package(root: Path, name: str, body: str) -> None:
    (root / name).mkdir(parents=True)
    (root / name / "__init__.py").write_text(body)


def _run(tmp_path: Path, env: dict[str, str] | None = None) -> dict:
    fake = tmp_path / "site"
    _package(fake, "torchvision", "from . import ops\n")
    (fake / "torchvision" / "ops.py").write_text(
        "raise RuntimeError('operator torchvision::nms does not exist')\n")
    _package(fake, "torchaudio", "VERSION = 'stand-in'\n")
    base = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORACTL_HIDDEN_MEDIA")}
    base["PYTHONPATH"] = os.pathsep.join([str(fake), str(REPO / "daemon"), str(REPO)])
    base.update(env or {})
    done = subprocess.run([sys.executable, "-c", PROBE], env=base, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_a_broken_package_is_hidden_and_a_working_one_is_kept(tmp_path):
    seen = _run(tmp_path)
    assert seen["hidden"] == ["torchvision", "torchcodec"]
    assert seen["env"] == "torchvision,torchcodec"
    assert seen["here"] == {"torchvision": "absent", "torchaudio": "imports", "torchcodec": "absent"}
    assert seen["leftover"] == []  # the failed import's submodules are gone too
    # A child interpreter (vLLM's model inspection) sees the same: the working package imports.
    assert seen["child"] == {"torchvision": "absent", "torchaudio": "imports", "torchcodec": "absent"}


def test_a_child_without_the_list_hides_all_three(tmp_path):
    # sitecustomize on its own (a child started with the folder on its path but no list).
    fake = tmp_path / "site"
    _package(fake, "torchaudio", "VERSION = 'stand-in'\n")
    startup = REPO / "daemon" / "loractld" / "worker" / "child_startup"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LORACTL_HIDDEN_MEDIA")}
    env["PYTHONPATH"] = os.pathsep.join([str(startup), str(fake)])
    done = subprocess.run([sys.executable, "-c", "import torchaudio"], env=env, capture_output=True, text=True)
    assert done.returncode == 1 and "ModuleNotFoundError" in done.stderr
    env["LORACTL_HIDDEN_MEDIA"] = "torchvision"
    done = subprocess.run([sys.executable, "-c", "import torchaudio; print(torchaudio.VERSION)"], env=env,
                          capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "stand-in", done.stderr
