"""Builds that start in the background as soon as the session knows it needs them, so that they
overlap the engine tests instead of running one after another: the fresh venvs of
tests/test_first_run.py and tests/test_wheel.py (pip unpacking and byte-compiling vLLM, torch and
the rest from the local index: minutes each) and the resolver's dry runs of
tests/test_install_resolves.py. Registered by conftest (``pytest_plugins``).

Invariants:

- a job starts only when a test of the module that registered it is selected (after
  ``-k``/``-m``/paths: ``pytest_collection_finish``), else at the first ``result`` call (always
  so under pytest-xdist, whose workers each collect every module and run only some);
- jobs run at the lowest CPU and I/O priority (``nice -n 19``, ``ionice -c 3``): they take the
  cycles the suite leaves idle and never slow a timed test; once a test waits for one, it is
  raised back to the suite's own priority (where allowed: root), so the worst case is the time it
  took when run in the test;
- what a job prints goes to files under its own folder; a job that fails (or outlives its
  timeout, counted from when a test first waits for it) fails the test that needs it with the
  tails of both (``ok``), never silently;
- at the session's end every job still running is killed with its whole process group, and
  every job's folder is removed;
- a job that declares the disk it fills (``disk_bytes``: a venv of vLLM and torch) starts only
  while the free space under /tmp covers it, what the other such jobs still building will write
  and ``DISK_RESERVE`` for the suite itself; else it is deferred until another job's folder is
  removed (``clean``) or a test waits for it. Two venvs built at once filled a CI machine's
  disk (stop 54: ``[Errno 28] No space left on device`` in the first-run venv); one at a time
  they fit where either alone does, and where the disk is large they still start together.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest

# (command, working folder, environment) for a job, given the folder it may write in.
Make = Callable[[Path], "tuple[list[str], Path, dict[str, str]]"]
# Room left for what the suite writes beside the jobs (daemons' homes, models, logs).
DISK_RESERVE = 2 << 30
LOWEST_PRIORITY = [*(["nice", "-n", "19"] if shutil.which("nice") else []),
                   *(["ionice", "-c", "3"] if shutil.which("ionice") else [])]


@dataclass
class Job:
    name: str
    module: str   # the test module whose selected tests need it
    make: Make
    disk_bytes: int = 0   # about what the job writes; 0: small, never deferred
    root: Path | None = None
    proc: subprocess.Popen | None = None
    done: subprocess.CompletedProcess | None = None
    files: list = field(default_factory=list)
    cleaned: bool = False
    wanted: bool = False   # a selected test needs it: deferred, it starts once there is room

    def start(self, *, waited: bool = False) -> None:
        """Start the job, unless it is a disk job without room yet (``waited``: a test needs it
        now, so it starts whatever the room)."""
        if self.proc is not None:
            return
        if not waited and not room_for(self):
            return
        self.root = Path(tempfile.mkdtemp(prefix=f"lcbg-{self.name}-", dir="/tmp"))
        cmd, cwd, env = self.make(self.root)
        out, err = open(self.root / "stdout", "w"), open(self.root / "stderr", "w")
        self.files = [out, err]
        # Its own session: the end of the run kills the whole group (pip's children, a shell's).
        self.proc = subprocess.Popen([*LOWEST_PRIORITY, *cmd], cwd=cwd, env=env, stdout=out, stderr=err, text=True,
                                     stdin=subprocess.DEVNULL, start_new_session=True)

    def tails(self, chars: int = 3000) -> str:
        return "".join(f"{part} (last {chars} characters):\n{(self.root / part).read_text(errors='replace')[-chars:]}\n"
                       for part in ("stdout", "stderr"))

    def result(self, timeout: float) -> subprocess.CompletedProcess:
        """Wait for the job (started now if it was not); its exit status and output. A job still
        running after ``timeout`` s of waiting is killed and fails the test."""
        self.start(waited=True)
        if self.done is None:
            self.hurry()
            try:
                code = self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                pytest.fail(f"background job {self.name} still running after {timeout} s:\n{self.tails()}")
            for f in self.files:
                f.close()
            self.done = subprocess.CompletedProcess(self.proc.args, code, (self.root / "stdout").read_text(),
                                                    (self.root / "stderr").read_text())
        return self.done

    def ok(self, timeout: float) -> Path:
        """Wait for the job; its folder when it succeeded, else fail the test with its output."""
        done = self.result(timeout)
        if done.returncode != 0:
            pytest.fail(f"background job {self.name} failed with exit status {done.returncode}: "
                        f"{' '.join(map(str, done.args))}\n{self.tails()}")
        return self.root

    def hurry(self) -> None:
        """Every thread of the job's process group back to this process's CPU and I/O priority."""
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        threads = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                if os.getpgid(int(pid)) == self.proc.pid:
                    threads += [int(t) for t in os.listdir(f"/proc/{pid}/task")]
            except OSError:   # gone meanwhile
                continue
        for tid in threads:
            try:
                os.setpriority(os.PRIO_PROCESS, tid, mine)
            except OSError:   # not allowed (not root) or gone: it goes on at the lowest priority
                pass
        if threads and shutil.which("ionice"):
            subprocess.run(["ionice", "-c", "2", "-n", "4", "-p", *map(str, threads)], capture_output=True)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(30)

    def clean(self) -> None:
        self.kill()
        for f in self.files:
            f.close()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.cleaned = True
            if not ENDING:
                start_deferred()

    @property
    def holding(self) -> bool:
        """Started and its folder not yet removed."""
        return self.proc is not None and not self.cleaned

    @property
    def building(self) -> bool:
        """Holding its folder and still writing in it."""
        return self.holding and self.proc.poll() is None


JOBS: dict[str, Job] = {}
ENDING = False   # the session is ending: a job cleaned then starts no deferred one


def register(name: str, module: str, make: Make, disk_bytes: int = 0) -> None:
    """Declare a job, at a test module's import (``module``: its ``__name__``; ``disk_bytes``:
    about what it writes, for a job that may not fit beside another)."""
    JOBS.setdefault(name, Job(name, module, make, disk_bytes))


def free_disk() -> int:
    return shutil.disk_usage("/tmp").free


def room_for(job: Job) -> bool:
    """Whether ``job`` may start now: small, the only disk job holding a folder, or the free
    space covers it, what the disk jobs still building will write, and the reserve."""
    if not job.disk_bytes:
        return True
    others = [j for j in JOBS.values() if j is not job and j.disk_bytes and j.holding]
    if not others:
        return True
    still_to_write = sum(j.disk_bytes for j in others if j.building)
    return free_disk() >= job.disk_bytes + still_to_write + DISK_RESERVE


def start_deferred() -> None:
    """Start the deferred jobs that now have room, in the order they were declared."""
    for j in JOBS.values():
        if j.wanted and j.proc is None:   # never started (a cleaned job was)
            j.start()


def job(name: str) -> Job:
    return JOBS[name]


# The longest files first (their pytest-xdist durations on this 2-core machine, each 3-10 min):
# scripts/test.sh's two workers take whole files in collection order, so these start at once,
# the builds among them overlap the rest, and the many short files fill in beside them. Longest
# first is what balances two workers; in the collected order, the builds ran last, alone.
LONGEST_FIRST = ("test_first_run", "test_wheel", "test_bench_smoke", "test_real_model", "test_real_gguf",
                 "test_install_resolves", "test_tiers", "test_faults", "test_model_defaults", "test_formats")


def pytest_collection_modifyitems(config: pytest.Config, items: list) -> None:
    if not hasattr(config, "workerinput"):   # one process: the builds overlap from the start anyway
        return
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(getattr(getattr(item, "module", None), "__name__", ""), len(rank)))


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    if hasattr(session.config, "workerinput"):   # a pytest-xdist worker (not a pytest it started)
        # Under pytest-xdist every worker collects every test, but only one runs a module: a job
        # starts there, at its first ``result``, while the other worker runs the rest.
        return
    wanted = {item.module.__name__ for item in session.items if getattr(item, "module", None) is not None}
    for j in JOBS.values():
        if j.module in wanted:
            j.wanted = True
            j.start()


def pytest_sessionfinish(session: pytest.Session) -> None:
    global ENDING
    ENDING = True
    for j in JOBS.values():
        j.clean()
