"""Failures a user can cause: one line of error, one line of hint, a documented exit code."""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest

from conftest import run_cli


def assert_one_error(result, code: int, *needles: str) -> None:
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    # Progress may precede it (pull); the error itself is the last two lines, once.
    lines = [line for line in result.stderr.splitlines() if line.strip()][-2:]
    assert len(lines) == 2, result.stderr
    assert lines[0].startswith("loractl: error: ") and lines[1].startswith("hint: ")
    assert result.stderr.count("loractl: error:") == 1
    for needle in needles:
        assert needle in result.stderr
    assert "Traceback" not in result.stderr


@pytest.fixture
def short_dir():
    """A fresh short folder for sockets (pytest's tmp_path can exceed the 107-byte limit)."""
    path = Path(tempfile.mkdtemp(prefix="lct-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def test_daemon_not_running(short_dir):
    sock = str(short_dir / "none.sock")
    for args in (["status", "--socket", sock], ["run", "--socket", sock, "hello"]):
        result = run_cli(*args)
        assert_one_error(result, 3, "no loractl daemon is listening", "loractld --model demo")


def test_stale_socket_reads_as_daemon_down(short_dir):
    path = str(short_dir / "stale.sock")
    stale = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    stale.bind(path)  # a socket file nobody listens on, as a SIGKILLed daemon leaves behind
    stale.close()
    result = run_cli("status", "--socket", path)
    assert_one_error(result, 3, "no loractl daemon is listening")


def test_daemon_not_running_via_home(tmp_path):
    result = run_cli("status", env={"LORACTL_HOME": str(tmp_path)})
    # The hint names the commonest miss: a daemon running under another home.
    assert_one_error(result, 3, str(tmp_path / "loractld.sock"), "LORACTL_HOME", "--socket")


def test_missing_adapter_folder(daemon):
    result = run_cli("run", "--socket", str(daemon.socket), "--lora", "/nonexistent/adapter", "hi")
    assert_one_error(result, 4, "no adapter folder at /nonexistent/adapter")


def test_folder_that_is_not_an_adapter(daemon, tmp_path):
    (tmp_path / "adapter_model.bin").write_bytes(b"not a pickle we would ever load")
    result = run_cli("run", "--socket", str(daemon.socket), "--lora", str(tmp_path), "hi")
    assert_one_error(result, 5, "not a PEFT LoRA adapter: adapter_config.json is missing")


def test_rank_above_the_daemons_max(daemon, demo, tmp_path):
    from loractld.models.tiny import DemoAdapter, build_adapter

    build_adapter(demo / "model", DemoAdapter("big/v1", rank=32, alpha=32), tmp_path / "big")
    result = run_cli("run", "--socket", str(daemon.socket), "--lora", str(tmp_path / "big"), "hi")
    assert_one_error(result, 5, "rank 32 is above the daemon's max LoRA rank 16", "--max-lora-rank 32")


def test_unknown_adapter_name(daemon):
    result = run_cli("run", "--socket", str(daemon.socket), "--lora", "no-such/v9", "hi")
    assert_one_error(result, 4, "no adapter named 'no-such/v9' in the store", "loractl pull")


def test_prompt_too_long_for_context(daemon):
    result = run_cli("run", "--socket", str(daemon.socket), "--max-tokens", "250", "a long prompt " * 10)
    assert_one_error(result, 2, "exceeds the context of 256 tokens", "--max-tokens")


def test_status_json(daemon):
    result = run_cli("status", "--json", "--socket", str(daemon.socket))
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout)
    assert info["ready"] is True
    assert info["engine"]["device"] == "cpu" and info["engine"]["dtype"] == "float32"
    assert (info["engine"]["max_loras"], info["engine"]["max_cpu_loras"]) == (2, 3)
    assert info["engine"]["vllm_version"] == "0.32.0"
    assert info["engine_start_s"] > 0
