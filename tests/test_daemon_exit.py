"""A daemon that died is told from one that starts (issue 45, item 4): its reason is left under
``LORACTL_HOME`` (loractl/daemon_exit.py), ``status --wait`` returns with it within seconds, and
plain ``status`` says it too; with no daemon at all, the wait ends after a short grace, not at
its timeout. Text a user typed or a remote sent is printed as it is, never read as markup."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest

from conftest import BIN, run_cli
from test_errors import assert_one_error, short_dir as short_home  # noqa: F401 - a fixture

from loractl import daemon_exit, paths
from loractl.client import START_GRACE_S, _progress_mark


def test_status_wait_on_a_daemon_given_a_corrupt_gguf_returns_its_error_in_seconds(short_home):
    bad = short_home / "model.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4092))  # the magic, then nothing a reader can parse
    with open(short_home / "d.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "loractld"), "--model", str(bad), "--home", str(short_home)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    began = time.monotonic()
    try:
        result = run_cli("status", "--wait", "--timeout", "600", "--home", str(short_home), timeout=120)
        waited = time.monotonic() - began
        assert daemon.wait(60) == 1
    finally:
        if daemon.poll() is None:
            daemon.kill()
    assert waited < 30, (waited, result.stderr)
    assert_one_error(result, 3, "loractld exited", "s ago: ", f"{bad} is not a readable GGUF file",
                     "hint: Check the file", f"Its log: {short_home / 'd.log'}")
    # Plain status says the same, from the record the daemon left.
    record = daemon_exit.read_exit(paths.layout(short_home))
    assert record is not None and record.pid == daemon.pid and "not a readable GGUF file" in record.message
    result = run_cli("status", "--home", str(short_home))
    assert_one_error(result, 3, "loractld exited", "not a readable GGUF file")
    # Scripts read the same: the record names the socket it served; another socket ignores it.
    other = run_cli("status", "--socket", str(short_home / "other.sock"), env={"LORACTL_HOME": str(short_home)})
    assert_one_error(other, 3, "no loractl daemon is listening at")


def test_status_wait_with_no_daemon_at_all_says_so_after_a_short_grace(short_home):
    began = time.monotonic()
    result = run_cli("status", "--wait", "--timeout", "600", "--home", str(short_home), timeout=120)
    waited = time.monotonic() - began
    assert_one_error(result, 3, "no loractl daemon is listening at", "no loractld is starting there")
    assert START_GRACE_S <= waited < START_GRACE_S + 15, waited


def test_a_live_daemon_holding_the_home_counts_as_starting_and_a_dead_one_does_not(short_home):
    """``starting_pid`` reads the home lock's holder and asks the kernel; it never takes the lock."""
    layout = paths.layout(short_home)
    sock = str(layout.default_socket)
    # A process that is a loractld by its command line (as the console script's is), alive.
    holder = subprocess.Popen(["bash", "-c", "exec -a loractld sleep 30"])
    try:
        (short_home / daemon_exit.LOCK_FILE).write_text(f'{{"pid": {holder.pid}, "socket": "{sock}"}}')
        deadline = time.monotonic() + 10
        while daemon_exit.starting_pid(layout, sock) is None and time.monotonic() < deadline:
            time.sleep(0.05)  # until bash has exec'd
        assert daemon_exit.starting_pid(layout, sock) == holder.pid
        assert daemon_exit.starting_pid(layout, "/elsewhere.sock") is None
    finally:
        holder.kill()
        holder.wait()
    assert daemon_exit.starting_pid(layout, sock) is None
    # A pid reused by something that is not a loractld is not a daemon starting either.
    other = subprocess.Popen(["sleep", "30"])
    try:
        (short_home / daemon_exit.LOCK_FILE).write_text(f'{{"pid": {other.pid}, "socket": "{sock}"}}')
        assert daemon_exit.starting_pid(layout, sock) is None
    finally:
        other.kill()
        other.wait()


def test_the_wait_counts_from_the_last_progress():
    """Steps, tensors and bytes are progress; the engine stage, timed in seconds, moves by the
    clock alone, so only entering it counts (a hung engine start still times out)."""
    def startup(**fields):
        return {"startup": {"stage": "train", "message": "training", "unit": "steps", "done": 1.0, "detail": "",
                            **fields}}

    assert _progress_mark(startup()) != _progress_mark(startup(done=2.0))
    assert _progress_mark(startup()) != _progress_mark(startup(detail="loss 1.2"))
    engine = {"stage": "engine", "message": "starting the engine (vLLM)", "unit": "s"}
    assert _progress_mark(startup(**engine, done=3.0)) == _progress_mark(startup(**engine, done=40.0))
    assert _progress_mark(None) is None and _progress_mark({"startup": {}}) is None


MARKUP_LIKE = ["./nonexistent", "nonexistent", "hf://org/[bold]repo[/bold]", "ftp://host/a/[/subfolder]",
               "[red]x[/]", "org/repo:[/]"]


@pytest.mark.parametrize("ref", MARKUP_LIKE)
def test_an_error_with_markup_like_text_prints_it_as_is(daemon, ref):
    """rich read '[/subfolder]' in a hint as a closing tag and ended in a traceback: every
    message and hint is printed exactly as it reads."""
    result = run_cli("pull", ref, "--name", "x/v1", "--socket", str(daemon.socket))
    assert result.returncode != 0
    assert "Traceback" not in result.stderr and "MarkupError" not in result.stderr, result.stderr
    lines = [ln for ln in result.stderr.splitlines() if ln.strip()]
    assert lines[-2].startswith("loractl: error: ") and lines[-1].startswith("hint: "), result.stderr
    if ref.startswith("./"):
        assert f"no adapter folder at {Path(ref).absolute()}" in result.stderr
    if "[" in ref:
        assert "[" in result.stderr  # the brackets the user typed are shown, not swallowed


def test_a_relative_folder_that_does_not_exist_is_a_missing_folder_not_a_name(daemon, tmp_path):
    result = subprocess.run([str(BIN / "loractl"), "run", "--socket", str(daemon.socket), "--lora", "./missing-folder",
                             "hi"], capture_output=True, text=True, cwd=tmp_path, timeout=60)
    assert_one_error(result, 4, f"no adapter folder at {tmp_path / 'missing-folder'}")
