"""Requests against rm, new revisions and pins on a real daemon with a real engine, each held
open at its racy point by a test-only pause (tests/hooks_plugin/loractl_test_hooks.py) rather than left to timing;
answers checked against HF + PEFT."""

from __future__ import annotations

import json
from pathlib import Path

import pytest


# -- requests against rm and replacing pulls, on a real daemon -----------------------------------
@pytest.fixture(scope="module")
def paused(hooked):
    """conftest's ``hooked`` daemon: its own home, pause points armable through files under
    ``paused.pauses`` (tests/hooks_plugin/loractl_test_hooks.py)."""
    d = hooked.daemon
    d.pauses = hooked.pauses
    return d


def _wait_for(path: Path, proc, timeout: float = 60) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} not reached"
        time.sleep(0.05)


@pytest.mark.parametrize("change", ["rm --force", "replacing pull"])
def test_a_request_resolved_before_an_rm_or_a_new_revision_gets_its_answer(paused, demo, reference, change):
    """The request resolved its adapter, then (held at the "resolved" pause) its name is removed
    or pulled anew before it runs. Before the fix, the rm's GC deleted the folder the request
    then handed vLLM, and the engine died; now the folder stays leased until the request ends,
    the answer is the old content's, the engine lives, and then the folder goes."""
    import subprocess

    from conftest import BIN, run_cli

    name = "raced/v1"
    sock = str(paused.socket)
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", name, "--socket", sock).returncode == 0
    shown = run_cli("show", name, "--json", "--socket", sock)
    folder = Path(json.loads(shown.stdout)["path"])
    # Out of the engine too: the run must load it from its folder again.
    assert run_cli("evict", name, "--from", "host", "--socket", sock).returncode == 0
    arming = paused.pauses / "resolved"
    arming.touch()
    request = subprocess.Popen([str(BIN / "loractl"), "run", "--lora", name, "-t", "0", "-n", "12", "hi",
                                "--socket", sock], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused.pauses / "resolved.reached", request)
        if change == "rm --force":
            assert run_cli("rm", name, "--force", "--socket", sock).returncode == 0
        else:
            assert run_cli("pull", str(demo / "adapters" / "translator" / "v1"), "--name", name, "--force",
                           "--socket", sock).returncode == 0
        assert folder.is_dir()                               # leased: kept
    finally:
        arming.unlink(missing_ok=True)
        (paused.pauses / "resolved.reached").unlink(missing_ok=True)
    out, err = request.communicate(timeout=120)
    assert request.returncode == 0, (err, paused.log_tail())
    expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "poet" / "v1", 12)
    assert out == reference.text(expected) + "\n"
    status = run_cli("status", "--json", "--socket", sock)
    assert status.returncode == 0 and json.loads(status.stdout)["ready"], paused.log_tail()
    assert not folder.exists()                               # unleased, unnamed: collected
    if change == "replacing pull":
        again = run_cli("run", "--lora", name, "-t", "0", "-n", "12", "hi", "--socket", sock)
        expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / "translator" / "v1", 12)
        assert again.stdout == reference.text(expected) + "\n"
        assert run_cli("rm", name, "--socket", sock).returncode == 0


def test_rm_of_one_name_keeps_the_adapter_another_name_has(paused, demo, reference):
    """Two names with the same content are one adapter in the engine: rm of one must not unload
    the other's (before the fix it did, and its next request reloaded it from disk)."""
    from conftest import run_cli

    sock = str(paused.socket)
    folder = demo / "adapters" / "sql-expert" / "v1"
    for name in ("twin/a", "twin/b"):
        assert run_cli("pull", str(folder), "--name", name, "--socket", sock).returncode == 0
    assert run_cli("load", "twin/a", "--socket", sock).returncode == 0
    removed = run_cli("rm", "twin/b", "--socket", sock)
    assert removed.returncode == 0 and "unloaded" not in removed.stdout, removed.stdout
    listed = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", sock).stdout)}
    assert listed["twin/a"]["tier"] == "device", listed["twin/a"]
    out = run_cli("run", "--lora", "twin/a", "-t", "0", "-n", "8", "hi", "--socket", sock)
    assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hi"), folder, 8)) + "\n"
    assert run_cli("rm", "twin/a", "--socket", sock).returncode == 0


def test_rm_during_a_pin_is_refused_and_the_pin_stands(paused, demo):
    """A pin held between its cap check and its record while ``rm --force`` comes: before, the rm
    went through and the pin then recorded a pin of a name that was gone (holding one of the few
    pin places); now the rm is refused in one line, the pin completes, and a later rm works."""
    import subprocess

    from conftest import BIN, run_cli

    sock = str(paused.socket)
    name = "pinned-then-rm/v1"
    assert run_cli("pull", str(demo / "adapters" / "poet" / "v1"), "--name", name, "--socket", sock).returncode == 0
    arming = paused.pauses / "pin-claimed"
    arming.touch()
    pin = subprocess.Popen([str(BIN / "loractl"), "pin", name, "--to", "host", "--socket", sock],
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_for(paused.pauses / "pin-claimed.reached", pin)
        refused = run_cli("rm", name, "--force", "--socket", sock)
    finally:
        arming.unlink(missing_ok=True)
        (paused.pauses / "pin-claimed.reached").unlink(missing_ok=True)
    assert refused.returncode != 0 and "busy with another command" in refused.stderr, refused
    assert pin.wait(60) == 0, pin.communicate()
    listed = {a["name"]: a for a in json.loads(run_cli("ls", "--json", "--socket", sock).stdout)}
    assert listed[name]["pin"] == "host"
    assert run_cli("rm", name, "--force", "--socket", sock).returncode == 0
    status = json.loads(run_cli("status", "--json", "--socket", sock).stdout)
    assert status["capacity"]["pins"] == 0
