"""Waiting for a starting engine is said, not silent: `status --wait` (also before the daemon
listens), `run` during start-up, and a one-line error when the wait times out. What the daemon
is doing shows: a live progress line on a terminal, a line per stage in a pipe."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import pexpect

from conftest import BIN, ENGINE_FLAGS, run_cli
from test_errors import assert_one_error


def test_status_wait_times_out_in_one_line(tmp_path):
    """Nothing listens and nothing starts: past --timeout that is said as such (exit 3), not as
    an engine that was slow (tests/test_daemon_exit.py has the rest)."""
    sock = f"/tmp/lct-w-{os.getpid()}.sock"
    result = run_cli("status", "--wait", "--timeout", "1", "--socket", sock)
    assert_one_error(result, 3, "no loractl daemon is listening at", "no loractld started there within 1 s")
    assert "waiting for the engine to start" in result.stderr


def test_status_wait_and_run_wait_for_a_starting_engine(home, reference, tmp_path):
    sub = home / "wait"
    sub.mkdir(exist_ok=True)
    (sub / "tiny").exists() or (sub / "tiny").symlink_to(home / "tiny")
    sock = sub / "w.sock"
    # The previous start's time, which the engine stage is measured against.
    (sub / "state").mkdir(exist_ok=True)
    (sub / "state" / "engine-starts.json").write_text(json.dumps({str(sub / "tiny" / "model"): 42.0}))
    env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100"}
    # Asked before the daemon even listens, as a script right after `systemctl start` would:
    # once in a pipe, once on a terminal.
    waiter = subprocess.Popen([str(BIN / "loractl"), "status", "--wait", "--json", "--socket", str(sock)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    terminal = pexpect.spawn(str(BIN / "loractl"), ["status", "--wait", "--socket", str(sock)], env=env,
                             dimensions=(24, 100), timeout=300)
    with open(sub / "w.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(sub), "--socket", str(sock),
                                   *ENGINE_FLAGS], stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = run_cli("run", "-t", "0", "-n", "6", "hi", "--socket", str(sock), timeout=300)
        assert result.returncode == 0, result.stderr
        # The socket comes up long before the engine: the stage shows, with the last start's time.
        assert "loractl: starting the engine (vLLM) (about 42 s, as the last start)\n" in result.stderr
        assert result.stdout == reference.text(reference.greedy(reference.chat_ids("hi"), None, 6)) + "\n"
        out, err = waiter.communicate(timeout=300)
        assert waiter.returncode == 0, err
        assert json.loads(out)["ready"]
        # A pipe gets one line per stage (the short ones before the engine may pass unseen).
        lines = err.splitlines()
        assert lines.count("loractl: starting the engine (vLLM) (about 42 s, as the last start)") == 1, err
        assert len(lines) == len(set(lines)), err
        # A terminal gets one line rewritten in place as the seconds pass, ended before the table.
        terminal.expect(r"\r\x1b\[Kloractl: starting the engine \(vLLM\): (\d+) s of about 42 s \(the last start\)")
        first = int(terminal.match.group(1))
        terminal.expect(r"\r\x1b\[Kloractl: starting the engine \(vLLM\): (\d+) s of about 42 s")
        assert int(terminal.match.group(1)) >= first
        terminal.expect(r"\r\n[^\r\n]*state[^\r\n]*ready")
        terminal.expect(pexpect.EOF)
        assert terminal.wait() == 0
        screen = terminal.before.decode()
        assert "\x1b[K" not in screen  # no progress line after the engine is ready
    finally:
        terminal.close(force=True)
        waiter.kill()
        daemon.terminate()
        daemon.wait(60)
    # This start's time is kept for the next start's estimate.
    starts = json.loads((sub / "state" / "engine-starts.json").read_text())
    assert 0 < starts[str(sub / "tiny" / "model")] < 300


def test_start_up_progress_estimates_time_left_from_the_rate_or_the_last_start():
    from loractld.startup import StartupProgress

    now = [100.0]
    progress = StartupProgress(clock=lambda: now[0])
    assert progress.view().stage == ""
    progress.update("train", "training demo adapter pirate/v1", total=30, unit="steps")
    now[0] += 10
    progress.update("train", "training demo adapter pirate/v1", done=10, total=30, unit="steps", detail="loss 2.0")
    view = progress.view()
    assert (view.done, view.total, view.elapsed_s, view.eta_s, view.detail) == (10, 30, 10, 20, "loss 2.0")
    progress.update("engine", "starting the engine (vLLM)", unit="s", expected_s=25)  # a new stage: its own clock
    now[0] += 5
    view = progress.view()
    assert (view.stage, view.done, view.total, view.elapsed_s, view.eta_s) == ("engine", 5, 25, 5, 20)
    progress.finish()
    assert progress.view().stage == ""
