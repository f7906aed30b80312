"""The HTTP door's trust boundary and caps, without an engine: the real app on a real uvicorn
port over a core whose engine never comes (as tests/test_http_guard.py). Callers are real
processes, some run as another real user (nobody, 65534) through setpriv."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import subprocess
import time

import httpx
import pytest

from loractld.api.http import settings as http_settings
from loractld.trust.peers import may_change_state, tcp_peer_uid

NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
needs_root = pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv") or not shutil.which("curl"),
                                reason="needs root, setpriv and curl to call as another user")


async def _serve(settings: http_settings.HttpSettings, requests):
    """Run the real app (core without an engine) on a real port; return ``await requests(url)``."""
    from loractld.api.http.server import HttpFrontEnd
    from loractld.core import Core

    core = Core(socket_path="/nonexistent.sock", home="/nonexistent", served_model_name="demo")
    front = await HttpFrontEnd.start(core, settings, http_settings.bind("127.0.0.1", 0))
    try:
        return await requests(front.url)
    finally:
        await front.close()


async def curl(*args: str, user: list[str] = (), timeout_s: int = 10) -> tuple[int, dict]:
    """(status, JSON body); status 0 when no answer came within ``timeout_s``."""
    proc = await asyncio.create_subprocess_exec(*user, "curl", "-s", "-m", str(timeout_s), "-w", "\n%{http_code}", *args,
                                                stdout=subprocess.PIPE)
    out, _ = await proc.communicate()
    body, _, code = out.decode().rpartition("\n")
    return int(code), json.loads(body) if body.startswith("{") else {"raw": body}


def test_the_socket_rule():
    assert may_change_state(0, None, None) and may_change_state(os.getuid(), None, None)
    assert not may_change_state(65534, None, None) and not may_change_state(65534, 65534, 4242)
    assert may_change_state(65534, 4242, 4242)  # the kernel said its group is the socket's


def test_the_kernel_names_a_loopback_peer():
    with socket.create_server(("127.0.0.1", 0)) as server, socket.create_connection(server.getsockname()) as client:
        accepted, peer = server.accept()
        with accepted:
            assert tcp_peer_uid(peer, accepted.getsockname()) == os.getuid()
            assert tcp_peer_uid(("127.0.0.1", 1), accepted.getsockname()) is None   # no such connection
            assert tcp_peer_uid(("192.0.2.1", peer[1]), accepted.getsockname()) is None   # not loopback


@needs_root
def test_keyless_http_changes_state_only_for_whom_the_socket_would(caplog):
    """nobody may list and reach generation, but not load or unload; root (the daemon's user
    here) gets past the guard. Refusals: 403 in the OpenAI error schema, one line, hint naming
    --api-key-file, an audit line with the uid."""
    body = json.dumps({"lora_name": "x", "lora_path": "/tmp"})

    async def requests(url):
        post = ["-H", "Content-Type: application/json", "-d", body]
        return {
            "nobody load": await curl(*post, f"{url}/v1/load_lora_adapter", user=NOBODY),
            "nobody unload": await curl(*post, f"{url}/v1/unload_lora_adapter", user=NOBODY),
            "nobody other post": await curl(*post, f"{url}/v1/models", user=NOBODY),
            "nobody list": await curl(f"{url}/version", user=NOBODY),
            "nobody generate": await curl("-H", "Content-Type: application/json", "-d", '{"model":"demo","prompt":"a",'
                                          '"n":999}', f"{url}/v1/completions", user=NOBODY),
            "root unload": await curl("-H", "Content-Type: application/json", "-d", '{"lora_name": "x"}',
                                      f"{url}/v1/unload_lora_adapter", timeout_s=2),
        }

    with caplog.at_level("INFO", logger="loractld.audit"):
        got = asyncio.run(_serve(http_settings.HttpSettings(), requests))
    for name in ("nobody load", "nobody unload", "nobody other post"):
        status, answer = got[name]
        assert status == 403 and answer["error"]["code"] == "permission_denied", (name, got[name])
        assert answer["error"]["message"].startswith("uid 65534 may not") and "\n" not in answer["error"]["message"]
        assert "--api-key-file" in answer["error"]["hint"] and answer["error"]["type"] == "permission_error"
    assert got["nobody list"][0] == 200
    assert got["nobody generate"][0] == 400  # reaches the request checks (n over the cap): not a 403
    assert got["root unload"][0] == 0        # past the guard: waits for the engine-less core
    audit = [r.getMessage() for r in caplog.records if r.name == "loractld.audit"]
    assert any(line.startswith("audit uid=65534 http=127.0.0.1:") and "op=load" in line and line.endswith("denied")
               for line in audit), audit
    assert any(line.startswith("audit uid=0 http=127.0.0.1:") and "op=evict target=x" in line for line in audit)


@needs_root
def test_a_forged_forwarded_for_never_renames_the_caller(caplog):
    """uvicorn believes X-Forwarded-For from 127.0.0.1 by default: nobody could write any address
    into the audit line (and lose its uid). Without --http-forwarded-allow-ips, no proxy header
    is read; with it, the named proxy's header is believed, as the flag says."""
    post = ["-H", "Content-Type: application/json", "-H", "X-Forwarded-For: 203.0.113.77", "-d",
            json.dumps({"lora_name": "x", "lora_path": "/tmp"})]

    async def requests(url):
        return await curl(*post, f"{url}/v1/load_lora_adapter", user=NOBODY)

    with caplog.at_level("INFO", logger="loractld.audit"):
        status, _ = asyncio.run(_serve(http_settings.HttpSettings(), requests))
    audit = [r.getMessage() for r in caplog.records if r.name == "loractld.audit"]
    assert status == 403
    assert any(line.startswith("audit uid=65534 http=127.0.0.1:") for line in audit), audit
    assert not any("203.0.113.77" in line for line in audit), audit
    caplog.clear()
    with caplog.at_level("INFO", logger="loractld.audit"):
        asyncio.run(_serve(http_settings.HttpSettings(forwarded_allow_ips="127.0.0.1"), requests))
    audit = [r.getMessage() for r in caplog.records if r.name == "loractld.audit"]
    assert any("http=203.0.113.77:" in line for line in audit), audit  # a named proxy is believed


def test_with_a_key_its_holder_may_change_state():
    async def requests(url):
        async with httpx.AsyncClient(base_url=url, timeout=2) as client:
            try:
                return (await client.post("/v1/unload_lora_adapter", json={"lora_name": "x"},
                                          headers={"Authorization": "Bearer k"})).status_code
            except httpx.ReadTimeout:
                return "past the guard"  # waits for the engine-less core

    assert asyncio.run(_serve(http_settings.HttpSettings(api_key=b"k"), requests)) == "past the guard"


def test_prompts_times_n_is_capped():
    async def requests(url):
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            many = await client.post("/v1/completions", json={"model": "demo", "prompt": ["a"] * 9, "n": 2})
            one = await client.post("/v1/completions", json={"model": "demo", "prompt": ["a"] * 20000})
            return many, one

    many, one = asyncio.run(_serve(http_settings.HttpSettings(max_choices=16), requests))
    for answer in (many, one):
        assert answer.status_code == 400 and answer.json()["error"]["code"] == "too_many_choices"
        assert "--http-max-choices" in answer.json()["error"]["hint"]
    assert "9 prompt(s) x n=2 asks for 18 generations" in many.json()["error"]["message"]


def _raw(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").split(":")
    return socket.create_connection((host, int(port)), timeout=10)


RESET = b"(reset)"


def _answer(sock: socket.socket, reset: bytes = RESET) -> bytes:
    """What came until the close; ``reset`` after it when the close was a reset."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        chunks.append(reset)
    return b"".join(chunks)




def test_slow_and_oversized_requests_are_cut_and_health_answers_again():
    """A bounded flood: 3x the connection cap of trickling heads, a head over the size cap, a
    trickled body. Each connection past the cap makes room by closing the slow head that has
    waited longest (503, or a reset where the close finds its bytes unread): never more than
    the cap are open; the last 8 trickled heads are closed after the header timeout; /health
    answers afterwards. (A new client among slow heads at the cap, and 503 at once when no
    connection is waiting for a head: tests/test_http_caps.py.)"""
    settings = http_settings.HttpSettings(max_connections=8, header_timeout_s=0.5, body_timeout_s=0.5,
                                          max_header_bytes=4096)

    async def requests(url):
        def flood():
            socks = [_raw(url) for _ in range(24)]
            for sock in socks:
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n")   # never finished
            time.sleep(0.1)
            refused = [_answer(sock) for sock in socks[:16]]   # closed to make room for the 8 after them
            started = time.monotonic()
            closed = [_answer(sock) for sock in socks[16:]]    # the server closes them, unanswered
            cut_after = time.monotonic() - started
            big = _raw(url)
            big.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Pad: " + b"a" * 4096)
            too_big = _answer(big)
            slow = _raw(url)
            slow.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\nContent-Type: application/json\r\n"
                         b"Content-Length: 100\r\n\r\n{")
            return refused, closed, cut_after, too_big, _answer(slow)

        refused, closed, cut_after, too_big, slow_body = await asyncio.to_thread(flood)
        async with httpx.AsyncClient(base_url=url, timeout=10) as client:
            health = (await client.get("/health")).json()
        return refused, closed, cut_after, too_big, slow_body, health

    refused, closed, cut_after, too_big, slow_body, health = asyncio.run(_serve(settings, requests))
    assert all(r.startswith(b"HTTP/1.1 503 ") and b"too_many_connections" in r or r == RESET for r in refused), refused
    assert closed == [b""] * 8 and cut_after < 2, cut_after
    assert too_big.startswith(b"HTTP/1.1 431 ") and b"--http-max-header-size" in too_big
    assert slow_body.startswith(b"HTTP/1.1 408 ") and b"--http-body-timeout" in slow_body
    assert health["error"]["message"] == "the engine is starting"   # answered: the caps let go
