"""The CLI believes a registry entry (and sends HF_TOKEN through the socket it names) only
when no one else could have written it: the entry's file and its folders up to the registry's
root owned by this user or root, writable by no one else. Otherwise the entry is ignored with
one warning line, and the client never connects to the socket it names."""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import threading

import pytest

from loractl import Client
from loractl.errors import DaemonNotRunning
from loractl.registry import ServiceDiscovery, ServiceRegistry


@pytest.fixture
def planted(tmp_path):
    """A registry entry, as a daemon writes it, naming a socket that counts who connects."""
    home = tmp_path / "h"
    home.mkdir(mode=0o700)
    bait = tmp_path / "bait.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(bait))
    listener.listen()
    listener.settimeout(0.2)
    connections = []
    stop = threading.Event()

    def accept():
        while not stop.is_set():
            try:
                connections.append(listener.accept()[0])
            except TimeoutError:
                pass

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    registry = ServiceRegistry(home=str(home))
    with registry.register_instance("loractl", "loractld", instance_id="bait",
                                    metadata={"socket": str(bait)}) as handle:
        handle.set_ready(True)
        yield home, registry.root, bait, connections
    stop.set()
    thread.join()
    listener.close()


def test_an_entry_only_this_user_can_write_is_believed(planted):
    home, root, bait, _ = planted
    client = Client(home=str(home))
    client._discover()
    assert client.socket_path == bait


@pytest.mark.parametrize("how", ["world-writable", "group-writable", "other owner"])
def test_an_entry_others_could_write_is_ignored_and_gets_no_token(planted, how, caplog, monkeypatch):
    home, root, bait, connections = planted
    folder = root / "loractl"
    if how == "other owner":
        if os.geteuid() != 0:
            pytest.skip("chown to another uid needs root")
        os.chown(folder, 65534, -1)
    else:
        os.chmod(folder, 0o777 if how == "world-writable" else 0o775)
    instance = ServiceDiscovery(root).list_instances("loractl", "loractld")[0]
    assert str(folder) in ServiceDiscovery(root).distrust(instance)
    monkeypatch.setenv("HF_TOKEN", "user-secret")

    async def pull():
        async with Client(home=str(home), timeout=5) as client:
            async for _ in client.pull("org/repo"):
                pass

    with caplog.at_level(logging.WARNING, logger="loractl.client"):
        with pytest.raises(DaemonNotRunning):   # the default socket: nothing listens there
            asyncio.run(pull())
    assert connections == []   # the planted socket never saw the client, nor its token
    warnings = [r.getMessage() for r in caplog.records if r.name == "loractl.client"]
    assert len(warnings) == 1 and "ignoring the daemon entry bait" in warnings[0] and "\n" not in warnings[0]
    assert "--socket PATH" in warnings[0]
