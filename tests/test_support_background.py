"""The suite's background jobs (tests/support_background.py), run in a pytest of their own: a job
starts only for a selected module, a failed one fails the test that waits for it with its output,
a job waited for runs at the test's priority, and a job still running at the session's end is
killed."""

from __future__ import annotations

import os
import time
from pathlib import Path

pytest_plugins = ["pytester"]

HERE = Path(__file__).resolve().parent

JOBS = '''
import support_background as background

def shell(script):
    return lambda root: (["sh", "-c", script], root, {"PATH": "/usr/bin:/bin"})

background.register("broken", "test_needs", shell("echo built half; echo no space left >&2; exit 3"))
background.register("endless", "test_needs", shell("pwd > {pids}/endless-root; echo $$ > {pids}/endless; exec sleep 600"))
background.register("waited", "test_needs", shell("sleep 3; nice"))
background.register("unneeded", "test_other", shell("touch {pids}/unneeded"))
'''

NEEDS = '''
import support_background as background

def test_waits_for_a_broken_job():
    background.job("broken").ok(60)

def test_leaves_an_endless_job_running():
    pass

def test_a_waited_job_runs_at_the_tests_priority():
    # Raised from nice 19 while it sleeps: the command after the sleep inherits the new priority;
    # only root may raise it.
    import os
    assert background.job("waited").ok(60).joinpath("stdout").read_text() == ("0\\n" if os.geteuid() == 0 else "19\\n")
'''


def test_a_broken_job_fails_its_test_with_its_output_and_the_rest_end_with_the_session(pytester, tmp_path,
                                                                                     monkeypatch):
    pytester.makeconftest("pytest_plugins = ['support_background', 'jobs']\n")
    pytester.makepyfile(jobs=JOBS.replace("{pids}", str(tmp_path)), test_needs=NEEDS,
                        test_other="def test_nothing():\n    pass\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    began = time.monotonic()
    result = pytester.runpytest_subprocess("test_needs.py", "-p", "no:cacheprovider")
    result.assert_outcomes(passed=2, failed=1)
    result.stdout.fnmatch_lines(["*background job broken failed with exit status 3*", "*built half*",
                                 "*no space left*"])
    assert time.monotonic() - began < 60, "the session waited for the endless job"
    pid = int((tmp_path / "endless").read_text())
    try:
        os.kill(pid, 0)
        alive = Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except ProcessLookupError:
        alive = False
    assert not alive, "the endless job outlived the session"
    assert not (tmp_path / "unneeded").exists(), "a job of a module not selected was started"
    assert not Path((tmp_path / "endless-root").read_text().strip()).exists(), "a job's folder was left"


DISK_JOBS = '''
import support_background as background

GIB = 1 << 30
background.free_disk = lambda: int({free_gib} * GIB)   # the disk the jobs see

def shell(script):
    return lambda root: (["sh", "-c", script], root, {"PATH": "/usr/bin:/bin"})

background.register("venv-a", "test_disk", shell("sleep 2; date +%s.%N"), disk_bytes=3 * GIB)
background.register("venv-b", "test_disk", shell("date +%s.%N"), disk_bytes=4 * GIB)
background.register("resolve", "test_disk", shell("date +%s.%N"))
'''

DISK_NEEDS = '''
import support_background as background

def test_the_disk_jobs():
    a, b, small = (background.job(n) for n in ("venv-a", "venv-b", "resolve"))
    assert small.proc is not None, "a small job waited for room"
    assert a.proc is not None, "the first disk job waited with no other holding a folder"
    started_together = b.proc is not None
    print("TOGETHER" if started_together else "DEFERRED")
    a.ok(60)
    if not started_together:
        assert b.proc is None, "venv-b started beside venv-a's finished but kept folder"
        a.clean()
        assert b.proc is not None, "venv-b did not start once venv-a's folder was removed"
    b.ok(60)
'''


def test_a_disk_job_without_room_waits_for_the_other_to_be_removed_and_starts_at_once_with_room(pytester,
                                                                                               monkeypatch):
    pytester.makeconftest("pytest_plugins = ['support_background', 'jobs']\n")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(HERE), os.environ.get("PYTHONPATH")])))
    for free_gib, shown in ((8.5, "DEFERRED"), (9.5, "TOGETHER")):  # 4 + 3 still to write + 2 reserve = 9
        pytester.makepyfile(jobs=DISK_JOBS.replace("{free_gib}", str(free_gib)), test_disk=DISK_NEEDS)
        result = pytester.runpytest_subprocess("test_disk.py", "-s", "-p", "no:cacheprovider")
        result.assert_outcomes(passed=1)
        result.stdout.fnmatch_lines([f"*{shown}*"])
