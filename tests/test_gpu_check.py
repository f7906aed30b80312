"""scripts/gpu_check.sh refuses clearly where it cannot check anything, and writes nothing then.

It is meant for a machine with an NVIDIA GPU; here (no GPU) only its refusals run: no
nvidia-smi, an nvidia-smi that lists no GPU, and a listed GPU with an interpreter that does not
import vLLM. No engine starts; each case takes well under a second.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash")
NO_GPU = "gpu_check: error: no NVIDIA GPU found (nvidia-smi -L lists none)"
ONE_GPU = "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-00000000-1111-2222-3333-444444444444)"


def _path_without_nvidia_smi() -> str:
    return os.pathsep.join(d for d in os.environ.get("PATH", "").split(os.pathsep)
                           if d and not os.path.exists(os.path.join(d, "nvidia-smi")))


def _executable(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _fake_nvidia_smi(bin_dir: Path, listing: str, status: int = 0) -> None:
    bin_dir.mkdir(exist_ok=True)
    _executable(bin_dir / "nvidia-smi", f"#!/bin/sh\nprintf '%s\\n' '{listing}'\nexit {status}\n")


def _run(tmp_path: Path, path: str, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("GPU_CHECK_", "LORACTL_"))}
    clean.update(PATH=path, GPU_CHECK_OUT=str(tmp_path / "out"), GPU_CHECK_WORK=str(tmp_path / "work"), **env)
    return subprocess.run([BASH, str(SCRIPT)], env=clean, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path, stdin=subprocess.DEVNULL)


def _refused(result: subprocess.CompletedProcess, tmp_path: Path) -> tuple[str, str]:
    """The error and hint lines of a refusal that wrote nothing."""
    assert result.returncode == 1, result
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("gpu_check: error: ") and lines[1].startswith("hint: "), result.stderr
    assert not (tmp_path / "out").exists() and not (tmp_path / "work").exists()
    return lines[0], lines[1]


def test_the_script_parses():
    done = subprocess.run([BASH, "-n", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


@pytest.mark.skipif(shutil.which("shellcheck") is None, reason="shellcheck is not installed")
def test_shellcheck_is_clean():
    done = subprocess.run(["shellcheck", str(SCRIPT)], capture_output=True, text=True)
    assert done.returncode == 0, done.stdout


def test_without_nvidia_smi_it_refuses_before_anything_else(tmp_path):
    # An interpreter that leaves a mark if it is ever run: the GPU check comes first.
    marker = tmp_path / "python-ran"
    python = _executable(tmp_path / "python", f"#!/bin/sh\ntouch '{marker}'\nexit 1\n")
    error, hint = _refused(_run(tmp_path, _path_without_nvidia_smi(), GPU_CHECK_PYTHON=str(python)), tmp_path)
    assert error == NO_GPU
    assert "nvidia-smi is not on PATH" in hint
    assert not marker.exists()


def test_an_nvidia_smi_that_lists_no_gpu_is_refused(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin", "No devices were found", status=6)
    error, hint = _refused(_run(tmp_path, f"{tmp_path / 'bin'}{os.pathsep}{_path_without_nvidia_smi()}"), tmp_path)
    assert error == NO_GPU
    assert "No devices were found" in hint


@pytest.mark.parametrize("kind", ["isolated", "stub"])
def test_a_python_without_vllm_is_refused_in_one_line(tmp_path, kind):
    _fake_nvidia_smi(tmp_path / "bin", ONE_GPU)
    if kind == "isolated":
        # A real interpreter that cannot see any installed package (-S: no site-packages).
        base = getattr(sys, "_base_executable", None) or sys.executable
        python = _executable(tmp_path / "python", f"#!/bin/sh\nexec '{base}' -I -S \"$@\"\n")
    else:
        python = _executable(tmp_path / "python", "#!/bin/sh\necho 'Traceback (most recent call last):' >&2\n"
                                                   "echo \"ModuleNotFoundError: No module named 'vllm'\" >&2\nexit 1\n")
    result = _run(tmp_path, f"{tmp_path / 'bin'}{os.pathsep}{_path_without_nvidia_smi()}",
                  GPU_CHECK_PYTHON=str(python))
    error, hint = _refused(result, tmp_path)
    assert error.startswith(f"gpu_check: error: {python} does not import vllm and loractld (")
    assert "No module named 'vllm'" in error
    assert "pip install -e '.[gpu,test]'" in hint and "docs/offline-install.md" in hint
    assert "PYTHONPATH" in hint


def test_a_python_that_is_not_there_is_refused(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin", ONE_GPU)
    result = _run(tmp_path, f"{tmp_path / 'bin'}{os.pathsep}{_path_without_nvidia_smi()}",
                  GPU_CHECK_PYTHON=str(tmp_path / "no-such-python"))
    error, hint = _refused(result, tmp_path)
    assert error == f"gpu_check: error: GPU_CHECK_PYTHON={tmp_path / 'no-such-python'} is not an executable file"
    assert "GPU_CHECK_PYTHON" in hint


def test_an_unknown_step_is_refused_before_anything_is_written(tmp_path):
    _fake_nvidia_smi(tmp_path / "bin", ONE_GPU)
    marker = tmp_path / "python-ran"
    python = _executable(tmp_path / "python", f"#!/bin/sh\ntouch '{marker}'\nexit 0\n")
    result = _run(tmp_path, f"{tmp_path / 'bin'}{os.pathsep}{_path_without_nvidia_smi()}",
                  GPU_CHECK_PYTHON=str(python), GPU_CHECK_STEPS="env,selfcheck")
    error, hint = _refused(result, tmp_path)
    assert error == "gpu_check: error: GPU_CHECK_STEPS names an unknown step: selfcheck"
    assert "selfcheck-cuda" in hint and "thrash" in hint
    assert not marker.exists()


def test_the_steps_left_out_are_skipped_and_named(tmp_path):
    # An interpreter that imports everything and prints nothing: only the env step can pass, and
    # every other step must be skipped, not run (a run would fail: it prints no selfcheck line).
    _fake_nvidia_smi(tmp_path / "bin", ONE_GPU)
    python = _executable(tmp_path / "python", "#!/bin/sh\nexit 0\n")
    result = _run(tmp_path, f"{tmp_path / 'bin'}{os.pathsep}{_path_without_nvidia_smi()}",
                  GPU_CHECK_PYTHON=str(python), GPU_CHECK_STEPS="env")
    assert result.returncode == 0, result.stdout + result.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "PASS  env" in summary and "1 passed, 0 failed" in summary
    assert ("skipped (GPU_CHECK_STEPS=env): selfcheck-auto selfcheck-cuda demo serve-vs-server "
            "serve-vs-asyncllm thrash workstation bases") in summary
    assert not list((tmp_path / "out").glob("selfcheck-*.log"))


def test_the_workstation_check_refuses_without_nvidia_smi(tmp_path):
    """bench/workstation_check.py (the workstation step) says so in one line where no GPU is."""

    env = {"PATH": str(tmp_path), "HOME": str(tmp_path)}
    result = subprocess.run([sys.executable, str(REPO / "bench" / "workstation_check.py"), "--workdir", str(tmp_path),
                             "--out", str(tmp_path / "ws.json")], capture_output=True, text=True, env=env, timeout=60)
    assert result.returncode == 1
    assert result.stderr.splitlines()[0] == "workstation_check: error: no nvidia-smi"
    assert not (tmp_path / "ws.json").exists()
