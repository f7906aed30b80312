"""loractld --dynamo with etcd discovery (what a fleet of several hosts uses): a real etcd (Debian's
etcd-server; skipped with the reason where it is not installed) and a real daemon on the tiny
model. Its registrations are etcd keys under the worker's lease: the base model and one card
per stored adapter, a card gone on rm, every key gone on SIGTERM."""

from __future__ import annotations

import base64
import json
import shutil
import subprocess
import time
import urllib.request

import pytest

from conftest import run_cli, start_daemon
from test_dynamo import ADAPTER, free_port, wait_for

pytest.importorskip("dynamo.runtime", reason="the Dynamo runtime is not installed (pip install '.[dynamo]')")


def _keys(endpoint: str, prefix: str = "v1/") -> list[str]:
    """Keys under ``prefix``, through etcd's v3 JSON gateway (no etcdctl needed)."""
    b64 = lambda s: base64.b64encode(s.encode()).decode()  # noqa: E731
    end = prefix[:-1] + chr(ord(prefix[-1]) + 1)
    request = urllib.request.Request(f"{endpoint}/v3/kv/range", data=json.dumps(
        {"key": b64(prefix), "range_end": b64(end), "keys_only": True}).encode())
    with urllib.request.urlopen(request, timeout=10) as response:
        return [base64.b64decode(kv["key"]).decode() for kv in json.loads(response.read()).get("kvs", [])]


@pytest.fixture
def etcd(tmp_path):
    binary = shutil.which("etcd")
    if binary is None:
        why = "etcd is not installed (Debian: apt-get install etcd-server)"
        print(f"SKIPPED: {why}")
        pytest.skip(why)
    client, peer = free_port(), free_port()
    endpoint = f"http://127.0.0.1:{client}"
    proc = subprocess.Popen([binary, "--data-dir", str(tmp_path / "etcd"), "--listen-client-urls", endpoint,
                             "--advertise-client-urls", endpoint, "--listen-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
                             "--initial-cluster", f"default=http://127.0.0.1:{peer}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 20
        while True:
            try:
                _keys(endpoint)
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, "etcd did not start"
                time.sleep(0.2)
        yield endpoint
    finally:
        proc.terminate()
        proc.wait(20)


def test_registrations_are_etcd_keys_that_follow_the_store_and_go_on_sigterm(home, demo, etcd):
    root = home / "dynamo-etcd"
    root.mkdir(exist_ok=True)
    daemon = start_daemon(root, "--dynamo", "--served-model-name", "tiny", model=str(demo / "model"), name="e",
                          env={"ETCD_ENDPOINTS": etcd})
    try:
        wait_for(lambda: "joined Dynamo (etcd discovery)" in daemon.log.read_text(), 30, "the join")
        cards = lambda: [k for k in _keys(etcd, "v1/mdc/") if k.startswith("v1/mdc/dynamo/loractl/generate/")]  # noqa: E731
        assert len(cards()) == 1  # the base model
        assert run_cli("pull", str(demo / "adapters" / ADAPTER), "--name", ADAPTER,
                       "--socket", str(daemon.socket)).returncode == 0
        wait_for(lambda: any(k.endswith("/sql-expert_v1") for k in cards()), 20, "the card in etcd")
        assert run_cli("rm", ADAPTER, "--socket", str(daemon.socket)).returncode == 0
        wait_for(lambda: len(cards()) == 1, 20, "the card to leave etcd")
        assert _keys(etcd, "v1/instances/")
    finally:
        code = daemon.stop()
    assert code == 0
    assert _keys(etcd) == []  # nothing left behind: no lease to wait out
