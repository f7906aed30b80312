"""Adapters on demand (#24 item 3, what a Dynamo fleet's placement needs of a worker, for every
door): with ``--auto-pull`` a request naming a Hub reference the store lacks pulls it, then runs
on it with the reference's tokens; a keyless HTTP client never makes the daemon download; a
stored adapter is served through a Hub outage; a reference the Hub cannot give is refused with
the pull's cause. One daemon, its Hub a local stub (tests/hub_stub.py)."""

from __future__ import annotations

import asyncio
import json
import urllib.error
import urllib.request

import pytest

from conftest import collect, run_cli, start_daemon
from hub_stub import HubStub
from loractl import Client
from loractl.errors import LoractlError

ADAPTERS = "adapters"


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


def weight_downloads(hub, repo) -> int:
    return sum(1 for method, path in hub.requests if method == "GET" and path.startswith(f"/{repo}/resolve/")
               and path.endswith("adapter_model.safetensors"))


async def _generate(socket, lora: str) -> dict:
    async with Client(socket) as client:
        return await collect(client, messages=[{"role": "user", "content": "hi"}], lora=lora, max_tokens=8,
                             min_tokens=8, temperature=0.0)


def test_a_missing_hub_reference_is_pulled_on_demand_where_the_door_allows_it(home, demo, reference):
    root = home / "ondemand"
    root.mkdir(exist_ok=True)
    (root / "tiny").exists() or (root / "tiny").symlink_to(demo)
    hub = HubStub().start()
    hub.add_commit("acme/sql-lora", files_of(demo / ADAPTERS / "sql-expert" / "v1"))
    hub.add_commit("acme/poet-lora", files_of(demo / ADAPTERS / "poet" / "v1"))
    daemon = start_daemon(root, "--auto-pull", "--http", "127.0.0.1:0", name="od",
                          env={"HF_ENDPOINT": hub.endpoint})
    try:
        # The socket: pulled, then generated on, exactly as the reference with that adapter.
        got = asyncio.run(_generate(daemon.socket, "acme/sql-lora"))
        expected = reference.greedy(reference.chat_ids("hi"), demo / ADAPTERS / "sql-expert" / "v1", 8, 8)
        assert got["ids"] == expected
        assert weight_downloads(hub, "acme/sql-lora") == 1
        listed = json.loads(run_cli("ls", "--json", "--socket", str(daemon.socket)).stdout)
        assert "acme/sql-lora" in {a["name"] for a in listed}

        # Keyless HTTP: the same kind of name is an unknown model, and nothing is downloaded.
        http = json.loads(run_cli("status", "--json", "--socket", str(daemon.socket)).stdout)["http"]
        body = {"model": "acme/poet-lora", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        request = urllib.request.Request(f"{http}/v1/chat/completions", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=60)
        assert refused.value.code == 404
        assert not [p for _, p in hub.requests if "poet-lora" in p]

        # A Hub outage: the stored adapter is still served, without a network call; a missing
        # one is refused naming the reference and the pull's cause.
        hub.stop()
        again = asyncio.run(_generate(daemon.socket, "acme/sql-lora"))
        assert again["ids"] == expected
        with pytest.raises(LoractlError) as failed:
            asyncio.run(_generate(daemon.socket, "acme/poet-lora"))
        assert "'acme/poet-lora' is not in the store and pulling it failed" in failed.value.message
    finally:
        hub.stop()
        daemon.stop()
