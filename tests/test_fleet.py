"""Two hosts as a Dynamo fleet (#24 item 4): a real etcd, Dynamo's real frontend and two loractl
daemons on the tiny model, each daemon in a network namespace of its own (tests/fleet_rig.py),
so that everything between them crosses a network as it would between machines.

Daemon B holds sql-expert/v1 (pulled from the Hub, here a local stub); daemon A holds nothing.
Through the frontend's OpenAI API: every request for the adapter reaches B and answers with the
HF + PEFT reference's text; base requests are served by both. Then B is killed with SIGKILL: its
registrations expire with its etcd lease, the frontend stops listing the adapter and refuses a
request for it by name; Dynamo's LoRA management loads it on A (``POST /v1/loras`` with the Hub
source, which A pulls with the store's checks) and the same request is answered by A with the
same text. Bounded at about 3 minutes; skipped, with the reason printed, only where this machine
cannot make network namespaces."""

from __future__ import annotations

import concurrent.futures
import json
import re
import signal
import time
from pathlib import Path

import pytest

from conftest import run_cli, start_daemon
from fleet_rig import Rig, frontend_python, free_port, models, post, wait_for, why_no_namespaces
from hub_stub import HubStub

pytest.importorskip("dynamo.runtime", reason="the Dynamo runtime is not installed (pip install '.[dynamo]')")

ADAPTER = "sql-expert/v1"
SOURCE = "acme/sql-lora"
MAX_NEW = 8
QUESTION = "Write a query that counts the users."
JOINED = r"joined Dynamo .* instance (\d+)"


@pytest.fixture(scope="module")
def fleet(home: Path, demo: Path):
    why = why_no_namespaces()
    if why:
        print(f"SKIPPED: {why}")
        pytest.skip(why)
    python = frontend_python()
    assert python, "Dynamo's frontend is not installed: bash scripts/setup.sh makes .venv-frontend"
    root = home / "fleet"
    root.mkdir(exist_ok=True)
    with Rig(root, hosts=2) as rig:
        hub = HubStub(host=rig.gateway(1)).start()
        adapter = demo / "adapters" / ADAPTER
        hub.add_commit(SOURCE, {p.name: p.read_bytes() for p in adapter.iterdir() if p.is_file()})
        ports = {1: free_port(), 2: free_port()}

        def start(host: int):
            sub = root / f"host{host}"
            sub.mkdir(exist_ok=True)
            env = {**rig.dynamo_env(host), "DYN_SYSTEM_PORT": str(ports[host]), "HF_ENDPOINT": hub.endpoint}
            # The fleet's hosts reach each other's system port (/v1/loras) on their own addresses.
            daemon = start_daemon(sub, "--dynamo", "--dynamo-discovery", "etcd", "--served-model-name", "tiny",
                                  "--auto-pull", "--dynamo-system-host", "0.0.0.0", name=f"host{host}", model=str(demo / "model"), env=env,
                                  prefix=["ip", "netns", "exec", rig.ns(host)])
            rig.procs.append(daemon.proc)  # the rig kills it, and its engine, whatever happens
            return daemon

        try:
            with concurrent.futures.ThreadPoolExecutor(2) as pool:
                a, b = pool.map(start, [1, 2])
            for daemon in (a, b):
                wait_for(lambda: re.search(JOINED, daemon.log.read_text()), 30, "a daemon to join Dynamo")
            pulled = run_cli("pull", SOURCE, "--name", ADAPTER, "--socket", str(b.socket))
            assert pulled.returncode == 0, pulled.stderr
            port = free_port()
            rig.frontend(python, port)
            wait_for(lambda: ADAPTER in models(port), 90, "the frontend to list B's adapter")
            yield {"rig": rig, "hub": hub, "a": a, "b": b, "port": port, "system_port": ports}
        finally:
            hub.stop()


def chat(port: int, model: str) -> tuple[int, dict]:
    return post(f"http://127.0.0.1:{port}/v1/chat/completions",
                {"model": model, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": MAX_NEW,
                 "temperature": 0})


def served(daemon, name: str) -> int:
    """Requests the daemon has run on adapter ``name`` (0 where it does not hold it)."""
    shown = run_cli("show", name, "--json", "--socket", str(daemon.socket))
    return int(json.loads(shown.stdout)["requests"]) if shown.returncode == 0 else 0


def generated(daemon) -> float:
    text = run_cli("metrics", "--socket", str(daemon.socket)).stdout
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:generation_tokens_total"))


@pytest.fixture(scope="module")
def expected(fleet, demo, reference) -> str:
    ids = reference.greedy(reference.chat_ids(QUESTION), demo / "adapters" / ADAPTER, MAX_NEW)
    return reference.text(ids)


def test_requests_for_an_adapter_go_to_the_host_holding_it_and_base_requests_to_both(fleet, expected):
    a, b, port = fleet["a"], fleet["b"], fleet["port"]
    assert served(a, ADAPTER) == 0 and served(b, ADAPTER) == 0
    for _ in range(6):
        status, answer = chat(port, ADAPTER)
        assert status == 200, answer
        assert answer["choices"][0]["message"]["content"] == expected
    assert served(b, ADAPTER) == 6
    assert run_cli("show", ADAPTER, "--socket", str(a.socket)).returncode != 0  # A never got it

    before = {"a": generated(a), "b": generated(b)}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        answers = list(pool.map(lambda _: chat(port, "tiny"), range(8)))
    assert all(status == 200 for status, _ in answers), answers
    grew = {"a": generated(a) - before["a"], "b": generated(b) - before["b"]}
    assert grew["a"] > 0 and grew["b"] > 0, f"base requests did not reach both hosts: {grew}"


def test_when_b_dies_its_cards_expire_and_a_serves_the_adapter_after_pulling_it(fleet, expected):
    rig, hub, a, b, port = fleet["rig"], fleet["hub"], fleet["a"], fleet["b"], fleet["port"]
    b_instance = int(re.search(JOINED, b.log.read_text()).group(1))
    tag = f"{b_instance:x}"
    assert [k for k in rig.keys() if tag in k], "B's registrations are not in etcd"

    killed = time.monotonic()
    b.proc.send_signal(signal.SIGKILL)  # no goodbye: only the lease's expiry removes B
    b.proc.wait(10)
    wait_for(lambda: not [k for k in rig.keys() if tag in k], 60, "B's keys to expire with its lease")
    expiry = time.monotonic() - killed
    wait_for(lambda: ADAPTER not in models(port), 30, "the frontend to drop B's adapter")
    print(f"B's keys expired {expiry:.1f} s after SIGKILL")
    assert "tiny" in models(port)  # A still serves the base model

    status, refused = chat(port, ADAPTER)
    assert (status, refused.get("message")) == (404, "Model not found"), refused  # Dynamo's own words

    downloads = len(hub.requests)
    status, loaded = post(f"http://{rig.address(1)}:{fleet['system_port'][1]}/v1/loras",
                          {"lora_name": ADAPTER, "source": {"uri": f"hf://{SOURCE}"}})
    assert status == 200 and loaded["status"] == "success", loaded
    assert [p for _, p in hub.requests[downloads:] if "adapter_model.safetensors" in p], "A did not pull from the Hub"
    wait_for(lambda: ADAPTER in models(port), 30, "the frontend to list A's card")
    status, answer = chat(port, ADAPTER)
    assert status == 200, answer
    assert answer["choices"][0]["message"]["content"] == expected
    assert served(a, ADAPTER) == 1
