"""Pulling from the Hub: the real huggingface_hub client against a Hub stand-in on 127.0.0.1."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time

import pytest

from conftest import BIN, collect, run_cli, sigint_as_at_a_terminal
from hub_stub import HubStub
from loractl import Client
from test_errors import assert_one_error

ADAPTERS = "adapters"


def files_of(folder) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def hub(demo):
    """acme/sql-lora: an old commit with sql-expert, main with python-expert; acme/multi: a subfolder."""
    with HubStub() as stub:
        stub.old_sha = stub.add_commit("acme/sql-lora", files_of(demo / ADAPTERS / "sql-expert" / "v1"))
        stub.new_sha = stub.add_commit("acme/sql-lora", files_of(demo / ADAPTERS / "python-expert" / "v1"))
        stub.add_commit("acme/multi", {f"poet/{k}": v for k, v in files_of(demo / ADAPTERS / "poet" / "v1").items()}
                        | {"README.md": b"two adapters"})
        yield stub


async def pull_events(socket, ref, **kwargs) -> list[dict]:
    async with Client(socket) as client:
        return [event async for event in client.pull(ref, **kwargs)]


def weight_downloads(hub, repo) -> int:
    return sum(1 for method, path in hub.requests
               if method == "GET" and path.startswith(f"/{repo}/resolve/") and path.endswith("adapter_model.safetensors"))


def test_pull_streams_progress_and_generates_like_the_reference(daemon, hub, demo, reference, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    events = asyncio.run(pull_events(daemon.socket, "acme/sql-lora"))
    stages = [e["stage"] for e in events]
    assert stages[0] == "resolving" and stages[-1] == "done"
    assert stages.index("verifying") < stages.index("installing") < len(stages) - 1
    downloads = [e for e in events if e["stage"] == "downloading"]
    sizes = {p.name: p.stat().st_size for p in (demo / ADAPTERS / "python-expert" / "v1").iterdir()}
    for file in ("adapter_config.json", "adapter_model.safetensors"):
        last = [e for e in downloads if e["file"] == file][-1]
        assert int(last["done_bytes"]) == int(last["total_bytes"]) == sizes[file]
    adapter = events[-1]["adapter"]
    assert adapter["name"] == "acme/sql-lora" and adapter["source"] == "hf"
    assert adapter["revision"] == hub.new_sha and adapter["ref"] == "hf://acme/sql-lora"

    async def generate():
        async with Client(daemon.socket) as client:
            return await collect(client, messages=[{"role": "user", "content": "hi"}], lora="acme/sql-lora",
                                 max_tokens=16, min_tokens=16, temperature=0.0)

    got = asyncio.run(generate())
    ids = reference.chat_ids("hi")
    assert got["ids"] == reference.greedy(ids, demo / ADAPTERS / "python-expert" / "v1", 16, 16)


def test_pull_again_at_the_same_revision_is_a_no_op(daemon, hub, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    asyncio.run(pull_events(daemon.socket, "acme/sql-lora", name="noop/v1"))
    before = weight_downloads(hub, "acme/sql-lora")
    events = asyncio.run(pull_events(daemon.socket, "acme/sql-lora", name="noop/v1"))
    assert events[-1]["stage"] == "up_to_date"
    assert weight_downloads(hub, "acme/sql-lora") == before


@pytest.mark.parametrize("how", ["flag", "ref"])
def test_pull_a_revision(daemon, hub, demo, reference, how):
    name = f"old-{how}/v1"
    args = (["pull", "acme/sql-lora", "--revision", hub.old_sha] if how == "flag"
            else ["pull", f"hf://acme/sql-lora@{hub.old_sha}"])
    result = run_cli(*args, "--name", name, "--socket", str(daemon.socket), env={"HF_ENDPOINT": hub.endpoint})
    assert result.returncode == 0, result.stderr
    info = json.loads(run_cli("show", name, "--json", "--socket", str(daemon.socket)).stdout)
    assert info["revision"] == hub.old_sha
    out = run_cli("run", "--lora", name, "-t", "0", "-n", "12", "hi", "--socket", str(daemon.socket))
    expected = reference.greedy(reference.chat_ids("hi"), demo / ADAPTERS / "sql-expert" / "v1", 12)
    assert out.stdout == reference.text(expected) + "\n"


def test_pull_a_subfolder_with_a_derived_name(daemon, hub):
    result = run_cli("pull", "hf://acme/multi/poet", "--socket", str(daemon.socket), env={"HF_ENDPOINT": hub.endpoint})
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("success: acme/multi-poet")


def test_a_new_revision_replaces_the_old_one(daemon, hub, demo, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    hub.add_commit("acme/moving", files_of(demo / ADAPTERS / "sql-expert" / "v1"))
    first = asyncio.run(pull_events(daemon.socket, "acme/moving"))[-1]["adapter"]
    newer = hub.add_commit("acme/moving", files_of(demo / ADAPTERS / "translator" / "v1"))
    second = asyncio.run(pull_events(daemon.socket, "acme/moving"))[-1]["adapter"]
    assert second["revision"] == newer != first["revision"]
    assert second["rank"] == 16 and not os.path.exists(first["path"])


def test_two_clients_pulling_the_same_name_at_once(daemon, hub, demo, monkeypatch):
    monkeypatch.setenv("HF_ENDPOINT", hub.endpoint)
    hub.add_commit("acme/race", files_of(demo / ADAPTERS / "poet" / "v1"))

    async def both():
        return await asyncio.gather(pull_events(daemon.socket, "acme/race"), pull_events(daemon.socket, "acme/race"))

    first, second = asyncio.run(both())
    assert sorted([first[-1]["stage"], second[-1]["stage"]]) == ["done", "up_to_date"]
    assert weight_downloads(hub, "acme/race") == 1
    assert first[-1]["adapter"]["path"] == second[-1]["adapter"]["path"]


@pytest.mark.parametrize("ref, needle", [
    ("acme/nothing-here", "no repo 'acme/nothing-here' on the Hub"),
    ("hf://acme/sql-lora@no-such-branch", "has no revision 'no-such-branch'"),
    ("hf://acme/multi/missing", "acme/multi has no folder 'missing' at main"),
])
def test_hub_errors(daemon, hub, ref, needle):
    result = run_cli("pull", ref, "--socket", str(daemon.socket), env={"HF_ENDPOINT": hub.endpoint})
    assert_one_error(result, 4, needle)


def test_private_repo_needs_hf_token(daemon, demo):
    with HubStub(token="s3cret") as private:
        private.add_commit("acme/private", files_of(demo / ADAPTERS / "poet" / "v1"))
        env = {"HF_ENDPOINT": private.endpoint}
        denied = run_cli("pull", "acme/private", "--socket", str(daemon.socket), env=env)
        assert_one_error(denied, 4, "or it is private", "HF_TOKEN")
        wrong = run_cli("pull", "acme/private", "--socket", str(daemon.socket), env={**env, "HF_TOKEN": "nope"})
        assert_one_error(wrong, 7, "refused the credentials", "HF_TOKEN")
        ok = run_cli("pull", "acme/private", "--socket", str(daemon.socket), env={**env, "HF_TOKEN": "s3cret"})
        assert ok.returncode == 0, ok.stderr


def test_hub_unreachable(daemon):
    result = run_cli("pull", "acme/anything", "--socket", str(daemon.socket), env={"HF_ENDPOINT": "http://127.0.0.1:9"})
    assert_one_error(result, 7, "cannot reach the Hub at http://127.0.0.1:9")


def _wait_for(predicate, timeout=60.0, what="condition"):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def test_ctrl_c_mid_pull_installs_nothing_and_the_next_pull_completes(daemon, hub, demo):
    hub.add_commit("acme/interrupted", files_of(demo / ADAPTERS / "sql-expert" / "v1"))
    release = hub.stall("adapter_model.safetensors", after_bytes=1000, repo="acme/interrupted")
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "NO_COLOR": "1"}
    # SIGINT as at a terminal: a CI run started in the background hands it down ignored.
    proc = subprocess.Popen([str(BIN / "loractl"), "pull", "acme/interrupted", "--socket", str(daemon.socket)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=sigint_as_at_a_terminal)
    try:
        # The daemon asks for the weights only once the CLI streams the pull: its Ctrl-C handler is in place.
        _wait_for(lambda: weight_downloads(hub, "acme/interrupted") >= 1, what="the stalled download")
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
        assert proc.returncode == 130 and "Traceback" not in err, err
    finally:
        release.set()
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    tmp = daemon.home / "adapters" / ".tmp"
    _wait_for(lambda: not any(tmp.iterdir()), what="the daemon to drop the cancelled pull")
    assert not (daemon.home / "adapters" / "acme" / "interrupted").exists()
    again = run_cli("pull", "acme/interrupted", "--socket", str(daemon.socket), env={"HF_ENDPOINT": hub.endpoint})
    assert again.returncode == 0, again.stderr


def test_sigkill_mid_pull_then_restart_and_pull_cleanly(rig, hub, demo):
    """The daemon SIGKILLed mid-download: nothing half-installed is visible, the restarted
    daemon clears the leftovers, and the same pull then completes. The daemon is conftest's
    ``rig``, the daemon made to be killed and restarted: its restart is this test's, and it
    serves the rig's later users (the name pulled here is removed again)."""
    hub.add_commit("acme/killed", files_of(demo / ADAPTERS / "translator" / "v1"))
    release = hub.stall("adapter_model.safetensors", after_bytes=1000, repo="acme/killed")
    home, d = rig.root, rig.daemon
    store = home / "adapters"
    staged_before = set((store / ".tmp").iterdir())
    env = {**os.environ, "HF_ENDPOINT": hub.endpoint, "NO_COLOR": "1"}
    try:
        proc = subprocess.Popen([str(BIN / "loractl"), "pull", "acme/killed", "--socket", str(d.socket)],
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        try:
            _wait_for(lambda: weight_downloads(hub, "acme/killed") >= 1, what="the stalled download")
            os.killpg(d.proc.pid, signal.SIGKILL)
            d.proc.wait(30)
            _, err = proc.communicate(timeout=30)
            assert proc.returncode == 3, err  # the CLI says the daemon went away, in one line
            assert "lost" in err and "Traceback" not in err
            assert set((store / ".tmp").iterdir()) - staged_before, "the interrupted pull left its staging folder"
            assert not (store / "acme" / "killed").exists()
        finally:
            release.set()
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
            if d.proc.poll() is None:
                os.killpg(d.proc.pid, signal.SIGKILL)
                d.proc.wait(30)
    finally:
        rig.start()   # whatever happened above: the rig's later users get a live daemon
    d2 = rig.daemon
    try:
        assert not any((home / "adapters" / ".tmp").iterdir())
        again = run_cli("pull", "acme/killed", "--socket", str(d2.socket), env={"HF_ENDPOINT": hub.endpoint})
        assert again.returncode == 0, again.stderr
        listed = json.loads(run_cli("ls", "--json", "--socket", str(d2.socket)).stdout)
        assert "acme/killed" in {a["name"] for a in listed}
    finally:
        rig.cli("rm", "acme/killed")
