"""Waiting for a starting engine is said, not silent: `status --wait` (also before the daemon
listens), `run` during start-up, and a one-line error when the wait times out."""

from __future__ import annotations

import json
import os
import subprocess
import time

from conftest import BIN, ENGINE_FLAGS, run_cli
from test_errors import assert_one_error


def test_status_wait_times_out_in_one_line(tmp_path):
    sock = f"/tmp/lct-w-{os.getpid()}.sock"
    result = run_cli("status", "--wait", "--timeout", "1", "--socket", sock)
    assert_one_error(result, 6, "was not ready after 1 s")
    assert "waiting for the engine to start" in result.stderr


def test_status_wait_and_run_wait_for_a_starting_engine(home, reference, tmp_path):
    sub = home / "wait"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").exists() or (sub / "tiny").symlink_to(home / "tiny")
    sock = sub / "w.sock"
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100"}
    # Asked before the daemon even listens, as a script right after `systemctl start` would.
    waiter = subprocess.Popen([str(BIN / "loractl"), "status", "--wait", "--json", "--socket", str(sock)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    with open(sub / "w.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(sub), "--socket", str(sock),
                                   *ENGINE_FLAGS], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = run_cli("run", "-t", "0", "-n", "6", "hi", "--socket", str(sock), timeout=300)
        assert result.returncode == 0, result.stderr
        assert "loractl: waiting for the engine to start" in result.stderr  # the socket comes up long before it
        assert result.stdout == reference.text(reference.greedy(reference.chat_ids("hi"), None, 6)) + "\n"
        out, err = waiter.communicate(timeout=300)
        assert waiter.returncode == 0, err
        assert json.loads(out)["ready"] and "waiting for the engine to start" in err
    finally:
        waiter.kill()
        daemon.terminate()
        daemon.wait(60)
