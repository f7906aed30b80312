"""Preflight through the engine's own loader, on the shared rig daemon (issue 21).

The adapters here pass loractl's own validation but are refused by vLLM's loader for this
engine (``init_lora_weights="pissa"``: PiSSA changes the base weights when PEFT loads it, so
vLLM refuses it). Without the preflight such an adapter reached the engine inside a step.
"""

from __future__ import annotations

import json
import re
import shutil

from adapter_factory import edit_config, good
from test_errors import assert_one_error


def base_is_reference(rig, reference) -> None:
    """The engine is alive and the base model still answers exactly as HF does."""
    out = rig.ok("run", "-t", "0", "-n", "8", "hello")
    assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hello"), None, 8)) + "\n"


def stored(rig) -> set[str]:
    return {a["name"] for a in json.loads(rig.ok("ls", "--json").stdout)}


def test_pull_refuses_what_the_engines_loader_refuses(rig, demo, tmp_path, reference):
    folder = edit_config(good(demo, tmp_path / "pissa", name="pissa"), init_lora_weights="pissa")
    result = rig.cli("pull", str(folder), "--name", "pissa/v1")
    assert_one_error(result, 5, "cannot load this adapter", "init_lora_weights='pissa'")
    assert "engine's own loader" in result.stderr  # the stage ran after verifying, before installing
    assert "installing" not in result.stderr
    assert "pissa/v1" not in stored(rig)
    base_is_reference(rig, reference)


def test_a_folder_is_checked_at_first_use_and_refused_in_one_line(rig, demo, tmp_path, reference):
    folder = edit_config(good(demo, tmp_path / "pissa-folder", name="pissa-folder"), init_lora_weights="pissa")
    for _ in range(2):  # the second answer comes from the remembered refusal
        result = rig.cli("run", "-t", "0", "-n", "4", "--lora", str(folder), "hi")
        assert_one_error(result, 5, "cannot load this adapter", "init_lora_weights='pissa'")
    base_is_reference(rig, reference)


def test_a_hand_placed_adapter_is_refused_at_first_use_and_listed_failed(rig, demo, reference):
    folder = rig.root / "adapters" / "handmade-pissa" / "v1"
    edit_config(good(demo, folder, name="handmade-pissa"), init_lora_weights="pissa")
    try:
        result = rig.cli("run", "-t", "0", "-n", "4", "--lora", "handmade-pissa/v1", "hi")
        assert_one_error(result, 5, "cannot load this adapter")
        listed = {a["name"]: a for a in json.loads(rig.ok("ls", "--json").stdout)}
        assert listed["handmade-pissa/v1"]["state"] == "failed"
        assert "init_lora_weights" in listed["handmade-pissa/v1"]["error"]
        base_is_reference(rig, reference)
    finally:
        shutil.rmtree(folder.parent)


def test_a_good_adapter_is_checked_once_and_served(rig, demo, tmp_path, reference):
    folder = good(demo, tmp_path / "fine", name="preflight-fine")
    rig.ok("pull", str(folder), "--name", "preflight-fine/v1")
    out = rig.ok("run", "-t", "0", "-n", "10", "--lora", "preflight-fine/v1", "hello")
    assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hello"), folder, 10)) + "\n"
    # One preflight for this content: at pull, none at first use (keyed by digest).
    log = rig.daemon.log.read_text()
    runs = re.findall(r"preflight preflight-fine/v1 \(\w+\): ok in ([\d.]+) ms", log)
    assert len(runs) == 1, log[-2000:]
    print(f"preflight cost: {runs[0]} ms")
    rig.ok("run", "-t", "0", "-n", "2", "--lora", str(folder), "hello")  # same content by path: no new run
    assert len(re.findall(r"preflight \S+ \(\w+\): ok in", rig.daemon.log.read_text())) == \
        len(re.findall(r"preflight \S+ \(\w+\): ok in", log))
