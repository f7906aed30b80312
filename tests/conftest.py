"""Shared fixtures: the demo assets, a real loractld on the CPU, and an HF + PEFT reference.

Paths are kept short on purpose: a Unix socket path must fit in 107 bytes, and pytest's own
tmp_path can exceed that.
"""

from __future__ import annotations

import support_hooks  # noqa: F401 - first: enables the suite's hook for loractld (tests/hooks_plugin)
import asyncio
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from loractl import Client
from loractl.errors import LoractlError

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
# The real demo (SmolLM2 + trained adapters) is built once per checkout: a clean CI clone builds
# it once per run, a developer's later runs reuse it.
REAL_DEMO_CACHE = REPO / ".cache" / "real-demo"
RIG_CONTEXT = 1024  # the tiny model's whole context
# vLLM's OpenAI server flags the rig's HTTP API runs with, and vLLM's own server beside it (vllm_server).
RIG_SERVER_FLAGS = ("--enable-auto-tool-choice", "--tool-call-parser", "hermes")
# Adapters served under these names by both the rig (pulled) and vLLM's own server (--lora-modules).
ORACLE_ADAPTERS = {"oracle/sql": "sql-expert", "oracle/poet": "poet"}
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
    for wait in _AT_END:   # every session fixture depends on home: its teardown is the last
        try:
            wait()
        except BaseException as e:  # noqa: BLE001 - the others are still waited for
            errors.append(e)
    _AT_END.clear()
    shutil.rmtree(root, ignore_errors=True)
    if errors:
        raise errors[0]


# The session fixtures' processes get SIGTERM at their teardown and are waited for together at
# the session's end (home's teardown): a daemon's stop takes 3-5 s (its engine core's exit), and
# one after another the session's four waited that many times over.
_AT_END: list = []


def _stop_at_end(proc: subprocess.Popen, then=None) -> None:
    """SIGTERM ``proc`` now; at the session's end wait for it as Daemon.stop does (60 s, else
    TimeoutExpired), then run ``then``."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)

    def wait() -> None:
        proc.wait(60)
        if then is not None:
            then()
    _AT_END.append(wait)


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
    tests/hooks_plugin/loractl_test_hooks.py), with the HTTP API on and, when a test group could be made, its
    socket in that group (--socket-group). Shared by the modules that fuzz, kill and check the
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
    _stop_at_end(rig.daemon.proc)


CUDA_SPY = Path(__file__).resolve().parent / "cuda_spy.py"


@dataclass
class Hooked:
    """A daemon started as ``loractld --device auto`` under the CUDA spy (tests/cuda_spy.py,
    recording to ``record``), with test hooks armable through files under ``root``: pause
    points (``pauses``, LORACTL_TEST_PAUSE_DIR), a one-shot activation
    fault (``activate_fault``) and a poisoned load (``poison``): tests/hooks_plugin/loractl_test_hooks.py."""
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
    _stop_at_end(hooks.daemon.proc, no_cuda_over_its_life)


async def _status(sock: Path) -> dict:
    async with Client(sock, timeout=5) as client:
        return await client.status()


@pytest.fixture(scope="session")
def daemon(home: Path) -> Daemon:
    """One real daemon for the session: tiny model, CPU, float32, 2 device slots, 3 host."""
    d = start_daemon(home)
    yield d
    _stop_at_end(d.proc)


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


class Reference:
    """Greedy completions from HF transformers + PEFT in float32: the independent oracle."""

    def __init__(self, model_dir: Path) -> None:
        from transformers import AutoTokenizer

        self.model_dir = model_dir
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self._cache: dict = {}

    def chat_ids(self, user_text: str) -> list[int]:
        return self.messages_ids([{"role": "user", "content": user_text}])

    def messages_ids(self, messages: list[dict[str, str]]) -> list[int]:
        text = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def greedy(self, prompt_ids: list[int], adapter: Path | None, max_new: int, min_new: int = 0) -> list[int]:
        key = (tuple(prompt_ids), str(adapter), max_new, min_new)
        if key not in self._cache:
            import torch
            from transformers import AutoModelForCausalLM

            model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=torch.float32)
            if adapter is not None:
                from peft import PeftModel

                model = PeftModel.from_pretrained(model, str(adapter))
            model.eval()
            with torch.no_grad():
                out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new, min_new_tokens=min_new,
                                     do_sample=False, pad_token_id=self.tokenizer.pad_token_id)
            self._cache[key] = out[0, len(prompt_ids):].tolist()
        return self._cache[key]

    def text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)


_real_demo_build: subprocess.Popen | None = None


def _start_real_demo_build() -> subprocess.Popen:
    global _real_demo_build
    if _real_demo_build is None:
        REAL_DEMO_CACHE.mkdir(parents=True, exist_ok=True)
        log = open(REAL_DEMO_CACHE / "build.log", "w")
        _real_demo_build = subprocess.Popen([sys.executable, "-m", "loractld.models.demo", "--data",
                                             str(REAL_DEMO_CACHE)], stdout=log, stderr=subprocess.STDOUT, text=True)
    return _real_demo_build


@pytest.fixture(scope="session")
def real_demo() -> dict:
    """Build (or find) the demo under the cache: {'model': folder, 'adapters': {name: folder}}."""
    build = _start_real_demo_build()
    code = build.wait(1500)
    output = (REAL_DEMO_CACHE / "build.log").read_text()
    assert code == 0, output[-3000:]
    lines = output.splitlines()
    model = Path(next(ln.split(": ", 1)[1] for ln in lines if ln.startswith("model: ")))
    adapters = {}
    for ln in lines:
        if ln.startswith("adapter: "):
            name, folder = ln.split(": ", 1)[1].split(" ", 1)
            adapters[name] = Path(folder)
    return {"model": model, "adapters": adapters}


@pytest.fixture(scope="session")
def reference(demo: Path) -> Reference:
    return Reference(demo / "model")


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


def add_bos(model: Path) -> int:
    """Make the tokenizer in ``model`` add BOS (``<s>``) as a base model's does; returns its id."""
    tokenizer = json.loads((model / "tokenizer.json").read_text())
    bos = [t["id"] for t in tokenizer["added_tokens"] if t["content"] == "<s>"][0]
    tokenizer["post_processor"] = {
        "type": "TemplateProcessing",
        "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
        "pair": [{"SpecialToken": {"id": "<s>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}},
                 {"Sequence": {"id": "B", "type_id": 1}}],
        "special_tokens": {"<s>": {"id": "<s>", "ids": [bos], "tokens": ["<s>"]}},
    }
    (model / "tokenizer.json").write_text(json.dumps(tokenizer))
    return bos


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


def adapter_folder(demo: Path, adapter: str) -> Path:
    """The folder of a demo adapter that holds its adapter_config.json."""
    return next((demo / "adapters" / adapter).rglob("adapter_config.json")).parent


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

    def wait() -> None:   # at the session's end, with the daemons (_stop_at_end)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
    _AT_END.append(wait)
