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


def test_the_engine_dies_with_its_daemon_and_a_start_clears_a_recorded_orphan(home):
    sub = home / "orphans"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").exists() or (sub / "tiny").symlink_to(home / "tiny")
    d = start_daemon(sub, name="o")
    children = psutil.Process(d.proc.pid).children(recursive=True)
    # loractld's own template renderers (engine/template_sandbox.py) are not the engine's: not
    # recorded, but they must die with the daemon too.
    renderers = [p for p in children if "loractld.engine.template_child" in " ".join(p.cmdline())]
    engine = [p for p in children if p not in renderers]
    assert engine, "vLLM's engine core runs in a child process"
    record = sub / "state" / "engine.json"
    assert {p["pid"] for p in json.loads(record.read_text())["processes"]} == {p.pid for p in engine}
    os.kill(d.proc.pid, signal.SIGKILL)  # the PID only: its process group lives on
    d.proc.wait(30)
    assert _wait_gone([p.pid for p in engine]) == [], "the engine outlived its daemon"
    assert _wait_gone([p.pid for p in renderers]) == [], "a template renderer outlived its daemon"
    assert record.exists(), "nothing ran to remove the record"

    # An orphan as an older loractld (without the parent-death signal) would leave it, named by
    # the record; and a recorded pid whose start time differs: reused by another process.
    orphan = subprocess.Popen(["bash", "-c", "exec -a VLLM::EngineCore sleep 300"], start_new_session=True)
    bystander = subprocess.Popen(["sleep", "300"], start_new_session=True)
    try:
        time.sleep(0.2)
        record.write_text(json.dumps({"daemon_pid": d.proc.pid, "processes": [
            {"pid": orphan.pid, "create_time": psutil.Process(orphan.pid).create_time(), "name": "VLLM::EngineCore"},
            {"pid": bystander.pid, "create_time": 1.0, "name": "VLLM::EngineCore"},
        ]}))
        d2 = start_daemon(sub, name="o")
        try:
            assert orphan.wait(10) == -signal.SIGKILL
            assert bystander.poll() is None
            assert (f"killed 1 engine process(es) left running by a daemon that died: pid {orphan.pid}"
                    in d2.log.read_text())
        finally:
            assert d2.stop() == 0
        assert not record.exists(), "a clean stop removes the record"
    finally:
        for p in (orphan, bystander):
            if p.poll() is None:
                p.kill()
