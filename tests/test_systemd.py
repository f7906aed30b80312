"""systemd: unit files verify, sd_notify messages, socket activation; configuration layers."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from conftest import BIN, ENGINE_FLAGS, run_cli, sub_home
from test_errors import short_dir  # noqa: F401 - a fixture
from loractl.errors import InvalidRequest
from loractld import config
from loractld.main import build_parser


# systemd-socket-activate starts its command with only the variables named by -E: pass on the
# ones that decide which loractld code runs (a checkout on PYTHONPATH, say).
ACTIVATE_ENV = [arg for name in ("PYTHONPATH", "VIRTUAL_ENV") if name in os.environ for arg in ("-E", name)]


def render_units(tmp: Path) -> None:
    for args in (["--system", "--socket-activated", "--http", "127.0.0.1:8000"], ["--user"]):
        result = run_cli("daemon", "install", *args, "--unit-dir", str(tmp / args[0].strip("-")))
        assert result.returncode == 0, result.stderr


def test_units_verify(tmp_path):
    render_units(tmp_path)
    system = tmp_path / "system"
    assert "ExecStart=" + str(BIN / "loractld") in (system / "loractld.service").read_text()
    result = subprocess.run(["systemd-analyze", "verify", "--man=no", str(system / "loractld.socket"),
                             str(system / "loractld-http.socket"), str(system / "loractld.service")],
                            capture_output=True, text=True)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    runtime = Path(tempfile.mkdtemp(prefix="lct-xdg-"))
    result = subprocess.run(["systemd-analyze", "--user", "verify", "--man=no", str(tmp_path / "user" / "loractld.service")],
                            capture_output=True, text=True, env={**os.environ, "XDG_RUNTIME_DIR": str(runtime)})
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr
    text = (system / "loractld.service").read_text()
    http_socket = (system / "loractld-http.socket").read_text()
    assert "ListenStream=127.0.0.1:8000" in http_socket and "Service=loractld.service" in http_socket
    for directive in ("Type=notify", "NotifyAccess=main", "Restart=on-failure", "WatchdogSec=", "RuntimeDirectory=",
                      "StateDirectory=", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
                      "ReadWritePaths="):
        assert directive in text, directive


def test_notify_and_socket_activation(home):
    """loractld under systemd-socket-activate, with a NOTIFY_SOCKET the test binds: the
    activated socket serves, READY=1 comes only once the engine is up, WATCHDOG=1 follows,
    STOPPING=1 on SIGTERM."""
    short = Path(tempfile.mkdtemp(prefix="lct-sd-", dir="/tmp"))
    notify_path = short / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(1.0)
    sock = short / "act.sock"
    env = {**os.environ, "WATCHDOG_USEC": "1000000"}
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(sock), *ACTIVATE_ENV, "-E", f"NOTIFY_SOCKET={notify_path}",
         "-E", "WATCHDOG_USEC=1000000",
         str(BIN / "loractld"), "--model", "tiny", "--home", str(sub_home(home, "sd")), *ENGINE_FLAGS],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    messages: list[str] = []
    try:
        # The activated socket accepts connections before loractld even started.
        deadline = time.monotonic() + 5
        while not sock.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        result = run_cli("status", "--json", "--socket", str(sock), timeout=240)  # this first client starts it
        assert result.returncode == 0, result.stderr
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and not any(m.startswith("WATCHDOG=1") for m in messages):
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                pass
        ready = next(i for i, m in enumerate(messages) if "READY=1" in m)
        assert "STATUS=ready" in messages[ready]
        assert any("STATUS=starting" in m for m in messages[:ready])
        # Each start-up stage extends systemd's start timeout (a first demo start trains for minutes).
        assert any(m.startswith("EXTEND_TIMEOUT_USEC=300000000\nSTATUS=starting the engine") for m in messages[:ready])
        assert any(m == "WATCHDOG=1" for m in messages[ready:])
        assert run_cli("status", "--json", "--socket", str(sock)).returncode == 0
        os.killpg(proc.pid, 15)
        proc.wait(60)
        while True:
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                break
        assert any("STOPPING=1" in m for m in messages)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        listener.close()
        shutil.rmtree(short, ignore_errors=True)


def test_a_failed_start_tells_systemd_why_and_never_says_ready(short_dir):
    """Type=notify: a start that fails sends its reason as the unit's status (and ERRNO), never
    READY=1, and exits 1, so the unit fails with the reason in the journal."""
    notify_path = short_dir / "notify"
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    listener.bind(str(notify_path))
    listener.settimeout(0.5)
    bad = short_dir / "m.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(1020))
    try:
        result = subprocess.run([str(BIN / "loractld"), "--model", str(bad), "--home", str(short_dir)],
                                env={**os.environ, "NOTIFY_SOCKET": str(notify_path)}, capture_output=True,
                                text=True, timeout=120)
        messages = []
        while True:
            try:
                messages.append(listener.recv(4096).decode())
            except TimeoutError:
                break
    finally:
        listener.close()
    assert result.returncode == 1, result.stderr
    assert not any("READY=1" in m for m in messages), messages
    failed = [m for m in messages if m.startswith("STATUS=failed: ")]
    assert failed and "is not a readable GGUF file" in failed[0] and "ERRNO=1" in failed[0], messages
    assert "is not a readable GGUF file" in result.stderr   # what the journal keeps


def test_config_precedence(tmp_path, monkeypatch):
    file = tmp_path / "loractld.toml"
    file.write_text('model = "from-file"\nmax-loras = 3\nmax_cpu_loras = 6\npreload = ["a/v1", "b/v1"]\n'
                    'kv-cache-memory = "64MiB"\nno-prefix-caching = true\n')
    monkeypatch.setenv("LORACTLD_MAX_LORAS", "5")
    args = config.resolve(build_parser, ["--config", str(file), "--max-cpu-loras", "9"])
    assert args.model == "from-file"                          # file over default
    assert args.max_loras == 5                                # environment over file
    assert args.max_cpu_loras == 9                            # flag over everything
    assert args.preload == ["a/v1", "b/v1"] and args.kv_cache_memory == 64 << 20 and args.no_prefix_caching
    assert args.max_lora_rank is None                         # default: from the store at start


@pytest.mark.parametrize("content, needle", [
    ("bogus = 1\n", "unknown key 'bogus'"),
    ("device = 'tpu'\n", "invalid value for device"),
    ("max-loras = 'many'\n", "invalid value for max-loras"),
    ("model = \n", "not valid TOML"),
])
def test_config_errors_name_the_key(tmp_path, content, needle):
    file = tmp_path / "bad.toml"
    file.write_text(content)
    with pytest.raises(InvalidRequest, match=needle):
        config.resolve(build_parser, ["--config", str(file)])
    result = subprocess.run([str(BIN / "loractld"), "--config", str(file)], capture_output=True, text=True)
    assert result.returncode == 2 and needle.split("'")[0] in result.stderr and "hint:" in result.stderr


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_http_socket_activation_and_sigterm_mid_stream(home, reference):
    """Both sockets from systemd (Unix and TCP, as loractld.socket + loractld-http.socket pass
    them): the first HTTP client starts loractld, which serves the API on the TCP socket without
    --http; a stream cut by SIGTERM ends with [DONE] (finished, or an error event saying the
    daemon stopped it), and the daemon exits 0.

    The model is the demo's with sampling defaults in its generation_config.json (top_k 1:
    greedy), served under --served-model-name: a request that names no sampling parameter
    must take them (as vLLM's server does) and equal the greedy reference."""
    import httpx

    short = Path(tempfile.mkdtemp(prefix="lct-sh-", dir="/tmp"))
    model = short / "model"
    shutil.copytree(home / "tiny" / "model", model)
    generation = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**generation, "do_sample": True, "top_k": 1}))
    sock, port = short / "act.sock", _free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", str(sock), "-l", f"127.0.0.1:{port}", *ACTIVATE_ENV,
         str(BIN / "loractld"), "--model", str(model), "--served-model-name", "tiny", "--home", str(sub_home(home, "sh")),
         "--shutdown-grace", "0.5", *ENGINE_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 240
        health = None
        while time.monotonic() < deadline:  # the first of these starts the daemon
            try:
                health = httpx.get(url + "/health", timeout=30)
                if health.status_code == 200:
                    break
                assert health.json()["error"]["message"] == "the engine is starting", health.text
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        assert health is not None and health.status_code == 200
        status = run_cli("status", "--json", "--socket", str(sock))
        assert json.loads(status.stdout)["http"] == url
        prompt = "Write a query"
        answer = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "model": "tiny", "messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "min_tokens": 12})
        want = reference.text(reference.greedy(reference.chat_ids(prompt), None, 12, 12))
        assert answer.json()["choices"][0]["message"]["content"] == want

        body = {"model": "tiny", "prompt": "Once", "max_tokens": 240, "min_tokens": 240, "temperature": 0,
                "stream": True}
        events = []
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=60) as response:
            for line in response.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: "):])
                    if len(events) == 1:
                        os.killpg(proc.pid, 15)
        assert events[-1] == "[DONE]"
        last = json.loads(events[-2])
        assert "error" not in last or last["error"]["code"] == "cancelled", last
        assert proc.wait(60) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        shutil.rmtree(short, ignore_errors=True)


def test_a_passed_tcp_socket_beyond_loopback_needs_an_api_key(home):
    """A socket unit with ListenStream=0.0.0.0:PORT and no api-key-file: loractld refuses to
    serve (exit 2, one-line error with the hint) instead of opening the API to the network."""
    short = Path(tempfile.mkdtemp(prefix="lct-sk-", dir="/tmp"))
    port = _free_port()
    proc = subprocess.Popen(
        ["systemd-socket-activate", "-l", f"0.0.0.0:{port}", *ACTIVATE_ENV, str(BIN / "loractld"), "--model", "tiny",
         "--home", str(home), "--socket", str(short / "s.sock"), *ENGINE_FLAGS],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        time.sleep(0.5)
        with socket.create_connection(("127.0.0.1", port), timeout=5):
            pass  # starts loractld
        out, _ = proc.communicate(timeout=120)
        assert proc.returncode == 2, out
        assert "would be reachable from other machines without an API key" in out and "--api-key-file" in out
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
        shutil.rmtree(short, ignore_errors=True)
