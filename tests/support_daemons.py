"""What starts a real loractld: the session's home with the tiny demo built in it, the session
daemon, ``start_daemon`` for daemons of a test's own, and the CLI runner. Registered by
conftest (``pytest_plugins``).

Paths are kept short on purpose: a Unix socket path must fit in 107 bytes, and pytest's own
tmp_path can exceed that. Every session fixture that starts a process depends on ``home``, whose
teardown is the last: the processes are waited for there, together (``stop_at_end``).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

from loractl import Client
from loractl.errors import LoractlError

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
ENGINE_FLAGS = ["--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16"]


@pytest.fixture(scope="session")
def home() -> Path:
    """A short-path LORACTL_HOME with the demo assets built in it."""
    from loractld.models.tiny import ensure_demo

    from loractl import paths

    root = Path(tempfile.mkdtemp(prefix="lct-", dir="/tmp"))
    ensure_demo(paths.layout(root).tiny_dir)
    yield root
    errors = []
    for wait in AT_END:   # every session fixture depends on home: its teardown is the last
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - the others are still waited for
            errors.append(e)
    AT_END.clear()
    shutil.rmtree(root, ignore_errors=True)
    if errors:
        raise errors[0]


# The session fixtures' processes get SIGTERM at their teardown and are waited for together at
# the session's end (home's teardown): a daemon's stop takes 3-5 s (its engine core's exit), and
# one after another the session's four waited that many times over.
AT_END: list = []


def stop_at_end(proc: subprocess.Popen, then=None) -> None:
    """SIGTERM ``proc`` now; at the session's end wait for it as Daemon.stop does (60 s, else
    TimeoutExpired), then run ``then``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)

    def wait() -> None:
        proc.wait(60)
        if then is not None:
            then()
    AT_END.append(wait)


@pytest.fixture(scope="session")
def demo(home: Path) -> Path:
    return home / "tiny"


@dataclass
class Daemon:
    proc: subprocess.Popen
    home: Path
    socket: Path
    log: Path

    def client(self) -> Client:
        return Client(self.socket)

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)


def start_daemon(home: Path, *extra: str, name: str = "d", ready_timeout: float = 240, model: str = "tiny",
                 engine_flags: list[str] = ENGINE_FLAGS, env: dict | None = None,
                 prefix: list[str] | tuple[str, ...] = ()) -> Daemon:
    """Start ``loractld --model MODEL`` under ``home`` (``env`` added to the environment) and
    wait until Status says ready. ``prefix`` runs it through a command that execs it, e.g.
    ``ip netns exec NS`` (the pid stays the daemon's)."""
    sock = home / f"{name}.sock"
    log = home / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [*prefix, str(BIN / "loractld"), "--model", model, "--home", str(home), "--socket", str(sock),
             *engine_flags, *extra],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **(env or {})},
        )
    daemon = Daemon(proc, home, sock, log)
    deadline = time.monotonic() + ready_timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"loractld exited with {proc.returncode}:\n{daemon.log_tail()}")
        if sock.exists():
            try:
                if asyncio.run(_status(sock)).get("ready"):
                    return daemon
            except LoractlError:
                pass
        time.sleep(0.5)
    daemon.stop()
    raise RuntimeError(f"loractld not ready after {ready_timeout} s:\n{daemon.log_tail()}")


def sub_home(home: Path, sub: str) -> Path:
    """A home of its own under ``home/sub``, the demo model shared through a link: one daemon per
    home (loractld locks it), so a second daemon in a session needs one."""
    root = home / sub
    root.mkdir(exist_ok=True)
    (root / "tiny").exists() or (root / "tiny").symlink_to(home / "tiny")
    return root


def own_daemon(home: Path, sub: str, adapters: list[str], *extra: str, name: str = "d") -> Daemon:
    """A daemon of its own under ``home/sub`` (:func:`sub_home`), started with ``extra`` flags,
    with these demo adapters pulled under their own names: for modules that pin or remove, whose
    state must not leak into the session daemon's."""
    d = start_daemon(sub_home(home, sub), *extra, name=name)
    for adapter in adapters:
        result = run_cli("pull", str(home / "tiny" / "adapters" / adapter), "--name", adapter, "--socket", str(d.socket))
        assert result.returncode == 0, result.stderr
    return d

async def _status(sock: Path) -> dict:
    async with Client(sock, timeout=5) as client:
        return await client.status()


@pytest.fixture(scope="session")
def daemon(home: Path) -> Daemon:
    """One real daemon for the session: tiny model, CPU, float32, 2 device slots, 3 host."""
    d = start_daemon(home)
    yield d
    stop_at_end(d.proc)


def sigint_as_at_a_terminal() -> None:
    """``preexec_fn`` for a child that a test interrupts with Ctrl-C / SIGINT.

    A shell without job control starts background commands with SIGINT ignored, and an
    ignored signal stays ignored across fork and exec: a CI run started with ``&`` (or
    under nohup) hands that to pytest and to every process it starts. Python then installs
    no KeyboardInterrupt handler, nor asyncio.run its own, and the child never sees the
    Ctrl-C the test sends: ``loractl pull`` waits on, ``loractl chat`` finishes its reply.
    A person at a terminal has SIGINT at its default, so the child gets that.
    """
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_cli(*args: str, env: dict | None = None, input: str | None = None, timeout: float = 60):
    """Run the installed ``loractl`` script; return the CompletedProcess (text mode)."""
    full_env = {**os.environ, "NO_COLOR": "1", "COLUMNS": "100", **(env or {})}
    full_env.pop("LORACTL_SOCKET", None)
    return subprocess.run([str(BIN / "loractl"), *args], capture_output=True, text=True, env=full_env,
                          input=input, timeout=timeout)


async def collect(client: Client, **kwargs) -> dict:
    """Run one generation to the end; return prompt ids, token ids, text and finish reason."""
    result = {"prompt_ids": [], "ids": [], "text": "", "finish": "", "adapter": ""}
    async for chunk in client.generate(**kwargs):
        result["prompt_ids"] += chunk.prompt_token_ids
        result["ids"] += chunk.token_ids
        result["text"] += chunk.text
        result["finish"] = chunk.finish_reason or result["finish"]
        result["adapter"] = chunk.adapter or result["adapter"]
    return result


def adapter_folder(demo: Path, adapter: str) -> Path:
    """The folder of a demo adapter that holds its adapter_config.json."""
    return next((demo / "adapters" / adapter).rglob("adapter_config.json")).parent
