"""Issue 60, item 2: Ctrl-C cancels a merge (and the create that merges), on the hooked daemon.

Before: ``loractl merge ... --svd-rank 16`` + Ctrl-C printed ``interrupted`` and exited 130, the
audit said ``result=error``, and 29 s later the daemon logged ``merged`` and ``ls`` listed it;
``loractl create ctrlc07 -f Modelfile`` + Ctrl-C left ``ctrlc07-merged`` in the store. Now the
stream's reset cancels the call, the merge's thread stops at its next step (the ``merge-step``
pause point holds it there, so the Ctrl-C lands mid-merge on any machine), nothing is
installed, no staging folder stays, the audit says ``result=cancelled`` and the engine serves.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

from support_daemons import BIN, run_cli, sigint_as_at_a_terminal

SOURCES = ("poet/v1", "translator/v1")   # ranks 8 and 16: the merge's --svd-rank 4 fits any rank limit
FITTING = ("poet/v1", "sql-expert/v1")   # ranks 8 and 8: an exact merge within the daemon's 16


def _wait_for(path: Path, proc: subprocess.Popen, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, f"{path.name} was not reached"
        time.sleep(0.05)


def _interrupted(hooked, *args: str) -> tuple[subprocess.CompletedProcess, str]:
    """Run ``loractl ARGS``, Ctrl-C it once the merge is held mid-way, then let the merge go on."""
    sock = str(hooked.daemon.socket)
    arming = hooked.pauses / "merge-step"
    reached = hooked.pauses / "merge-step.reached"
    reached.unlink(missing_ok=True)
    arming.touch()
    log_at = hooked.daemon.log.stat().st_size
    try:
        proc = subprocess.Popen([str(BIN / "loractl"), *args, "--socket", sock], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, preexec_fn=sigint_as_at_a_terminal,
                                env={**os.environ, "NO_COLOR": "1"})
        _wait_for(reached, proc)
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        arming.unlink(missing_ok=True)
        reached.unlink(missing_ok=True)
    deadline = time.monotonic() + 60
    while True:   # the daemon's own word on the merge, once its thread went on
        log = hooked.daemon.log.read_bytes()[log_at:].decode(errors="replace")
        if "cancelled by its caller" in log or "completed after its caller left" in log:
            break
        assert time.monotonic() < deadline, log
        time.sleep(0.2)
    return subprocess.CompletedProcess(args, proc.returncode, out, err), log


def _listed(sock: str) -> set[str]:
    return {a["name"] for a in json.loads(run_cli("ls", "--json", "--socket", sock).stdout)}


def _staging_left(hooked) -> list[str]:
    """The store's staging folders (``<store>/.tmp/<uuid>``): a merge writes its files there."""
    return sorted(p.name for p in hooked.daemon.home.glob("**/adapters/.tmp/*"))


def _pull_sources(hooked, demo) -> str:
    sock = str(hooked.daemon.socket)
    for name in (*SOURCES, *FITTING):
        if name not in _listed(sock):
            pulled = run_cli("pull", str(demo / "adapters" / name), "--name", name, "--socket", sock)
            assert pulled.returncode == 0, pulled.stderr
    return sock


def test_ctrl_c_of_a_merge_installs_nothing_and_is_audited_cancelled(hooked, demo):
    sock = _pull_sources(hooked, demo)
    before = _listed(sock)
    staging = _staging_left(hooked)
    result, log = _interrupted(hooked, "merge", "ctrlc-merge", *SOURCES, "--svd-rank", "4")
    assert result.returncode == 130, (result.stdout, result.stderr)
    assert "cancelled by its caller: nothing was installed" in log, log
    assert "merged ctrlc-merge" not in log
    assert 'op=merge target="poet/v1=1 translator/v1=1 as ctrlc-merge" result=cancelled' in log, log
    time.sleep(1)
    assert _listed(sock) == before and _staging_left(hooked) == staging
    # Nothing holds the name: the same merge, uninterrupted, is made; the engine serves it.
    made = run_cli("merge", "ctrlc-merge", *SOURCES, "--svd-rank", "4", "--socket", sock)
    assert made.returncode == 0, made.stderr
    ran = run_cli("run", "--lora", "ctrlc-merge", "-n", "2", "hi", "--socket", sock)
    assert ran.returncode == 0, ran.stderr
    assert run_cli("rm", "ctrlc-merge", "--socket", sock).returncode == 0


def test_ctrl_c_of_a_create_that_merges_leaves_no_profile_and_no_merge(hooked, demo, tmp_path):
    sock = _pull_sources(hooked, demo)
    before = _listed(sock)
    (tmp_path / "Modelfile").write_text("".join(f"ADAPTER {n}=0.5\n" for n in FITTING).replace(
        "ADAPTER", "FROM tiny\nADAPTER", 1))
    result, log = _interrupted(hooked, "create", "ctrlc07", "-f", str(tmp_path / "Modelfile"))
    assert result.returncode == 130, (result.stdout, result.stderr)
    assert "op=create target=ctrlc07" in log and "result=cancelled" in log, log
    time.sleep(1)
    after = _listed(sock)
    assert "ctrlc07" not in after and "ctrlc07-merged" not in after and after == before, after - before
    assert _staging_left(hooked) == []
    assert run_cli("run", "--raw", "-n", "2", "hi", "--socket", sock).returncode == 0


# -- issue 60, item 16: a create of many folder ADAPTERs, interrupted mid-pulls ----------------

def test_ctrl_c_of_a_create_mid_pulls_leaves_none_of_its_adapters(hooked, demo, tmp_path):
    """The issue's `timeout -s INT 4.9 loractl create cx9 -f M1000` (a Modelfile of folder
    ADAPTERs) left ``cx9-adapter-75``, installed after the undo had looked; here the Ctrl-C comes
    after the 2nd, 4th and 6th pull's install, and each time nothing of ``cx9`` stays."""
    import shutil

    sock = str(hooked.daemon.socket)
    source = demo / "adapters" / "poet" / "v1"
    lines = ["FROM tiny"]
    for i in range(12):   # distinct folders (the same one again is the same adapter, pulled once)
        folder = tmp_path / f"a{i}"
        shutil.copytree(source, folder)
        config = json.loads((folder / "adapter_config.json").read_text())
        config["lora_dropout"] = i / 100   # other content, same weights
        # Ranks the create cannot add up before pulling (a rank_pattern, equal to r): it pulls them
        # all, as it pulls Hub refs, and the merge would refuse them after (test below: refused first).
        config["rank_pattern"] = {module: config["r"] for module in config["target_modules"]}
        (folder / "adapter_config.json").write_text(json.dumps(config))
        lines.append(f"ADAPTER {folder}=0.1")
    (tmp_path / "M").write_text("\n".join(lines) + "\n")
    before = _listed(sock)
    for cut in (2, 4, 6):
        log_at = hooked.daemon.log.stat().st_size
        proc = subprocess.Popen([str(BIN / "loractl"), "create", "cx9", "-f", str(tmp_path / "M"), "--socket", sock],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                preexec_fn=sigint_as_at_a_terminal, env={**os.environ, "NO_COLOR": "1"})
        deadline = time.monotonic() + 120
        while hooked.daemon.log.read_bytes()[log_at:].count(b"DOWNLOADED_TO_DISK cx9-adapter") < cut:
            if proc.poll() is not None:
                break
            assert time.monotonic() < deadline, hooked.daemon.log_tail()
            time.sleep(0.02)
        assert proc.poll() is None, ("the create ended before its cut", cut, proc.communicate())
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 130, (cut, out, err)
        deadline = time.monotonic() + 60
        while True:   # the undo's removals are done once no cx9 name is left, or the time is up
            left = {n for n in _listed(sock) - before if n.startswith("cx9")}
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert not left, (cut, sorted(left), proc.returncode, err, hooked.daemon.log_tail())
        time.sleep(2)   # and none lands after
        assert _listed(sock) == before, (cut, _listed(sock) - before)
    assert _staging_left(hooked) == []
    assert run_cli("run", "--raw", "-n", "2", "hi", "--socket", sock).returncode == 0


def test_a_create_whose_merge_is_too_big_is_refused_before_any_pull(hooked, demo, tmp_path):
    """Item 16's other half: each folder line was pulled before the rank check; 12 rank-8 folders
    (rank 96, over the daemon's 16) are refused at once, and nothing is pulled."""
    import shutil

    sock = str(hooked.daemon.socket)
    lines = ["FROM tiny"]
    for i in range(12):
        folder = tmp_path / f"b{i}"
        shutil.copytree(demo / "adapters" / "poet" / "v1", folder)
        lines.append(f"ADAPTER {folder}=0.1")
    (tmp_path / "M").write_text("\n".join(lines) + "\n")
    before = _listed(sock)
    log_at = hooked.daemon.log.stat().st_size
    refused = run_cli("create", "cx10", "-f", str(tmp_path / "M"), "--socket", sock)
    assert refused.returncode == 2 and "merge to rank 96, over this daemon's --max-lora-rank 16" in refused.stderr, \
        refused.stderr
    assert b"DOWNLOADED_TO_DISK" not in hooked.daemon.log.read_bytes()[log_at:]
    assert _listed(sock) == before
