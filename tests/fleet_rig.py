"""Several hosts on one machine, for the fleet test and bench/fleet_bench.py: network namespaces
joined to this one by veth pairs, a real etcd, Dynamo's real frontend, and loractl daemons
started inside the namespaces (each one a host of its own: its own loopback, address and ports).

Layout, with ``N`` the rig's number (from the process id, so two runs do not collide):

    this namespace ("host 0"): etcd, the frontend, the Hub stub     10.N.i.1 on veth ``lcN-hi``
    namespace ``lcN-i`` ("host i"): one daemon                      10.N.i.2 on veth ``lcN-ni``

Every namespace routes to this one by default, and this one reaches each by its own link, so
the frontend dials each worker at the address it advertises (``DYN_TCP_RPC_HOST``). Unix
sockets are files, so the CLI in this namespace still reaches each daemon's socket.

Nothing here is a pytest fixture: :class:`Rig` is a context manager that removes every process,
namespace and data folder it made, whatever happens. It needs root (``ip netns add``);
:func:`why_no_namespaces` says why not where it cannot.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def why_no_namespaces() -> str:
    """'' where ``ip netns add`` works here, else the reason (not root, no iproute2, a sandbox)."""
    if shutil.which("ip") is None:
        return "iproute2's ip is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root (ip netns add)"
    probe = f"lcprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


def frontend_python() -> str | None:
    """An interpreter with Dynamo's frontend: $LORACTL_DYNAMO_FRONTEND_PYTHON, the venv
    scripts/setup.sh makes (.venv-frontend), or this one."""
    candidates = [os.environ.get("LORACTL_DYNAMO_FRONTEND_PYTHON"), str(REPO / ".venv-frontend" / "bin" / "python"),
                  sys.executable]
    for python in filter(None, candidates):
        if Path(python).exists() and subprocess.run([python, "-c", "import dynamo.frontend"],
                                                    capture_output=True).returncode == 0:
            return python
    return None


def free_port() -> int:
    """A free port below 32768: Dynamo 1.6.1 reads DYN_SYSTEM_PORT as a signed 16-bit number.
    Each namespace has ports of its own; one free here is very likely free there too."""
    import random

    for _ in range(100):
        port = random.randrange(20000, 32000)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port")


def wait_for(check, timeout: float, what: str, every: float = 0.2):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(every)


def _ip(*args: str, ns: str | None = None) -> None:
    command = (["ip", "netns", "exec", ns, "ip"] if ns else ["ip"]) + list(args)
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)}: {done.stderr.strip()}")


class Rig:
    """Hosts ``1..hosts`` as namespaces, etcd on host 0. Start daemons with :meth:`daemon`, the
    frontend with :meth:`frontend`; leaving the ``with`` block removes everything."""

    def __init__(self, root: Path, hosts: int = 2) -> None:
        self.root = root
        self.hosts = hosts
        # Unique among the suite's workers (pytest-xdist runs two at once): their subnets and veths differ.
        worker = int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)
        self.n = 100 + (os.getpid() % 75) * 2 + worker % 2
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.etcd_port = free_port()
        self.etcd_url = ""

    # -- addresses -------------------------------------------------------------------------
    def gateway(self, host: int) -> str:
        """This namespace's address on host ``host``'s link (what that host reaches us by)."""
        return f"10.{self.n}.{host}.1"

    def address(self, host: int) -> str:
        return f"10.{self.n}.{host}.2"

    def ns(self, host: int) -> str:
        return f"lc{self.n}-{host}"

    # -- life ------------------------------------------------------------------------------
    def __enter__(self) -> Rig:
        try:
            for host in range(1, self.hosts + 1):
                self._make_host(host)
            self._start_etcd()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _make_host(self, host: int) -> None:
        ns, outside, inside = self.ns(host), f"lc{self.n}-h{host}", f"lc{self.n}-n{host}"
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)  # a leftover of a killed run
        subprocess.run(["ip", "link", "del", outside], capture_output=True)
        _ip("netns", "add", ns)
        self.namespaces.append(ns)
        _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
        _ip("link", "set", inside, "netns", ns)
        _ip("addr", "add", f"{self.gateway(host)}/24", "dev", outside)
        _ip("link", "set", outside, "up")
        _ip("addr", "add", f"{self.address(host)}/24", "dev", inside, ns=ns)
        _ip("link", "set", inside, "up", ns=ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip("route", "add", "default", "via", self.gateway(host), ns=ns)

    def _start_etcd(self) -> None:
        binary = shutil.which("etcd")
        if binary is None:
            raise RuntimeError("etcd is not installed: bash scripts/setup.sh installs Debian's etcd-server as root")
        peer = free_port()
        listen = ",".join(f"http://{a}:{self.etcd_port}" for a in ["127.0.0.1", self.gateway(1)])
        self.etcd_url = f"http://{self.gateway(1)}:{self.etcd_port}"
        self.spawn("etcd", [binary, "--data-dir", str(self.root / "etcd"), "--listen-client-urls", listen,
                            "--advertise-client-urls", self.etcd_url, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                            "--initial-cluster", f"default=http://127.0.0.1:{peer}"])
        wait_for(lambda: self._etcd_answers(), 20, "etcd to answer")

    def _etcd_answers(self) -> bool:
        try:
            self.keys()
            return True
        except OSError:
            return False

    def spawn(self, name: str, argv: list[str], env: dict | None = None, host: int = 0) -> subprocess.Popen:
        """Start ``argv`` on ``host`` (0: here) in a session of its own, output in ``root/name.log``."""
        if host:
            argv = ["ip", "netns", "exec", self.ns(host), *argv]  # ip execs argv: the same pid
        with open(self.root / f"{name}.log", "wb") as out:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, start_new_session=True,
                                    env={**os.environ, **(env or {})}, cwd=self.root)
        self.procs.append(proc)
        return proc

    def close(self) -> None:
        # Newest first, one at a time: the frontends go before the daemons, which leave the
        # fleet (withdraw their keys) while etcd still answers, and etcd goes last.
        for proc in reversed(self.procs):
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(30)
                except ProcessLookupError:
                    pass
                except subprocess.TimeoutExpired:
                    pass
            # What is left of it and its process group (the engine core of a daemon killed hard).
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
        for ns in self.namespaces:  # deleting the namespace deletes its end of the veth, and so the pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()
        shutil.rmtree(self.root / "etcd", ignore_errors=True)

    # -- etcd ------------------------------------------------------------------------------
    def keys(self, prefix: str = "v1/") -> list[str]:
        """Keys under ``prefix``, through etcd's v3 JSON gateway (no etcdctl needed)."""
        b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
        end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
        request = urllib.request.Request(f"http://127.0.0.1:{self.etcd_port}/v3/kv/range", data=json.dumps(
            {"key": b64(prefix), "range_end": b64(end), "keys_only": True}).encode())
        with urllib.request.urlopen(request, timeout=10) as response:
            return [base64.b64decode(kv["key"]).decode() for kv in json.loads(response.read()).get("kvs", [])]

    def dynamo_env(self, host: int) -> dict[str, str]:
        """What a worker on ``host`` (or the frontend, host 0) needs to find the fleet."""
        env = {"ETCD_ENDPOINTS": self.etcd_url if host else f"http://127.0.0.1:{self.etcd_port}",
               "DYN_LORA_ENABLED": "true"}
        if host:
            env["DYN_TCP_RPC_HOST"] = self.address(host)
        return env

    # -- the frontend ----------------------------------------------------------------------
    def frontend(self, python: str, port: int, lora_routing: bool = True) -> subprocess.Popen:
        env = self.dynamo_env(0)
        if not lora_routing:
            env["DYN_LORA_ENABLED"] = "false"
        return self.spawn(f"frontend-{port}", [python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1",
                                                "--http-port", str(port), "--discovery-backend", "etcd"], env=env)


def models(port: int) -> set[str]:
    """What the frontend on ``port`` lists (empty while it does not answer)."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=5) as response:
            return {m["id"] for m in json.loads(response.read())["data"]}
    except OSError:
        return set()


def post(url: str, body: dict, timeout: float = 90) -> tuple[int, dict]:
    """(HTTP status, JSON body) of a POST; an error status is returned, not raised."""
    import urllib.error

    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as e:
        raw = e.read()
        try:
            return e.code, json.loads(raw)
        except ValueError:
            return e.code, {"raw": raw.decode(errors="replace")}
