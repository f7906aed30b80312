"""A full disk (issue 60, item 18), on a real daemon whose store and state folder are small
tmpfs mounts filled to the last byte: every command that would write says so in one line
(``DiskFull``, exit 8: never "internal error"), and changes nothing — a pin or an unpin is made
only with ``state.json`` written, a merge or a profile is listed only once its files are, and
no temporary is left beside them. Once there is room again the same commands work.

Needs a tmpfs mount (root, or a user that may mount): skipped, saying so, where there is none.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import httpx
import pytest

from conftest import run_cli, start_daemon, sub_home
from loractl.paths import layout

ADAPTERS = ("sql-expert/v1", "poet/v1", "python-expert/v1")


def _mount(folder: Path, size: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(folder)],
                          capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip(f"no tmpfs to fill here (mount: {done.stderr.strip()})")


def _fill(folder: Path) -> None:
    """Write zeros under ``folder`` until its file system has no byte left."""
    with open(folder / "filler", "wb", buffering=0) as f:
        chunk = bytes(1 << 20)
        while True:
            try:
                f.write(chunk)
            except OSError:
                break
        for size in (4096, 1):
            try:
                while f.write(bytes(size)):
                    pass
            except OSError:
                pass


@pytest.fixture(scope="module")
def full(home):
    root = sub_home(home, "full")
    places = layout(root)
    mounts = [places.store_dir, places.state_dir]
    _mount(places.store_dir, "160m")   # the store keeps 64 MiB free for pulls: room for three tiny adapters
    try:
        _mount(places.state_dir, "1m")
        daemon = start_daemon(root, "--http", "127.0.0.1:0", "--max-cpu-loras", "5", name="full")   # 3 host pins
        try:
            sock = ("--socket", str(daemon.socket))
            for name in ADAPTERS:
                done = run_cli("pull", str(home / "tiny" / "adapters" / name), "--name", name, *sock)
                assert done.returncode == 0, done.stderr
            assert run_cli("pin", "poet/v1", *sock).returncode == 0
            http = json.loads(run_cli("status", "--json", *sock).stdout)["http"]
            for folder in mounts:
                _fill(folder)
            yield daemon, sock, http, places
        finally:
            daemon.stop()
    finally:
        for folder in reversed(mounts):
            subprocess.run(["umount", "-l", str(folder)], capture_output=True)


def _listing(sock) -> dict:
    return {a["name"]: a for a in json.loads(run_cli("ls", "--json", *sock).stdout)}


def _disk_full(done) -> None:
    assert done.returncode == 8, (done.returncode, done.stderr)
    assert "disk is full" in done.stderr or "disk space" in done.stderr, done.stderr
    assert "internal" not in done.stderr and len(done.stderr.strip().splitlines()) <= 2, done.stderr


def _leftovers(places) -> list[str]:
    return sorted(p.name for folder in (places.state_dir, places.store_dir / ".profiles") if folder.is_dir()
                  for p in folder.iterdir() if p.name.startswith("."))


def test_pin_and_unpin_on_a_full_disk_change_nothing(full):
    daemon, sock, _, places = full
    state = (places.state_dir / "state.json").read_bytes()
    _disk_full(run_cli("pin", "sql-expert/v1", *sock))
    _disk_full(run_cli("pin", "python-expert/v1", *sock))   # not "at the cap": the first was never pinned
    _disk_full(run_cli("unpin", "poet/v1", *sock))
    listed = _listing(sock)
    assert [n for n, a in listed.items() if a.get("pinned")] == ["poet/v1"], listed
    assert (places.state_dir / "state.json").read_bytes() == state
    assert _leftovers(places) == []


def test_merge_and_create_on_a_full_disk_leave_nothing(full):
    daemon, sock, http, places = full
    _disk_full(run_cli("merge", "full-merge/v1", "sql-expert/v1=0.5", "poet/v1=0.5", *sock))
    _disk_full(run_cli("create", "full-profile", "--from", "sql-expert/v1", "--system", "hi", *sock))
    with httpx.stream("POST", f"{http}/api/create", json={"model": "full-web", "from": "sql-expert/v1",
                                                          "system": "hi"}, timeout=120) as answer:
        body = answer.read().decode()
    assert "disk is full" in body and "internal" not in body, (answer.status_code, body)
    listed = _listing(sock)
    assert not {"full-merge/v1", "full-profile", "full-web"} & set(listed), listed
    assert _leftovers(places) == []
    assert daemon.proc.poll() is None


def test_with_room_again_the_same_commands_work(full):
    daemon, sock, _, places = full
    for folder in (places.store_dir, places.state_dir):
        (folder / "filler").unlink()
    for command in (("pin", "sql-expert/v1"), ("unpin", "poet/v1"), ("create", "full-profile", "--from",
                                                                      "sql-expert/v1", "--system", "hi")):
        done = run_cli(*command, *sock)
        assert done.returncode == 0, (command, done.stderr)
    listed = _listing(sock)
    assert listed["sql-expert/v1"].get("pinned") and not listed["poet/v1"].get("pinned"), listed
    assert run_cli("show", "full-profile", *sock).returncode == 0


def test_a_profile_write_that_a_kill_stopped_is_cleared_when_the_profiles_are_read(tmp_path):
    from loractld.store.profiles import PROFILES_DIR, Profiles

    folder = tmp_path / PROFILES_DIR / "org"
    folder.mkdir(parents=True)
    (folder / ".m.json.0123abcd").write_text('{"half": ')   # write_json_atomic's temporary, killed mid-way
    (folder / ".notes").write_text("a user's file")
    assert Profiles(tmp_path).list() == []
    assert sorted(p.name for p in folder.iterdir()) == [".notes"]
