"""The built wheel, installed as users install it, works without the repository (issue 45,
item 3): ``pip install 'loractl-0.1.0-py3-none-any.whl[cpu]'`` into a fresh venv (whatever
vLLM's CPU wheel pulls beside it: CUDA builds of torchvision, an older torchaudio, triton), then
from an empty folder: ``loractld --model tiny`` and ``--model demo``, ``status``, ``run``,
``pull`` of a folder, the man pages and completions where the README says they go, and
``daemon install`` writing a unit that runs the installed scripts with the config it wrote.

The wheel is built and installed once per run, in the background from the session's start
(support_background: minutes of pip unpacking and byte-compiling that overlap the engine tests).
Answers are checked against HF + PEFT in float32 (``conftest.Reference``)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

import support_background as background
from conftest import ENGINE_FLAGS, REAL_DEMO_CACHE, REPO, Reference, adapter_folder
from hub_stub import HubStub
from test_first_run import user_environment

INSTALL_TIMEOUT_S = 1200


# Run by support_background in the job's folder ($1): the wheel into dist/, a venv from the
# system's Python into venv/, the wheel with its cpu extra into that.
BUILD_AND_INSTALL = """set -euo pipefail
"$SUITE_PYTHON" -m pip wheel -q --no-deps --disable-pip-version-check -w "$1/dist" "$REPO"
wheels=("$1"/dist/loractl-*.whl)
"$BASE_PYTHON" -m venv "$1/venv"
"$1/venv/bin/pip" install -q --disable-pip-version-check "${wheels[0]}[cpu]"
"""


def _build_and_install(root: Path) -> tuple[list[str], Path, dict[str, str]]:
    python = shutil.which("python3.11") or shutil.which("python3")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}   # the suite's hook stays out of pip's view
    return (["bash", "-c", BUILD_AND_INSTALL, "build-and-install", str(root)], root,
            {**env, "SUITE_PYTHON": sys.executable, "BASE_PYTHON": python, "REPO": str(REPO)})


# The venv with vLLM's CPU wheel and all it pulls (triton, CUDA torchvision): 3.5 GiB measured.
background.register("wheel-venv", __name__, _build_and_install, disk_bytes=4 << 30)


@pytest.fixture(scope="module")
def installed():
    """(venv folder, empty working folder) with the wheel and its ``cpu`` extra installed."""
    job = background.job("wheel-venv")
    try:
        root = job.ok(600 + INSTALL_TIMEOUT_S)
        empty = root / "empty"
        empty.mkdir()
        yield root / "venv", empty, root
    finally:
        job.clean()


def _cli(venv: Path, cwd: Path, env: dict, *args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(venv / "bin" / "loractl"), *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=timeout)


def _serve(venv: Path, cwd: Path, env: dict, *args: str) -> subprocess.Popen:
    log = open(Path(env["LORACTL_HOME"]) / "loractld.log", "wb")
    return subprocess.Popen([str(venv / "bin" / "loractld"), *args], cwd=cwd, env=env, stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)


def _stop(daemon: subprocess.Popen, home: Path) -> str:
    if daemon.poll() is None:
        daemon.terminate()
    daemon.wait(60)
    return (home / "loractld.log").read_text(errors="replace")[-3000:]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_the_wheel_serves_the_tiny_model_from_an_empty_folder(installed):
    """The daemon's run-time paths in the environment the wheel's ``cpu`` extra makes: the tiny
    model's build, the engine, a folder pull, a Hub pull (a local stand-in for the Hub) and the
    OpenAI HTTP API (``--http``)."""
    venv, empty, root = installed
    home = root / "home-tiny"
    env = user_environment(home)
    home.mkdir()
    port = _free_port()
    daemon = _serve(venv, empty, env, "--model", "tiny", "--http", f"127.0.0.1:{port}", *ENGINE_FLAGS)
    try:
        waited = _cli(venv, empty, env, "status", "--wait", "--timeout", "300")
        assert waited.returncode == 0, (waited.stderr, _stop(daemon, home))
        ref = Reference(home / "tiny" / "model")
        answer = _cli(venv, empty, env, "run", "-t", "0", "-n", "8", "hello")
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == ref.text(ref.greedy(ref.chat_ids("hello"), None, 8)) + "\n"
        folder = adapter_folder(home / "tiny", "sql-expert")
        pulled = _cli(venv, empty, env, "pull", str(folder), "--name", "sql-expert/v1")
        assert pulled.returncode == 0 and "success: sql-expert/v1" in pulled.stdout, pulled.stderr
        answer = _cli(venv, empty, env, "run", "--lora", "sql-expert/v1", "-t", "0", "-n", "8", "hello")
        assert answer.stdout == ref.text(ref.greedy(ref.chat_ids("hello"), folder, 8)) + "\n", answer.stderr
        assert _cli(venv, empty, env, "status").returncode == 0
        poet = adapter_folder(home / "tiny", "poet")
        with HubStub() as hub:
            hub.add_commit("acme/poet-lora", {p.name: p.read_bytes() for p in poet.iterdir() if p.is_file()})
            pulled = _cli(venv, empty, {**env, "HF_ENDPOINT": hub.endpoint}, "pull", "acme/poet-lora")
        assert pulled.returncode == 0 and "success: acme/poet-lora" in pulled.stdout, pulled.stderr
        body = json.dumps({"model": "acme/poet-lora", "messages": [{"role": "user", "content": "hello"}],
                           "temperature": 0, "max_tokens": 8}).encode()
        request = urllib.request.Request(f"http://127.0.0.1:{port}/v1/chat/completions", data=body,
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=120) as reply:
            content = json.loads(reply.read())["choices"][0]["message"]["content"]
        assert content == ref.text(ref.greedy(ref.chat_ids("hello"), poet, 8))
    finally:
        log = _stop(daemon, home)
    assert daemon.returncode == 0, log
    assert "Traceback" not in log, log
    assert os.listdir(empty) == [], "the daemon or the CLI wrote into the working folder"


def test_the_wheel_installs_man_pages_completions_and_a_unit_for_its_scripts(installed):
    venv, empty, root = installed
    for path in ("share/man/man1/loractl.1", "share/man/man8/loractld.8", "share/bash-completion/completions/loractl",
                 "share/zsh/site-functions/_loractl", "share/fish/vendor_completions.d/loractl.fish"):
        assert (venv / path).is_file() and (venv / path).stat().st_size > 0, path
        assert (venv / path).read_bytes() == (REPO / {"loractl.1": "man/loractl.1", "loractld.8": "man/loractld.8",
                                                       "loractl": "completions/loractl.bash",
                                                       "_loractl": "completions/_loractl",
                                                       "loractl.fish": "completions/loractl.fish"}[
                                                           Path(path).name]).read_bytes(), path
    units = root / "units"
    env = user_environment(root / "home-unit")
    made = _cli(venv, empty, env, "daemon", "install", "--user", "--model", "tiny", "--unit-dir", str(units))
    assert made.returncode == 0, made.stderr
    unit = (units / "loractld.service").read_text()
    assert f"ExecStart={venv / 'bin' / 'loractld'} --config {units / 'loractld.toml'}\n" in unit, unit
    assert 'model = "tiny"' in (units / "loractld.toml").read_text()
    # The config it points at is one the installed loractld reads, with the model in it.
    read = ("from loractld import config; from loractld.main import build_parser; "
            f"print(config.resolve(build_parser, ['--config', {str(units / 'loractld.toml')!r}]).model)")
    check = subprocess.run([str(venv / "bin" / "python"), "-c", read], capture_output=True, text=True, cwd=empty,
                           env=env, timeout=60)
    assert check.returncode == 0 and check.stdout == "tiny\n", check.stderr


def test_the_wheel_serves_the_demo_model_from_an_empty_folder(installed, real_demo):
    """``--model demo`` from the wheel: its training data and units ship inside the package (the
    adapters' keys are computed from the data). The demo build is the suite's, shared."""
    venv, empty, root = installed
    home = root / "home-demo"
    home.mkdir()
    for part in ("demo", "models"):
        (home / part).symlink_to(REAL_DEMO_CACHE / part)
    env = user_environment(home)
    began = time.monotonic()
    daemon = _serve(venv, empty, env, "--model", "demo")
    try:
        waited = _cli(venv, empty, env, "status", "--wait", "--timeout", "600", timeout=900)
        assert waited.returncode == 0, (waited.stderr, _stop(daemon, home))
        assert "training" not in waited.stderr, "the demo was trained again instead of found"
        folder = real_demo["adapters"]["sql-expert/v1"]
        assert _cli(venv, empty, env, "pull", str(folder), "--name", "sql-expert/v1").returncode == 0
        ref = Reference(real_demo["model"])
        prompt = "List all users older than 30"
        answer = _cli(venv, empty, env, "run", "--lora", "sql-expert/v1", "-t", "0", "-n", "16", prompt)
        assert answer.returncode == 0, answer.stderr
        assert answer.stdout == ref.text(ref.greedy(ref.chat_ids(prompt), folder, 16)) + "\n"
        assert "SELECT" in answer.stdout
    finally:
        log = _stop(daemon, home)
    assert daemon.returncode == 0 and "Traceback" not in log, log
    assert time.monotonic() - began < 600


def test_the_wheel_with_its_dynamo_extra_joins_a_fleet(installed):
    """``--dynamo`` in the environment ``pip install 'loractl[cpu,dynamo]'`` makes (run last: it
    adds the runtime to the module's venv). File discovery: no etcd needed to see it join."""
    from test_dynamo import discovery, free_port, instances

    venv, empty, root = installed
    dist = next((root / "dist").glob("loractl-*.whl"))
    added = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check",
                            f"{dist}[cpu,dynamo]"], capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S)
    assert added.returncode == 0, added.stderr[-3000:]
    home = root / "home-dynamo"
    home.mkdir()
    kv = root / "kv"
    port = free_port()
    env = {**user_environment(home), "DYN_FILE_KV": str(kv), "DYN_LORA_ENABLED": "true",
           "DYN_SYSTEM_PORT": str(port)}
    daemon = _serve(venv, empty, env, "--model", "tiny", "--dynamo", "--dynamo-discovery", "file", *ENGINE_FLAGS)
    try:
        waited = _cli(venv, empty, env, "status", "--wait", "--timeout", "300")
        assert waited.returncode == 0, (waited.stderr, _stop(daemon, home))
        deadline = time.monotonic() + 30
        while not instances(kv) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert instances(kv), _stop(daemon, home)
        assert "" in set().union(*discovery(kv).values())   # the base model's card
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/loras", timeout=60) as reply:
            assert reply.status == 200 and isinstance(json.loads(reply.read()), dict)
    finally:
        log = _stop(daemon, home)
    assert daemon.returncode == 0 and "Traceback" not in log, log
