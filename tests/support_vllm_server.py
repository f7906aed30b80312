"""vLLM's own OpenAI server beside the rig, serving the same adapters under the same names: the
oracle the HTTP API is compared with. Registered by conftest (``pytest_plugins``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from support_daemons import AT_END, adapter_folder
from support_rigs import RIG_CONTEXT, RIG_SERVER_FLAGS, Rig

# Adapters served under these names by both the rig (pulled) and vLLM's own server (--lora-modules).
ORACLE_ADAPTERS = {"oracle/sql": "sql-expert", "oracle/poet": "poet"}


@dataclass
class VllmServer:
    """vLLM's own OpenAI server (``python -m vllm.entrypoints.openai.api_server``) on the tiny
    model, with the rig's engine and server flags and :data:`ORACLE_ADAPTERS` as LoRA modules:
    the oracle the HTTP API is compared with. ``model`` is the base model's name in both."""
    proc: subprocess.Popen
    url: str
    model: str
    log: Path
    cmd: list = field(default_factory=list)
    restarts: int = 0

    def start(self) -> None:
        """Start it (again: after its engine died, see test_openai_differential._idle) and wait
        until it answers /health; its log goes on in the same file."""
        import urllib.request

        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc = subprocess.Popen(self.cmd, stdout=open(self.log, "ab"), stderr=subprocess.STDOUT,
                                     start_new_session=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        deadline = time.monotonic() + 300
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM's server exited with {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                os.killpg(self.proc.pid, signal.SIGKILL)
                raise RuntimeError(f"vLLM's server not up after 300 s:\n{self.log.read_text()[-3000:]}")
            time.sleep(0.5)



@pytest.fixture(scope="session")
def oracle_rig(rig) -> Rig:
    """The rig with :data:`ORACLE_ADAPTERS` pulled under their oracle names."""
    for name, adapter in ORACLE_ADAPTERS.items():
        rig.ok("pull", str(adapter_folder(rig.root / "tiny", adapter)), "--name", name)
    return rig


@pytest.fixture(scope="session")
def vllm_server(home: Path, oracle_rig) -> VllmServer:
    import socket
    import urllib.request

    model = json.loads(urllib.request.urlopen(f"{oracle_rig.http}/v1/models", timeout=10).read())["data"][0]["id"]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    log = Path(os.environ.get("LORACTL_TEST_VLLM_SERVER_LOG") or home / "vllm-server.log")
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(home / "tiny" / "model"),
           "--served-model-name", model, "--host", "127.0.0.1", "--port", str(port), "--enable-lora",
           "--max-loras", "2", "--max-cpu-loras", "3", "--max-lora-rank", "16", "--max-model-len", str(RIG_CONTEXT),
           "--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20), "--seed", "0",
           "--disable-uvicorn-access-log", *RIG_SERVER_FLAGS, "--lora-modules",
           *(f"{name}={adapter_folder(home / 'tiny', adapter)}" for name, adapter in ORACLE_ADAPTERS.items())]
    log.write_bytes(b"")
    server = VllmServer(None, f"http://127.0.0.1:{port}", model, log, cmd)  # type: ignore[arg-type]
    server.start()
    yield server
    proc = server.proc
    os.killpg(proc.pid, signal.SIGTERM)

    def wait() -> None:   # at the session's end, with the daemons (stop_at_end)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    AT_END.append(wait)
