"""The HTTP API's doors without an engine: what refuses to start, and what the guard in front
of the routes lets through. A real uvicorn on a real port serves the real app over a core whose
engine never comes (as while the daemon starts), so no vLLM is needed here."""

from __future__ import annotations

import asyncio
import socket
import subprocess

import httpx
import pytest

from conftest import BIN
from loractl.errors import InvalidRequest, LoractlError
from loractld import config
from loractld.api.http import settings as http_settings
from loractld.main import build_parser


def parsed(*argv: str):
    return http_settings.settings_from(config.resolve(build_parser, ["--model", "demo", *argv]))


def test_the_api_is_off_unless_asked_for():
    assert parsed().address is None


@pytest.mark.parametrize("address, expected", [("127.0.0.1:8000", ("127.0.0.1", 8000)), (":9000", ("127.0.0.1", 9000)),
                                               ("[::1]:8001", ("::1", 8001)), ("localhost:0", ("localhost", 0))])
def test_addresses(address, expected):
    assert parsed("--http", address).address == expected


@pytest.mark.parametrize("address", ["0.0.0.0:8000", "[::]:8000", "192.0.2.1:8000"])
def test_beyond_loopback_needs_an_api_key(address, tmp_path):
    with pytest.raises(InvalidRequest, match="reachable from other machines without an API key"):
        parsed("--http", address)
    key = tmp_path / "key"
    key.write_text("s3cret\n")
    key.chmod(0o600)
    assert parsed("--http", address, "--api-key-file", str(key)).api_key == b"s3cret"


def test_the_daemon_refuses_before_starting_anything():
    result = subprocess.run([str(BIN / "loractld"), "--model", "demo", "--http", "0.0.0.0:8000"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 2 and lines[0].startswith("loractld: error: ") and "hint: Pass --api-key-file" in lines[1]


@pytest.mark.parametrize("content, needle", [("", "exactly one non-empty line"), ("a\nb\n", "exactly one"),
                                             (None, "cannot read the API key file")])
def test_bad_key_files(tmp_path, content, needle):
    key = tmp_path / "key"
    if content is not None:
        key.write_text(content)
    with pytest.raises(InvalidRequest, match=needle):
        parsed("--http", "127.0.0.1:0", "--api-key-file", str(key))


@pytest.mark.parametrize("address", ["8000", "host:port", "127.0.0.1:99999"])
def test_bad_addresses(address):
    with pytest.raises(InvalidRequest, match="not an address to listen on"):
        parsed("--http", address)


def test_config_file_keys(tmp_path):
    key = tmp_path / "key"
    key.write_text("k\n")
    file = tmp_path / "loractld.toml"
    file.write_text(f'model = "demo"\nhttp = "127.0.0.1:8123"\napi-key-file = "{key}"\n'
                    'http-max-body = "1MiB"\nhttp-max-concurrency = 7\nserved-model-name = "tiny"\n')
    args = config.resolve(build_parser, ["--config", str(file)])
    settings = http_settings.settings_from(args)
    assert (settings.address, settings.api_key, settings.max_body_bytes, settings.max_concurrency) == \
        (("127.0.0.1", 8123), b"k", 1 << 20, 7)
    assert args.served_model_name == "tiny"


def test_a_taken_port_is_a_clear_error():
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with pytest.raises(LoractlError, match="cannot listen on http://127.0.0.1:") as caught:
            http_settings.bind("127.0.0.1", taken.getsockname()[1])
    assert "another --http address" in caught.value.hint


async def _serve(settings: http_settings.HttpSettings, requests):
    """Run the real app (core without an engine) on a real port; return ``requests(url)``."""
    from loractld.api.http.server import HttpFrontEnd
    from loractld.core import Core

    core = Core(socket_path="/nonexistent.sock", home="/nonexistent", served_model_name="demo")
    front = await HttpFrontEnd.start(core, settings, http_settings.bind("127.0.0.1", 0))
    try:
        async with httpx.AsyncClient(base_url=front.url, timeout=10) as client:
            return await requests(client)
    finally:
        await front.close()


def test_without_a_key_only_loopback_host_names_get_through():
    """DNS rebinding: a web page on evil.example that resolves to 127.0.0.1 sends Host: evil.example."""
    async def requests(client):
        return {host: (await client.get("/version", headers={"Host": host})).status_code
                for host in ("localhost:1234", "127.0.0.1", "[::1]:80", "127.0.0.5:8000", "evil.example",
                             "evil.example:8000", "localhost.evil.example")}

    codes = asyncio.run(_serve(http_settings.HttpSettings(), requests))
    assert codes == {"localhost:1234": 200, "127.0.0.1": 200, "[::1]:80": 200, "127.0.0.5:8000": 200,
                     "evil.example": 403, "evil.example:8000": 403, "localhost.evil.example": 403}


def test_with_a_key_every_route_but_health_wants_it():
    async def requests(client):
        bearer = {"Authorization": "Bearer k3y"}
        return {
            "health": (await client.get("/health")).status_code,            # starting: 503, but no 401
            "no key": (await client.get("/version")).status_code,
            "wrong key": (await client.get("/version", headers={"Authorization": "Bearer k3z"})).status_code,
            "not bearer": (await client.get("/version", headers={"Authorization": "Basic k3y"})).status_code,
            "key": (await client.get("/version", headers=bearer)).status_code,
            "key, other host": (await client.get("/version", headers={**bearer, "Host": "api.example"})).status_code,
            "unknown route": (await client.get("/v2/x", headers=bearer)).json()["error"]["code"],
            "starting": (await client.get("/health")).json()["error"]["message"],
        }

    got = asyncio.run(_serve(http_settings.HttpSettings(api_key=b"k3y"), requests))
    assert got == {"health": 503, "no key": 401, "wrong key": 401, "not bearer": 401, "key": 200,
                   "key, other host": 200, "unknown route": "not_found", "starting": "the engine is starting"}


def test_a_daemon_without_http_never_imports_the_http_stack():
    code = ("import sys\nimport loractld.main\n"
            "print('HEAVY', sorted(m for m in sys.modules if m.split('.')[0] in ('fastapi', 'uvicorn', 'starlette')))\n")
    out = subprocess.run([str(BIN / "python"), "-c", code], capture_output=True, text=True, timeout=60).stdout
    assert "HEAVY []" in out, out
