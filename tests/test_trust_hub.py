"""Credentials stay with their endpoint: the daemon's own Hub token (HF_TOKEN, or the token
huggingface_hub stored) goes only to the daemon's own Hub endpoint. A caller who names another
endpoint brings its own token or none. The real HubSource and huggingface_hub against two real
HTTP listeners that record the Authorization header of every request."""

from __future__ import annotations

import threading

import pytest

from hub_stub import HubStub
from loractld.store.sources import HubSource

FILES = {"adapter_config.json": b'{"peft_type": "LORA"}', "adapter_model.safetensors": b"weights"}


@pytest.fixture
def hubs(monkeypatch, tmp_path):
    """(the daemon's own Hub, another one): the daemon runs with HF_ENDPOINT=own and HF_TOKEN set."""
    with HubStub() as own, HubStub() as other:
        for hub in (own, other):
            hub.add_commit("org/lora", FILES)
        monkeypatch.setenv("HF_ENDPOINT", own.endpoint)
        monkeypatch.setenv("HF_TOKEN", "daemon-secret")
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))  # no token stored by an earlier login
        yield own, other


def pull(tmp_path, *, token: str | None, endpoint: str | None) -> None:
    source = HubSource()
    resolved = source.resolve("org/lora", None, token=token, endpoint=endpoint)
    dest = tmp_path / "dest"
    dest.mkdir(exist_ok=True)
    source.download_to_disk(resolved, dest, lambda *_: None, threading.Event(), token=token, endpoint=endpoint)
    assert (dest / "adapter_model.safetensors").read_bytes() == b"weights"


def sent(hub: HubStub) -> set[str | None]:
    """The Authorization headers of the requests for the repo (huggingface_hub also asks the
    endpoint for things of its own, without a token)."""
    assert hub.requests, "the pull never reached this Hub"
    return {auth for (_, path), auth in zip(hub.requests, hub.authorizations) if "org/lora" in path}


def test_the_daemons_token_goes_to_its_own_endpoint(hubs, tmp_path):
    own, _ = hubs
    pull(tmp_path, token=None, endpoint=None)
    pull(tmp_path, token=None, endpoint=own.endpoint + "/")  # the same Hub, named by the caller
    assert sent(own) == {"Bearer daemon-secret"}


def test_a_caller_naming_another_endpoint_gets_no_token_of_the_daemons(hubs, tmp_path):
    _, other = hubs
    pull(tmp_path, token=None, endpoint=other.endpoint)
    assert sent(other) == {None}


def test_a_caller_brings_its_own_token_anywhere(hubs, tmp_path):
    _, other = hubs
    pull(tmp_path, token="caller-secret", endpoint=other.endpoint)
    assert sent(other) == {"Bearer caller-secret"}
