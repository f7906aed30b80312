"""The daemon's life: the CPU bug it must fix, and a clean SIGTERM shutdown."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
import time
from pathlib import Path

import psutil
import pytest

from conftest import collect, run_cli, start_daemon, sub_home
from loractl.errors import Cancelled, DaemonNotRunning


@pytest.fixture(scope="module")
def unfixed_daemon(home):
    """A second daemon with the CPU fixes off: vLLM 0.32's own behaviour (a home of its own:
    one daemon per home)."""
    d = start_daemon(sub_home(home, "unfixed"), "--no-cpu-fixes", "--shutdown-grace", "1", name="unfixed")
    yield d
    d.stop()


def test_mixed_batch_is_wrong_without_the_cpu_fix(unfixed_daemon, demo, reference):
    """Shows the mixed-batch test can fail: without the fix, vLLM 0.32 on CPU serves the base
    request of a mixed batch with the last slot's adapter, so it leaves the reference.

    The two adapter streams are running (each has sent its first token) before the base request
    is sent, so every step of the base request is a mixed one; sent all at once, a loaded CI
    machine could finish the base request before the adapters were loaded."""
    n = 32
    prompt = "How do I reverse a list in Python?"
    messages = [{"role": "user", "content": prompt}]

    async def go():
        async with unfixed_daemon.client() as client:
            started = [asyncio.Event(), asyncio.Event()]
            done = asyncio.Event()

            async def adapter_stream(name: str, started: asyncio.Event):
                async for _ in client.generate(messages=messages, lora=str(demo / "adapters" / name),
                                               max_tokens=200, min_tokens=200, temperature=0.0):
                    started.set()
                    if done.is_set():
                        return   # leaving the stream cancels it

            streams = [asyncio.create_task(adapter_stream(name, event))
                       for name, event in zip(["sql-expert/v1", "python-expert/v1"], started)]
            deadline = time.monotonic() + 300
            while not all(e.is_set() for e in started):
                for stream in streams:
                    if stream.done():
                        stream.result()   # a stream that failed says why
                assert time.monotonic() < deadline, "the adapter streams did not start"
                await asyncio.sleep(0.05)
            base = await collect(client, messages=messages, max_tokens=n, min_tokens=n, temperature=0.0)
            assert all(not s.done() for s in streams), "an adapter stream ended before the base request"
            done.set()
            await asyncio.gather(*streams)
            return base

    base = asyncio.run(go())
    assert len(base["ids"]) == n
    assert base["ids"] != reference.greedy(reference.chat_ids(prompt), None, n, n)


def test_sigterm_stops_cleanly(unfixed_daemon):
    """SIGTERM mid-stream: the stream ends with a clear error, the daemon exits 0, the socket
    is removed and no child process is left behind."""
    d = unfixed_daemon
    children = psutil.Process(d.proc.pid).children(recursive=True)
    assert children, "vLLM's engine runs in a child process"

    async def go():
        async with d.client() as client:
            received = 0
            try:
                async for chunk in client.generate(prompt="Once", max_tokens=240, min_tokens=240, temperature=0.0):
                    received += len(chunk.token_ids)
                    if received and not getattr(go, "signalled", False):
                        go.signalled = True
                        os.kill(d.proc.pid, signal.SIGTERM)
            except (Cancelled, DaemonNotRunning) as e:
                return received, e
            return received, None

    received, error = asyncio.run(go())
    assert received > 0
    # Within the 1 s grace the stream either finished or was cancelled with a clear status.
    assert error is None or isinstance(error, Cancelled), error
    assert d.proc.wait(timeout=60) == 0, d.log_tail()
    assert not d.socket.exists()
    gone, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, f"orphans: {alive}"
    assert "stopped" in d.log_tail()
    result = run_cli("status", "--socket", str(d.socket))
    assert result.returncode == 3


def test_second_daemon_on_a_live_socket_is_refused(daemon, tmp_path):
    home = Path(tempfile.mkdtemp(prefix="lct-2nd-", dir="/tmp"))   # another home: the socket refuses
    result = start_daemon_expect_exit(home, "--socket", str(daemon.socket))
    assert result[0] == 1
    assert "another daemon is already listening" in result[1]


def test_a_second_daemon_on_a_home_in_use_is_refused_before_touching_it(daemon, tmp_path):
    """Two daemons on one home would recover, GC and write state.json over each other: the
    second exits at once, naming the first's pid and socket, and leaves the first serving."""
    other = tmp_path / "other.sock"
    code, err = start_daemon_expect_exit(daemon.home, "--socket", str(other))
    assert code == 1 and not other.exists()
    first = err.strip().splitlines()[0]
    assert first == (f"loractld: error: another loractld (pid {daemon.proc.pid}, socket {daemon.socket}) already "
                     f"serves {daemon.home}"), err
    assert run_cli("status", "--socket", str(daemon.socket)).returncode == 0


def start_daemon_expect_exit(home: Path, *args: str) -> tuple[int, str]:
    import subprocess
    import sys

    proc = subprocess.run([str(Path(sys.executable).parent / "loractld"), "--model", "tiny", "--home", str(home),
                           *args], capture_output=True, text=True, timeout=60)
    return proc.returncode, proc.stderr


def test_bad_flags_fail_fast(home):
    code, err = start_daemon_expect_exit(home, "--max-loras", "4", "--max-cpu-loras", "2",
                                         "--socket", "/tmp/lct-unused.sock")
    assert code == 2
    assert "--max-cpu-loras (2) is below --max-loras (4)" in err and "hint:" in err
