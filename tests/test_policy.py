"""One policy point (core.policy): a state change a request implies — an auto-pull, a folder —
is decided by the core for the request's caller, whatever door it came through, and audited
there. The pull itself is a recording stand-in here (the real one, through a real daemon and a
Hub stub, is tests/test_dynamo_on_demand.py); what is tested is who gets it."""

from __future__ import annotations

import asyncio
import logging
import os
from types import SimpleNamespace

import pytest

from loractl.errors import PermissionDenied
from loractld.core.policy import Caller, may_change
from loractld.generation import GenerationRequest
from loractld.core import ondemand


class _Core:
    def __init__(self) -> None:
        self.auto_pull = True
        self.socket_gid = None
        self.pulled: list[str] = []
        self.catalog = SimpleNamespace(store=SimpleNamespace(has=lambda name: False))

    async def pull(self, ref):
        self.pulled.append(ref)
        yield SimpleNamespace(adapter=SimpleNamespace(name="acme/sql-lora"), stage="done")


def _ask(core, caller):
    return asyncio.run(ondemand.adapter_name(core, GenerationRequest(prompt="x", lora="acme/sql-lora",
                                                                     caller=caller)))


def test_a_socket_peer_the_rule_refuses_never_makes_the_daemon_pull(caplog):
    """--socket-group with --auto-pull: a peer who may connect but not pull was refused Pull,
    yet Generate(lora="org/repo") pulled for it, unaudited (issue 37, finding 5)."""
    core = _Core()
    with caplog.at_level("INFO", logger="loractld.audit"), pytest.raises(PermissionDenied) as refused:
        _ask(core, Caller("socket", uid=65534, gid=65534, pid=7))
    assert core.pulled == []
    assert "uid 65534 may not make the daemon pull 'acme/sql-lora'" in refused.value.message
    assert "loractl pull" in refused.value.hint
    lines = [r.getMessage() for r in caplog.records if r.name == "loractld.audit"]
    assert lines == ["audit uid=65534 pid=7 op=auto-pull target=acme/sql-lora result=denied"]


@pytest.mark.parametrize("caller", [Caller("socket", uid=os.getuid(), gid=os.getgid(), pid=1),
                                    Caller("http", key_holder=True), Caller("dynamo", fleet=True)],
                         ids=["daemon's user", "API key holder", "fleet placement"])
def test_who_the_rule_allows_pulls_and_is_audited(caller, caplog):
    core = _Core()
    with caplog.at_level("INFO", logger="loractld.audit"):
        assert _ask(core, caller) == "acme/sql-lora"
    assert core.pulled == ["acme/sql-lora"]
    lines = [r.getMessage() for r in caplog.records if r.name == "loractld.audit"]
    assert len(lines) == 1 and lines[0].endswith("op=auto-pull target=acme/sql-lora result=ok")


@pytest.mark.parametrize("caller", [None, Caller("http")], ids=["no caller", "keyless HTTP"])
def test_an_unidentified_caller_never_downloads(caller, caplog):
    core = _Core()
    with caplog.at_level("INFO", logger="loractld.audit"):
        assert _ask(core, caller) == "acme/sql-lora"   # then: not found, as any unknown name
    assert core.pulled == [] and not [r for r in caplog.records if r.name == "loractld.audit"]


def test_the_rule():
    assert not may_change(None, None) and not may_change(Caller("http"), None)
    assert may_change(Caller("http", key_holder=True), None)
    assert may_change(Caller("socket", uid=0), None) and not may_change(Caller("socket", uid=65534, gid=1), None)
    assert may_change(Caller("socket", uid=65534, gid=4242), 4242)   # the kernel says: the socket's group
    assert not may_change(Caller("dynamo", fleet=True), None)        # a placement grants a pull only
