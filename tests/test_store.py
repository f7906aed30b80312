"""The disk tier through the real daemon: pull from folders, validation, ls/show/rm, names."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from adapter_factory import broken, good
from conftest import run_cli
from test_errors import assert_one_error


def cli(daemon, *args):
    return run_cli(*args, "--socket", str(daemon.socket)) if args[0] != "run" else run_cli(
        args[0], "--socket", str(daemon.socket), *args[1:])


def stored_names(daemon) -> set[str]:
    result = cli(daemon, "ls", "--json")
    assert result.returncode == 0, result.stderr
    return {a["name"] for a in json.loads(result.stdout)}


def store_dir(daemon) -> Path:
    return daemon.home / "adapters"


def test_pull_a_folder_then_generate_with_its_name(daemon, demo, reference):
    result = cli(daemon, "pull", str(demo / "adapters" / "python-expert" / "v1"), "--name", "python-expert/v1")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("success: python-expert/v1")
    assert "verifying" in result.stderr and "installing" in result.stderr
    assert "python-expert/v1" in stored_names(daemon)

    out = cli(daemon, "run", "--lora", "python-expert/v1", "-t", "0", "-n", "20", "Write a query")
    assert out.returncode == 0, out.stderr
    expected = reference.greedy(reference.chat_ids("Write a query"), demo / "adapters" / "python-expert" / "v1", 20)
    assert out.stdout == reference.text(expected) + "\n"

    again = cli(daemon, "pull", str(demo / "adapters" / "python-expert" / "v1"), "--name", "python-expert/v1")
    assert again.returncode == 0 and again.stdout.startswith("up to date: python-expert/v1")


def test_show_reports_the_manifest(daemon, demo, tmp_path):
    # Content of its own: the tier is the content's, and another module may have served the demo's.
    src = good(demo, tmp_path / "show-me", name="show-me", rank=8)
    assert cli(daemon, "pull", str(src), "--name", "show-me/v1").returncode == 0
    info = json.loads(cli(daemon, "show", "show-me/v1", "--json").stdout)
    assert info["source"] == "local" and info["ref"] == str(src)
    assert info["rank"] == 8 and info["alpha"] == 16 and info["base_model"] == "loractl/demo-tiny-llama"
    assert sorted(info["target_modules"]) == sorted(["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                                     "up_proj", "down_proj"])
    import hashlib
    for f in info["files"]:
        data = (src / f["name"]).read_bytes()
        assert int(f["size"]) == len(data) and f["sha256"] == hashlib.sha256(data).hexdigest()
    assert info["revision"].startswith("sha256:") and info["state"] == "ready" and info["tier"] == "disk"
    human = cli(daemon, "show", "show-me/v1")
    assert human.returncode == 0 and "loractl/demo-tiny-llama" in human.stdout


def test_new_content_under_the_same_name_replaces_it(daemon, demo, tmp_path, reference):
    a = good(demo, tmp_path / "a", name="swap-a")
    b = good(demo, tmp_path / "b", name="swap-b")
    assert cli(daemon, "pull", str(a), "--name", "swap/v1").returncode == 0
    first = json.loads(cli(daemon, "show", "swap/v1", "--json").stdout)
    out_a = cli(daemon, "run", "--lora", "swap/v1", "-t", "0", "-n", "12", "hello").stdout
    # The same name now pulled from another folder: refused unless forced (issue 60), then a new
    # revision, installed atomically.
    assert cli(daemon, "pull", str(b), "--name", "swap/v1").returncode == 2
    assert cli(daemon, "pull", str(b), "--name", "swap/v1", "--force").returncode == 0
    second = json.loads(cli(daemon, "show", "swap/v1", "--json").stdout)
    assert second["revision"] != first["revision"] and not Path(first["path"]).exists()
    out_b = cli(daemon, "run", "--lora", "swap/v1", "-t", "0", "-n", "12", "hello").stdout
    ids = reference.chat_ids("hello")
    assert out_a == reference.text(reference.greedy(ids, a, 12)) + "\n"
    assert out_b == reference.text(reference.greedy(ids, b, 12)) + "\n"
    assert out_a != out_b


@pytest.mark.parametrize("kind, needle", [
    ("no_config", "adapter_config.json is missing"),
    ("bad_json", "adapter_config.json is not valid JSON"),
    ("not_lora", "not a LoRA adapter: peft_type is 'IA3'"),
    ("pickle_only", "only in pickle format"),
    ("rank_too_big", "rank 32 is above the daemon's max LoRA rank 16"),
    ("unknown_module", "the base model has no module 'model.layers.7.self_attn.q_proj'"),
    ("wrong_shape", "does not fit the base model"),
    ("other_base_model", "trained for 'meta-llama/Llama-3.1-8B'"),
    ("truncated", "truncated"),
    ("garbage", "not a valid safetensors file"),
])
def test_invalid_adapters_are_refused_and_nothing_is_installed(daemon, demo, tmp_path, kind, needle):
    folder = broken(kind, demo, tmp_path / kind)
    name = f"bad-{kind.replace('_', '-')}/v1"
    result = cli(daemon, "pull", str(folder), "--name", name)
    assert_one_error(result, 5, needle)
    assert name not in stored_names(daemon)
    assert not (store_dir(daemon) / name).exists()
    assert not any((store_dir(daemon) / ".tmp").iterdir())


def test_force_installs_an_adapter_for_another_base_name_and_it_serves(daemon, demo, tmp_path, reference):
    folder = broken("other_base_model", demo, tmp_path / "other")
    assert_one_error(cli(daemon, "pull", str(folder), "--name", "forced/v1"), 5, "trained for")
    result = cli(daemon, "pull", str(folder), "--name", "forced/v1", "--force")
    assert result.returncode == 0, result.stderr
    assert "forced/v1" in stored_names(daemon)
    # The force is remembered: every later use of the name serves it (it used to be refused).
    result = cli(daemon, "run", "--lora", "forced/v1", "-t", "0", "-n", "8", "hi")
    assert result.returncode == 0, result.stderr
    assert result.stdout == reference.text(reference.greedy(reference.chat_ids("hi"), folder, 8)) + "\n"


@pytest.mark.parametrize("name", ["../evil", "/etc/passwd", "Upper/v1", "a/b/c", "x/..", ".hidden", "a//b", ""])
def test_invalid_names_are_refused(daemon, demo, name):
    result = cli(daemon, "pull", str(demo / "adapters" / "poet" / "v1"), "--name", name)
    if name == "":  # an empty --name means "derive it"
        assert result.returncode == 0, result.stderr
        return
    assert_one_error(result, 2, "invalid adapter name")


def test_hand_placed_adapters_are_discovered(daemon, demo):
    # The seeds' layout: <root>/<name>/<version>/adapter_config.json (+ optional metadata.json)
    folder = store_dir(daemon) / "handmade" / "v2"
    shutil.copytree(demo / "adapters" / "translator" / "v1", folder)
    (folder / "metadata.json").write_text(json.dumps({"description": "placed by hand"}))
    listed = {a["name"]: a for a in json.loads(cli(daemon, "ls", "--json").stdout)}
    assert listed["handmade/v2"]["hand_placed"] is True and listed["handmade/v2"]["state"] == "ready"
    assert listed["handmade/v2"]["rank"] == 16
    out = cli(daemon, "run", "--lora", "handmade/v2", "-t", "0", "-n", "8", "hi")
    assert out.returncode == 0, out.stderr
    assert cli(daemon, "rm", "handmade/v2").returncode == 0
    assert not folder.exists()


def test_symlinks_out_of_the_store_are_refused(daemon, demo):
    outside = Path(tempfile.mkdtemp(prefix="lct-out-", dir="/tmp"))
    shutil.copytree(demo / "adapters" / "poet" / "v1", outside / "poet")
    link = store_dir(daemon) / "escape"
    link.symlink_to(outside / "poet")
    try:
        assert "escape" not in stored_names(daemon)
        result = cli(daemon, "run", "--lora", "escape", "hi")
        assert_one_error(result, 5, "leads out of the store")
    finally:
        link.unlink()
        shutil.rmtree(outside)


def test_rm_deletes_and_unknown_names_get_a_pull_hint(daemon, demo, tmp_path):
    # Content no other name has: rm keeps in the engine what another name still resolves to.
    folder = good(demo, tmp_path / "gone", name="gone/v1")
    assert cli(daemon, "pull", str(folder), "--name", "gone/v1").returncode == 0
    path = Path(json.loads(cli(daemon, "show", "gone/v1", "--json").stdout)["path"])
    # Load it into the engine, so rm has something to unload.
    assert cli(daemon, "run", "--lora", "gone/v1", "-t", "0", "-n", "4", "hi").returncode == 0
    result = cli(daemon, "rm", "gone/v1")
    assert result.returncode == 0 and "deleted gone/v1 (unloaded from the engine)" in result.stdout
    assert not path.exists() and "gone/v1" not in stored_names(daemon)
    assert_one_error(cli(daemon, "rm", "gone/v1"), 4, "no adapter named 'gone/v1'", "loractl pull")
    assert_one_error(cli(daemon, "run", "--lora", "gone/v1", "hi"), 4, "loractl pull")


def test_ls_human_output_fits_80_columns(daemon, demo):
    cli(daemon, "pull", str(demo / "adapters" / "sql-expert" / "v1"), "--name", "a-rather-long-adapter-name/v1")
    result = run_cli("ls", "--socket", str(daemon.socket), env={"COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    assert "a-rather-long-adapter-name/v1" in result.stdout.replace("\n", "")
    assert max(len(line) for line in result.stdout.splitlines()) <= 80


def test_ls_json_is_the_daemons_text_of_the_listing_the_client_decodes(daemon, demo):
    """``ls --json`` prints the text the daemon wrote (ListReply.json): exactly what the CLI writes
    from the listing's messages through dicts (json.dumps, indent 2, sorted keys), for adapters
    on disk, one just served (its residency and use changed since its entry was listed) and the
    rest of the session's store."""
    from loractl.cli._output import dumps_indented
    from loractl.cli._quick import message
    from loractl.messages import to_dict
    from loractl.v1 import loractl_pb2 as pb

    assert cli(daemon, "pull", str(demo / "adapters" / "poet" / "v1"), "--name", "as-text/v1").returncode == 0
    assert cli(daemon, "ls", "--json").returncode == 0   # its text kept as unchanged
    assert cli(daemon, "run", "--lora", "as-text/v1", "-t", "0", "-n", "2", "hi").returncode == 0
    printed = cli(daemon, "ls", "--json")
    assert printed.returncode == 0, printed.stderr
    ask = ("/loractl.v1.Loractl/List", pb.ListReply)
    as_text = message(str(daemon.socket), None, ask[0], pb.ListRequest(json=True), ask[1])
    messages = message(str(daemon.socket), None, ask[0], pb.ListRequest(), ask[1])
    assert as_text.json and not as_text.adapters and messages.adapters and not messages.json
    assert printed.stdout == as_text.json + "\n" == dumps_indented(to_dict(messages)["adapters"]) + "\n"
    served = next(a for a in json.loads(printed.stdout) if a["name"] == "as-text/v1")
    assert served["requests"] >= 1 and served["tier"] != "disk", served


def test_recover_clears_what_an_install_killed_before_its_rename_left(tmp_path, demo):
    """Store.install cut between the object's rename and the name's (tests/test_kill_points.py
    kills the daemon there) leaves the object, a temporary link (at the root for a bare name, in
    the org folder otherwise) and maybe an org folder with nothing else: the next start clears
    them all, so the bare name "org" does not read as a hand-placed folder that blocks a pull."""
    from loractld.store.disk import Store

    store = Store(tmp_path / "adapters")
    for name in ("bare", "org/v1"):
        entry = store.root / name
        obj = store.objects / f"1-{name.replace('/', '-')}"
        shutil.copytree(demo / "adapters" / "poet" / "v1", obj)
        entry.parent.mkdir(exist_ok=True)
        (entry.parent / f".{entry.name}.0123abcd").symlink_to(os.path.relpath(obj, entry.parent))
    store.recover()
    assert sorted(p.name for p in store.root.iterdir()) == [".objects", ".snapshots", ".tmp"]
    assert not any(store.objects.iterdir())
