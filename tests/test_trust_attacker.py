"""Tests as an attacker: user nobody (65534), outside the socket's group, and a member of it,
against the shared rig daemon (real engine, keyless loopback HTTP, --socket-group). Each
attack is refused in one line, nothing changes, and the daemon keeps answering.

The attacker's side runs as a real other user (setpriv), with loractl's own Client or curl."""

from __future__ import annotations

import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import httpx
import pytest

from conftest import run_cli

NOBODY = (65534, 65534)

ATTACK = textwrap.dedent('''
    import asyncio, json, sys
    from loractl import Client
    from loractl.errors import LoractlError

    async def main(sock, what):
        arg = sys.stdin.read()
        async with Client(sock, timeout=60) as client:
            try:
                if what == "pull":
                    async for _ in client.pull(arg, name="poet/v1", force=True):
                        pass
                elif what == "generate":
                    prompt, lora = json.loads(arg)
                    async for _ in client.generate(prompt, lora=lora or None, max_tokens=2):
                        pass
                print(json.dumps({"ok": True}))
            except LoractlError as e:
                print(json.dumps({"kind": e.kind, "message": e.message, "hint": e.hint}))

    asyncio.run(main(*sys.argv[1:]))
''')


def attack(uid: int, gid: int, sock, what: str, arg: str, *, groups: bool = False) -> dict:
    ids = [f"--reuid={uid}", f"--regid={gid}", "--init-groups" if groups else "--clear-groups"]
    done = subprocess.run(["setpriv", *ids, sys.executable, "-c", ATTACK, str(sock), what], input=arg,
                          capture_output=True, text=True, timeout=120, env={**os.environ, "HOME": "/tmp"})
    assert done.returncode == 0 and done.stdout.strip(), done.stderr
    return json.loads(done.stdout)


def curl_as(uid: int, gid: int, url: str, body: dict, *, groups: bool = False) -> tuple[int, dict]:
    ids = [f"--reuid={uid}", f"--regid={gid}", "--init-groups" if groups else "--clear-groups"]
    done = subprocess.run(["setpriv", *ids, "curl", "-s", "-m", "60", "-w", "\n%{http_code}", "-H",
                           "Content-Type: application/json", "-d", json.dumps(body), url],
                          capture_output=True, text=True, timeout=90)
    text, _, code = done.stdout.rpartition("\n")
    return int(code), (json.loads(text) if text.startswith("{") else {"text": text})


@pytest.fixture
def attacked(rig, socket_users):
    """The rig with poet/v1 stored, its socket reachable by every local user (folders 0711,
    socket 0666, for the test only: the socket's rule, not its mode, is what is tested)."""
    users, why_not = socket_users
    if users is None:
        pytest.skip(why_not)
    rig.pull("poet/v1")
    sock = rig.daemon.socket
    saved = [(p, stat.S_IMODE(os.stat(p).st_mode)) for p in (rig.root.parent, rig.root, sock)]
    for folder in (rig.root.parent, rig.root):
        os.chmod(folder, 0o711)
    os.chmod(sock, 0o666)
    yield rig, users
    for path, mode in saved:
        os.chmod(path, mode)


def store(rig) -> dict:
    return {a["name"]: (a["ref"], a["revision"], a["pulled_at"]) for a in json.loads(rig.ok("ls", "--json").stdout)}


def alive(rig) -> None:
    assert httpx.get(f"{rig.http}/health", timeout=30).status_code == 200
    assert json.loads(rig.ok("status", "--json").stdout)["ready"]


def test_nobody_cannot_change_adapters_over_keyless_http(attacked):
    rig, _ = attacked
    before = store(rig)
    other_weights = str(rig.root / "tiny" / "adapters" / "sql-expert" / "v1")
    for route, body in (("load_lora_adapter", {"lora_name": "poet/v1", "lora_path": other_weights}),
                        ("unload_lora_adapter", {"lora_name": "poet/v1"})):
        status, answer = curl_as(*NOBODY, f"{rig.http}/v1/{route}", body)
        assert status == 403 and answer["error"]["code"] == "permission_denied", answer
        assert "uid 65534 may not" in answer["error"]["message"] and "--api-key-file" in answer["error"]["hint"]
    assert store(rig) == before
    log = rig.daemon.log_tail(400)
    assert "audit uid=65534 http=127.0.0.1:" in log and "op=load target=(request not read) result=denied" in log
    alive(rig)


def test_a_socket_group_member_may_change_adapters_over_keyless_http(attacked):
    rig, users = attacked
    status, answer = curl_as(users.member_uid, users.member_gid, f"{rig.http}/v1/load_lora_adapter",
                             {"lora_name": "poet/v1"}, groups=True)
    assert status == 200, answer
    assert f"audit uid={users.member_uid} http=127.0.0.1:" in rig.daemon.log_tail(400)


def test_nobody_cannot_pull_over_the_socket_and_its_huge_request_is_not_read(attacked):
    rig, _ = attacked
    before = store(rig)
    refused = attack(*NOBODY, rig.daemon.socket, "pull", "x" * ((100 << 20) >> 4))   # 6.25 MiB ref
    assert refused["kind"] == "permission_denied" and "uid 65534 may not pull" in refused["message"], refused
    assert store(rig) == before
    assert "op=pull target=(request not read) result=denied" in rig.daemon.log_tail(400)
    alive(rig)


def test_generation_from_a_folder_follows_the_socket_rule_and_is_audited(attacked):
    rig, _ = attacked
    folder = str(rig.root / "tiny" / "adapters" / "poet" / "v1")
    refused = attack(*NOBODY, rig.daemon.socket, "generate", json.dumps(["Hello", folder]))
    assert refused["kind"] == "permission_denied" and "adapter folder" in refused["message"], refused
    assert attack(*NOBODY, rig.daemon.socket, "generate", json.dumps(["Hello", "poet/v1"])) == {"ok": True}
    assert attack(0, 0, rig.daemon.socket, "generate", json.dumps(["Hello", folder])) == {"ok": True}
    log = rig.daemon.log_tail(400)
    assert f"audit uid=65534 pid=" in log and f"op=generate-folder target={folder} result=denied" in log
    assert f"op=generate-folder target={folder} result=ok" in log


def rss_bytes(pid: int) -> int:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) << 10
    raise AssertionError("no VmRSS")


def test_an_oversized_socket_message_is_refused_before_it_is_read(rig):
    """RESOURCE_EXHAUSTED from the message's length prefix (--max-message-size, 4 MiB): the
    client gets one line, the daemon does not grow by the message (a 64 MiB prompt grew it by
    4.3 GB before), and a normal request right after is served."""
    before = rss_bytes(rig.daemon.proc.pid)
    result = run_cli("run", "--socket", str(rig.daemon.socket), "-n", "1", "-",
                     input="word " * ((64 << 20) // 5), timeout=120)   # a 64 MiB prompt
    grown = rss_bytes(rig.daemon.proc.pid) - before
    print(f"\na 64 MiB Generate: daemon RSS grew by {grown / (1 << 20):.1f} MiB")
    assert result.returncode == 2, result.stderr
    assert "over the daemon's limit of 4194304" in result.stderr and "--max-message-size" in result.stderr
    assert "Traceback" not in result.stderr and len(result.stderr.splitlines()) == 2
    assert grown < 32 << 20
    alive(rig)
    rig.ok("run", "-n", "1", "Hello")


def test_a_flood_of_slow_connections_leaves_the_daemon_serving(rig):
    """300 connections that trickle a request head (under --http-max-connections, 512): while
    they are open, /health, the socket API and a running stream are served. Figures go to
    docs/reliability.md (printed with -s)."""
    host, port = rig.http.removeprefix("http://").split(":")
    flood = []
    for _ in range(300):
        conn = socket.create_connection((host, int(port)), timeout=10)
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Slow: ")
        flood.append(conn)
    stream = {}

    def run_stream():
        started = time.monotonic()
        stream["result"] = rig.cli("run", "-n", "64", "--temperature", "0", "Once upon a time")
        stream["s"] = time.monotonic() - started

    runner = threading.Thread(target=run_stream)
    runner.start()
    try:
        started = time.monotonic()
        health = httpx.get(f"{rig.http}/health", timeout=30)
        health_s = time.monotonic() - started
        started = time.monotonic()
        status = rig.cli("status", "--json")
        status_s = time.monotonic() - started
        runner.join(120)
    finally:
        for conn in flood:
            conn.close()
    assert health.status_code == 200 and status.returncode == 0
    assert stream["result"].returncode == 0, stream["result"].stderr
    print(f"\nflood of 300 trickling connections: /health {health_s * 1000:.0f} ms, socket status "
          f"{status_s * 1000:.0f} ms, a 64-token stream {stream['s']:.1f} s")
