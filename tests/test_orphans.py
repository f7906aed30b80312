"""The engine never outlives its daemon: SIGKILL of the daemon's own PID (as `kill -9 PID` or
the OOM killer do, not its process group) takes vLLM's engine core with it, and a start clears
an engine that a dead daemon's record still names."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

import psutil

from conftest import start_daemon


def _wait_gone(pids: list[int], timeout: float = 15) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
        if not alive:
            return []
        time.sleep(0.2)
    return alive


def test_sigkill_of_the_daemon_pid_alone_takes_the_engine_with_it(home):
    sub = home / "orphans"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").exists() or (sub / "tiny").symlink_to(home / "tiny")
    d = start_daemon(sub, name="o")
    engine = psutil.Process(d.proc.pid).children(recursive=True)
    assert engine, "vLLM's engine core runs in a child process"
    recorded = json.loads((sub / "state" / "engine.json").read_text())
    assert {p["pid"] for p in recorded["processes"]} == {p.pid for p in engine}
    os.kill(d.proc.pid, signal.SIGKILL)  # the PID only: its process group lives on
    d.proc.wait(30)
    assert _wait_gone([p.pid for p in engine]) == [], "the engine outlived its daemon"

    # The record is left behind (nothing ran to remove it); the next start reads it, finds
    # nothing of it alive, and starts normally.
    d2 = start_daemon(sub, name="o")
    try:
        assert "left running by a daemon that died" not in d2.log.read_text()
    finally:
        assert d2.stop() == 0
    assert not (sub / "state" / "engine.json").exists(), "a clean stop removes the record"


def test_a_start_kills_an_engine_a_dead_daemon_left_running(home, tmp_path):
    sub = home / "orphans2"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").exists() or (sub / "tiny").symlink_to(home / "tiny")
    # An orphan as an old loractld (without the parent-death signal) would leave it.
    orphan = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        time.sleep(0.2)
        (sub / "state").mkdir(exist_ok=True)
        (sub / "state" / "engine.json").write_text(json.dumps({"daemon_pid": 999999999, "processes": [
            {"pid": orphan.pid, "create_time": psutil.Process(orphan.pid).create_time(), "name": "VLLM::EngineCore"},
            # a recorded pid whose start time does not match: reused by another process, never killed
            {"pid": bystander.pid, "create_time": 1.0, "name": "VLLM::EngineCore"},
        ]}))
        d = start_daemon(sub, name="o2")
        try:
            assert orphan.wait(10) == -signal.SIGKILL
            assert bystander.poll() is None
            assert f"killed 1 engine process(es) left running by a daemon that died: pid {orphan.pid}" in d.log.read_text()
        finally:
            d.stop()
    finally:
        for p in (orphan, bystander):
            if p.poll() is None:
                p.kill()
