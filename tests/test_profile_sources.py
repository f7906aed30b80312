"""Where a profile's adapters come from (issue 47, item 1): a Modelfile's ``ADAPTER`` (and
``loractl create --adapter``) takes a stored name, a folder or a Hub ref, as ``loractl pull``
takes refs (loractld/core/profile_sources.py).

On a daemon of its own whose Hub is the suite's stand-in (tests/hub_stub.py): ``ADAPTER
./relative-folder`` is resolved against the Modelfile's folder and answers as ``loractl pull``
of that folder does (same greedy tokens through gRPC); a Hub ref is pulled from the Hub; the
pulled sources get ``<profile>-adapter`` names that ``show`` lists and a second create of the
same Modelfile reuses; a bad folder is refused with its Modelfile line, and a create that fails
after a pull leaves nothing in the store.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path

import pytest

from adapter_factory import good
from conftest import collect, run_cli, start_daemon, sub_home
from support_daemons import stop_at_end
from hub_stub import HubStub

QUESTION = [{"role": "user", "content": "Describe the sea."}]


def files_of(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in folder.iterdir() if p.is_file()}


@pytest.fixture(scope="module")
def served(home, demo):
    """(daemon, hub, base model name): a daemon whose HF_ENDPOINT is the Hub stand-in, where
    acme/poet holds the demo's poet adapter."""
    with HubStub() as hub:
        hub.add_commit("acme/poet", files_of(demo / "adapters" / "poet" / "v1"))
        daemon = start_daemon(sub_home(home, "sources"), env={"HF_ENDPOINT": hub.endpoint})
        try:
            base = json.loads(cli(daemon, "status", "--json").stdout)["engine"]["model_name"]
            yield daemon, hub, base
        finally:
            stop_at_end(daemon.proc)


def cli(daemon, *args: str, ok: bool = True):
    result = run_cli(*args, "--socket", str(daemon.socket))
    if ok:
        assert result.returncode == 0, (args, result.stderr, daemon.log_tail())
    return result


def names(daemon) -> set[str]:
    return {a["name"] for a in json.loads(cli(daemon, "ls", "--json").stdout)}


def greedy(daemon, lora: str) -> list[int]:
    async def go() -> list[int]:
        async with daemon.client() as client:
            return (await collect(client, messages=QUESTION, lora=lora, temperature=0.0, max_tokens=8))["ids"]
    ids = asyncio.run(go())
    assert len(ids) == 8
    return ids


def test_a_relative_folder_answers_as_a_pull_of_it_and_a_second_create_reuses_its_name(served, demo, tmp_path):
    daemon, _, base = served
    folder = good(demo, tmp_path / "work" / "my-adapter", name="sources/fresh")
    modelfile = tmp_path / "work" / "Modelfile"
    modelfile.write_text(f"FROM {base}\nADAPTER ./my-adapter\n")
    assert Path.cwd() != modelfile.parent   # relative to the Modelfile's folder, not to loractl's
    cli(daemon, "create", "fresh-profile", "-f", str(modelfile))
    cli(daemon, "pull", str(folder), "--name", "sources/pulled")
    shown = json.loads(cli(daemon, "show", "fresh-profile", "--json").stdout)
    assert shown["profile"]["adapter"] == "fresh-profile-adapter", shown
    assert shown["profile"]["adapters"] == [{"name": "fresh-profile-adapter", "weight": 1.0}], shown
    stored = json.loads(cli(daemon, "show", "fresh-profile-adapter", "--json").stdout)
    assert stored["ref"] == str(folder) and stored["source"] == "local", stored
    assert greedy(daemon, "fresh-profile") == greedy(daemon, "sources/pulled") != greedy(daemon, "")
    # The Modelfile show gives names the stored adapter: it recreates the profile without a pull.
    text = cli(daemon, "show", "fresh-profile", "--modelfile").stdout
    assert "ADAPTER fresh-profile-adapter\n" in text, text
    # The same Modelfile again pulls into the same name (up to date), not a second copy.
    before = names(daemon)
    cli(daemon, "create", "fresh-profile", "-f", str(modelfile))
    assert names(daemon) == before
    # --adapter takes a folder relative to the working folder, as loractl pull does.
    flags = run_cli("create", "flag-profile", "--from", base, "--adapter", os.path.relpath(folder),
                    "--socket", str(daemon.socket))
    assert flags.returncode == 0, flags.stderr
    assert json.loads(cli(daemon, "show", "flag-profile", "--json").stdout)["profile"]["adapter"] == \
        "flag-profile-adapter"


def test_a_hub_ref_is_pulled_and_answers_as_its_adapter(served, demo, tmp_path):
    daemon, hub, base = served
    modelfile = tmp_path / "Modelfile"
    modelfile.write_text(f"FROM {base}\nSYSTEM \"\"\"\nADAPTER ./not-an-instruction\n\"\"\"\nADAPTER acme/poet\n")
    cli(daemon, "create", "hub-poet", "-f", str(modelfile))
    stored = json.loads(cli(daemon, "show", "hub-poet-adapter", "--json").stdout)
    assert stored["source"] == "hf" and stored["ref"] == "hf://acme/poet", stored
    assert any(path.startswith("/acme/poet/resolve/") for _, path in hub.requests)
    cli(daemon, "pull", str(demo / "adapters" / "poet" / "v1"), "--name", "sources/poet")
    messages = [{"role": "system", "content": "\nADAPTER ./not-an-instruction\n"}, *QUESTION]

    async def go(lora: str) -> list[int]:
        async with daemon.client() as client:
            return (await collect(client, messages=messages if lora != "hub-poet" else QUESTION, lora=lora,
                                  temperature=0.0, max_tokens=8))["ids"]
    assert asyncio.run(go("hub-poet")) == asyncio.run(go("sources/poet"))


@pytest.mark.parametrize("case", ["bad-folder", "missing-folder", "bad-from", "no-such-ref", "a-profile"])
def test_a_refused_create_names_its_line_and_leaves_nothing(served, demo, tmp_path, case):
    daemon, _, base = served
    good(demo, tmp_path / "ok", name="sources/ok")
    (tmp_path / "empty").mkdir()
    lines = {"bad-folder": (f"FROM {base}\nADAPTER ./ok=0.5\nADAPTER ./empty=0.5\n", "Modelfile line 3", 5),
             "missing-folder": (f"FROM {base}\nADAPTER ./ok\n\nADAPTER ./nowhere=2\n", "Modelfile line 4", 4),
             "bad-from": ("FROM nothing-of-that-name\nADAPTER ./ok\n", "FROM 'nothing-of-that-name'", 2),
             "no-such-ref": (f"FROM {base}\nADAPTER ./ok\n# a comment\nADAPTER acme/none\n", "Modelfile line 4", 4),
             "a-profile": (f"FROM {base}\nADAPTER ./ok\nADAPTER sources/profile\n", "Modelfile line 3", 2)}
    text, words, code = lines[case]
    if case == "a-profile":
        cli(daemon, "create", "sources/profile", "--from", base)
    (tmp_path / "Modelfile").write_text(text)
    before = names(daemon)
    refused = cli(daemon, "create", "refused", "-f", str(tmp_path / "Modelfile"), ok=False)
    assert refused.returncode == code and words in refused.stderr, refused.stderr
    assert len(refused.stderr.strip().splitlines()) <= 3, refused.stderr   # one error line and its hint
    # Nothing created, and what it pulled before the refusal was removed again.
    assert names(daemon) == before
    assert cli(daemon, "show", "refused", ok=False).returncode != 0
    assert cli(daemon, "show", "refused-adapter", ok=False).returncode != 0
