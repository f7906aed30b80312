"""Daemons of their own that tests kill, restart or arm hooks in: the rig (HTTP on, kill points,
a load fault, the socket in a test group when one can be made) and the hooked daemon (pause
points and faults, run under the CUDA spy), with the test group and user they need. Registered
by conftest (``pytest_plugins``)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from support_daemons import ENGINE_FLAGS, Daemon, run_cli, start_daemon, stop_at_end, sub_home

RIG_CONTEXT = 1024  # the tiny model's whole context
# vLLM's OpenAI server flags the rig's HTTP API runs with, and vLLM's own server beside it (vllm_server).
RIG_SERVER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")


@dataclass
class SocketUsers:
    """A group made for the tests and a user in it (a supplementary group, as ``usermod -aG``)."""
    group: str
    member: str
    member_uid: int
    member_gid: int


@pytest.fixture(scope="session")
def socket_users():
    """(SocketUsers or None, why not): made when running as root with groupadd and useradd,
    removed at the end of the session."""
    if os.geteuid() != 0:
        yield None, "not running as root: cannot create a test group and user"
        return
    if not (shutil.which("groupadd") and shutil.which("useradd")):
        yield None, "groupadd/useradd are not installed"
        return
    tag = f"lct{os.getpid()}"
    group, member = f"{tag}g", f"{tag}m"
    made = subprocess.run(["groupadd", group], capture_output=True, text=True)
    if made.returncode:
        yield None, f"groupadd failed: {made.stderr.strip()}"
        return
    try:
        made = subprocess.run(["useradd", "--no-create-home", "--home-dir", "/nonexistent", "--shell",
                               "/usr/sbin/nologin", "--no-user-group", "--groups", group, member],
                              capture_output=True, text=True)
        if made.returncode:
            yield None, f"useradd failed: {made.stderr.strip()}"
            return
        import pwd

        entry = pwd.getpwnam(member)
        try:
            yield SocketUsers(group, member, entry.pw_uid, entry.pw_gid), ""
        finally:
            subprocess.run(["userdel", member], capture_output=True)
    finally:
        subprocess.run(["groupdel", group], capture_output=True)


@dataclass
class Rig:
    """A daemon of its own that tests may kill and restart (``LORACTL_TEST_KILL_AT``: see
    tests/hooks_plugin/loractl_test_hooks.py), with the HTTP API on and, when a test group could
    be made, its socket in that group (--socket-group). Shared by the modules that fuzz, kill and check the
    socket's group, so that they pay for one daemon start, plus one per kill."""
    root: Path
    flags: tuple[str, ...]
    daemon: Daemon | None = None
    http: str = ""

    @property
    def arm(self) -> Path:
        return self.root / "kill-at"

    @property
    def load_fault(self) -> Path:
        """Test-only: a text written here fails the engine's next load, in a step, of an adapter
        whose path holds it (LORACTL_TEST_LOAD_FAULT: tests/hooks_plugin)."""
        return self.root / "load-fault"

    def start(self) -> None:
        # Hub pulls fail at once (nothing listens on port 9): the fuzzers send random refs.
        self.daemon = start_daemon(self.root, *self.flags, name="rig",
                                   env={"LORACTL_TEST_KILL_AT": str(self.arm), "HF_ENDPOINT": "http://127.0.0.1:9",
                                        "LORACTL_TEST_LOAD_FAULT": str(self.load_fault)})
        self.http = json.loads(self.ok("status", "--json").stdout)["http"]

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        return run_cli(*args, "--socket", str(self.daemon.socket))

    def ok(self, *args: str) -> subprocess.CompletedProcess:
        result = self.cli(*args)
        assert result.returncode == 0, (args, result.stderr, self.daemon.log_tail())
        return result

    def pull(self, *names: str) -> None:
        for name in names:
            self.ok("pull", str(self.root / "tiny" / "adapters" / name), "--name", name)


@pytest.fixture(scope="session")
def rig(home, socket_users) -> Rig:
    root = home / "rig"
    root.mkdir(exist_ok=True)
    (root / "tiny").exists() or (root / "tiny").symlink_to(home / "tiny")
    users, _ = socket_users
    # A longer context than the other daemons': a killed client's request must still be running
    # when the daemon aborts it, even on a loaded machine (test_kill_points).
    rig = Rig(root, ("--http", "127.0.0.1:0", "--max-model-len", str(RIG_CONTEXT), *RIG_SERVER_FLAGS,
                     *(("--socket-group", users.group) if users else ())))
    rig.start()
    yield rig
    stop_at_end(rig.daemon.proc)


CUDA_SPY = Path(__file__).resolve().parent / "cuda_spy.py"


@dataclass
class Hooked:
    """A daemon started as ``loractld --device auto`` under the CUDA spy (tests/cuda_spy.py,
    recording to ``record``), with test hooks armable through files under ``root``: pause
    points (``pauses``, LORACTL_TEST_PAUSE_DIR), a one-shot activation fault (``activate_fault``)
    and a poisoned load (``poison``): tests/hooks_plugin/loractl_test_hooks.py."""
    daemon: Daemon
    root: Path
    record: Path

    @property
    def pauses(self) -> Path:
        return self.root / "pauses"

    @property
    def activate_fault(self) -> Path:
        return self.root / "activate-fault"

    @property
    def poison(self) -> Path:
        return self.root / "poison"

    def cuda_calls(self) -> list[dict]:
        """CUDA calls the spy recorded in the daemon's own process (the spy's line must be there)."""
        sys.path.insert(0, str(CUDA_SPY.parent))
        import cuda_spy

        assert "spy installed" in self.record.read_text(), "the spy did not run in the daemon"
        return cuda_spy.calls(str(self.record), pid=self.daemon.proc.pid)


@pytest.fixture(scope="session")
def hooked(home: Path) -> Hooked:
    """One daemon for the modules that arm its test hooks (test_folder_isolation,
    test_races_daemon) and for test_cuda_start, which checks that its start and serving never
    touch CUDA in its own process: one engine start for the three instead of three. Its own
    home (sub_home); the hooks do nothing until a test arms one. At the end, after its stop,
    the spy's record must still hold no CUDA call of the daemon's process (its whole life)."""
    root = sub_home(home, "hooked")
    hooks = Hooked(None, root, root / "cuda-calls.jsonl")  # type: ignore[arg-type]
    hooks.pauses.mkdir(exist_ok=True)
    hooks.record.unlink(missing_ok=True)
    flags = [f for f in ENGINE_FLAGS if f not in ("--device", "cpu")]
    hooks.daemon = start_daemon(root, "--device", "auto", engine_flags=flags, name="hooked",
                                prefix=[sys.executable, str(CUDA_SPY), str(hooks.record)],
                                env={"PYTORCH_NVML_BASED_CUDA_CHECK": "",
                                     "LORACTL_TEST_PAUSE_DIR": str(hooks.pauses),
                                     "LORACTL_TEST_ACTIVATE_FAULT": str(hooks.activate_fault),
                                     "LORACTL_TEST_POISON": str(hooks.poison)})
    yield hooks

    def no_cuda_over_its_life() -> None:
        found = hooks.cuda_calls()
        assert found == [], "CUDA touched in the daemon over its life:\n" + "\n".join(
            c["call"] + "\n" + "".join(c["stack"]) for c in found)
    stop_at_end(hooks.daemon.proc, no_cuda_over_its_life)
