"""Upgrades lose nothing (issue 45, item 5): the store, the pins and the registry carry a format
version (loractld/store/formats.py). ``tests/fixtures/store-v1`` is a store and pins file that
loractl 0.1.0 wrote; this release (and every later one) starts on a copy of it and serves its
adapters with their revisions and pins intact. A store or pins file of a newer format is refused
at start by name, and not one byte of it changes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from conftest import BIN, adapter_folder, collect, run_cli, start_daemon, sub_home
from test_errors import assert_one_error, short_dir  # noqa: F401 - a fixture

from loractl import registry

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "store-v1"
# What 0.1.0 wrote (tests/fixtures/store-v1/README.md): name -> (revision, pin, the tiny model's adapter).
WRITTEN = {
    "sql-expert/v1": ("sha256:2b22213eab1c8616b8941eb93d4d5edddbd789d74e1e3f09f83d6f4b8ccf3b2e", "host", "sql-expert"),
    "poet/v1": ("sha256:98a884fb946b035588a4dbf100d76fbd6d6a3fad1a5d1b1c3a9f7983d2ce6ee6", "", "poet"),
    "team/translator": ("sha256:98719cb0b6f29d234505c07655afe3b961858d817cda2c81105669d42e4fc535", "",
                        "translator"),
}


def place_fixture(home: Path) -> None:
    shutil.copytree(FIXTURE / "adapters", home / "adapters", symlinks=True)
    (home / "state").mkdir(exist_ok=True)
    shutil.copy2(FIXTURE / "state" / "state.json", home / "state" / "state.json")


def tree(root: Path) -> dict[str, bytes | str]:
    """Every file's bytes and every link's target under ``root``."""
    found: dict[str, bytes | str] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            path = Path(dirpath) / name
            if path.is_symlink():
                found[str(path.relative_to(root))] = os.readlink(path)
            elif path.is_file():
                found[str(path.relative_to(root))] = path.read_bytes()
    return found


def test_a_store_written_by_0_1_0_is_served_with_its_adapters_revisions_and_pins(home, demo, reference):
    root = sub_home(home, "format-v1")
    place_fixture(root)
    daemon = start_daemon(root)
    try:
        listed = json.loads(run_cli("ls", "--json", "--socket", str(daemon.socket)).stdout)
        assert {a["name"]: (a["revision"], a["pin"]) for a in listed} == {
            name: (revision, pin) for name, (revision, pin, _) in WRITTEN.items()}
        prompt = reference.chat_ids("hello")
        for name, (_, _, adapter) in WRITTEN.items():
            answer = run_cli("run", "--lora", name, "-t", "0", "-n", "8", "hello", "--socket", str(daemon.socket))
            assert answer.returncode == 0, answer.stderr
            assert answer.stdout == reference.text(reference.greedy(prompt, adapter_folder(demo, adapter), 8)) + "\n"
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
    # Every file and link of the old store is still there, unchanged.
    after = tree(root / "adapters")
    for path, content in tree(FIXTURE / "adapters").items():
        assert after.get(path) == content, path


@pytest.mark.parametrize("what", ["store", "pins"])
def test_a_newer_format_is_refused_by_name_at_start_and_nothing_is_rewritten(short_dir, what):
    place_fixture(short_dir)
    target = short_dir / ("adapters/.loractl-store.json" if what == "store" else "state/state.json")
    target.write_text(json.dumps({**json.loads(target.read_text()), "format": 2}))
    before = tree(short_dir)
    with open(short_dir / "d.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(short_dir)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    assert daemon.wait(120) != 0
    text = (short_dir / "d.log").read_text()
    name = "adapter store" if what == "store" else "pins file"
    assert f"the {name} at" in text and "is format 2, written by a newer loractl" in text, text
    assert "reads format 1 and older" in text and "Traceback" not in text, text
    after = tree(short_dir)
    for path, content in before.items():
        assert after.get(path) == content, f"{path} changed"
    assert not (short_dir / "tiny").exists(), "the daemon went on to build its model"
    result = run_cli("status", "--home", str(short_dir))
    assert_one_error(result, 3, "loractld exited", f"the {name} at", "is format 2")


@pytest.mark.parametrize("what, value", [("store", "2"), ("pins", 1.5)])
def test_a_format_that_is_no_number_is_refused_at_start_not_read_as_1(short_dir, what, value):
    """Issue 60, item 24: ``{"format": "2"}`` (a string) was read as format 1 and the daemon
    started. It is refused in one line that names the file and the value, and nothing changes."""
    place_fixture(short_dir)
    target = short_dir / ("adapters/.loractl-store.json" if what == "store" else "state/state.json")
    target.write_text(json.dumps({**json.loads(target.read_text()), "format": value}))
    before = tree(short_dir)
    with open(short_dir / "d.log", "wb") as log:
        daemon = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(short_dir)],
                                  stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    assert daemon.wait(120) != 0
    text = (short_dir / "d.log").read_text()
    name = "adapter store" if what == "store" else "pins file"
    said = json.dumps(value)
    assert f"the {name} at" in text and f"says format {said}" in text and "no format number" in text, text
    assert "Traceback" not in text, text
    after = tree(short_dir)
    for path, content in before.items():
        assert after.get(path) == content, f"{path} changed"
    assert not (short_dir / "tiny").exists(), "the daemon went on to build its model"
    result = run_cli("status", "--home", str(short_dir))
    assert_one_error(result, 3, "loractld exited", f"the {name} at", f"says format {said}")


def test_registry_entries_carry_a_format_and_a_newer_one_is_skipped_not_deleted(tmp_path):
    disc = registry.ServiceRegistry(tmp_path)
    with disc.register_instance("loractl", "loractld", instance_id="one", metadata={}) as handle:
        entry = tmp_path / "loractl" / "loractld" / "one.json"
        assert json.loads(entry.read_text())["format"] == registry.REGISTRY_FORMAT
        found = registry.ServiceDiscovery(tmp_path).list_instances("loractl", "loractld")
        assert [i.instance_id for i in found] == ["one"]
        handle._doc["format"] = registry.REGISTRY_FORMAT + 1   # as a newer release writes it
        handle._write()
        assert registry.ServiceDiscovery(tmp_path).list_instances("loractl", "loractld") == []
        assert entry.exists()


PROFILES = Path(__file__).resolve().parent / "fixtures" / "profiles-v1"
SQL_SYSTEM = "You answer in SQL only."
SQL_SHOTS = [{"role": "user", "content": "Count the customers."},
             {"role": "assistant", "content": "SELECT COUNT(*) FROM customers;"}]
ASKED = [{"role": "user", "content": "List the ten newest orders."}]


def _answer(daemon, lora: str, messages: list[dict], **sampling) -> tuple[list[int], str]:
    async def go():
        async with daemon.client() as client:
            return await collect(client, messages=messages, lora=lora, **sampling)
    result = asyncio.run(go())
    return result["ids"], result["text"]


def test_profiles_written_by_0_1_0_are_served_and_a_newer_profile_is_skipped_and_named(home, demo):
    """tests/fixtures/profiles-v1 (README there): its two profiles answer as they were made, show
    --modelfile gives the text they were stored with, and not one file of it changes. A profile
    file of a newer format is skipped and named (the others are served; the registry does the
    same with a newer entry), a create onto its name is refused by name, and it is left as it is."""
    root = sub_home(home, "profiles-v1")
    shutil.copytree(PROFILES / "adapters", root / "adapters", symlinks=True)
    future = root / "adapters" / ".profiles" / "future.json"
    future_doc = {**json.loads((PROFILES / "adapters" / ".profiles" / "blend.json").read_text()),
                  "format": 2, "name": "future", "what-format-2-adds": {"x": 1}}
    future.write_text(json.dumps(future_doc))
    future_bytes = future.read_bytes()
    daemon = start_daemon(root)
    try:
        sock = ("--socket", str(daemon.socket))
        listed = {a["name"]: a for a in json.loads(run_cli("ls", "--json", *sock).stdout)}
        # blend-merged is blend's own merge (issue 60): listed as what blend runs, not as an adapter.
        assert {"sql-expert/v1", "poet/v1", "mix/v1", "sql-assistant", "blend"} == set(listed)
        assert listed["blend"]["profile"]["adapter"] == "blend-merged"
        # The single-adapter profile answers as the plain request carrying what it adds.
        plain = _answer(daemon, "sql-expert/v1", [{"role": "system", "content": SQL_SYSTEM}, *SQL_SHOTS, *ASKED],
                        temperature=0.0, max_tokens=12, repetition_penalty=1.15, stop=[";"])
        assert plain[0] and _answer(daemon, "sql-assistant", ASKED) == plain
        # The weighted one answers as the stored merged adapter of the same sources and weights.
        merged = _answer(daemon, "mix/v1", ASKED, temperature=0.0, max_tokens=8)
        assert len(merged[0]) == 8 and _answer(daemon, "blend", ASKED) == merged
        assert merged != _answer(daemon, "sql-expert/v1", ASKED, temperature=0.0, max_tokens=8)
        for name in ("sql-assistant", "blend"):
            shown = run_cli("show", name, "--modelfile", *sock)
            stored = json.loads((PROFILES / "adapters" / ".profiles" / f"{name}.json").read_text())["modelfile"]
            assert shown.returncode == 0 and shown.stdout == stored, shown.stderr
        # The newer profile: named in the log, not served, its name refused to a create.
        assert "profile future" in daemon.log.read_text() and "is format 2, written by a newer loractl" in \
            daemon.log.read_text(), daemon.log_tail()
        clash = run_cli("create", "future", "--from", "sql-expert/v1", *sock)
        assert_one_error(clash, 2, "profile 'future' was written by a newer loractl (format 2)",
                         "reads format 1 and older")
        assert run_cli("rm", "future", *sock).returncode != 0
    finally:
        assert daemon.stop() == 0, daemon.log_tail()
    after = tree(root / "adapters")
    for path, content in tree(PROFILES / "adapters").items():
        assert after.get(path) == content, path
    assert future.read_bytes() == future_bytes
