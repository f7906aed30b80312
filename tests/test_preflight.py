"""Preflight through the engine's own loader, on the shared rig daemon (issue 21).

The adapters here pass loractl's own validation but are refused by vLLM's loader for this
engine (``init_lora_weights="pissa"``: PiSSA changes the base weights when PEFT loads it, so
vLLM refuses it). Without the preflight such an adapter reached the engine inside a step.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from pathlib import Path

import httpx

from adapter_factory import edit_config, good
from conftest import run_cli
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


def test_a_load_that_fails_inside_a_step_fails_its_request_and_the_engine_keeps_serving(rig, demo, tmp_path,
                                                                                          reference):
    """What slips past preflight (a fault injected in the worker's load, in a step) ends one
    request with a clear error; the engine survives, the adapter is listed failed and refused
    after, and every other adapter and the base model are still served exactly."""
    folder = good(demo, tmp_path / "slips", name="slips-through")
    other = good(demo, tmp_path / "other", name="slips-other")
    rig.ok("pull", str(folder), "--name", "slips/v1")
    rig.ok("pull", str(other), "--name", "slips-other/v1")
    installed = json.loads(rig.ok("show", "slips/v1", "--json").stdout)["path"]
    rig.load_fault.write_text(Path(installed).resolve().name)
    try:
        result = rig.cli("run", "-t", "0", "-n", "8", "--lora", "slips/v1", "hello")
        assert not rig.load_fault.exists(), "the fault did not fire: the test proves nothing"
        assert_one_error(result, 5, "the engine could not load adapter 'slips/v1'", "injected load fault")
        assert result.stdout == ""  # not one token of the stand-in
        again = rig.cli("run", "-t", "0", "-n", "8", "--lora", "slips/v1", "hello")
        assert_one_error(again, 5, "could not load adapter", "injected load fault")
        listed = {a["name"]: a for a in json.loads(rig.ok("ls", "--json").stdout)}
        assert listed["slips/v1"]["state"] == "failed" and "injected load fault" in listed["slips/v1"]["error"]
        out = rig.ok("run", "-t", "0", "-n", "10", "--lora", "slips-other/v1", "hello")
        assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hello"), other, 10)) + "\n"
        base_is_reference(rig, reference)
        # The same through an explicit load (vLLM's add_lora, outside a step).
        third = good(demo, tmp_path / "third", name="slips-third")
        rig.ok("pull", str(third), "--name", "slips-third/v1")
        rig.load_fault.write_text(Path(json.loads(rig.ok("show", "slips-third/v1", "--json").stdout)["path"]).resolve().name)
        # Tiers wraps what the engine raised in its own error (exit 1), naming the cause.
        assert_one_error(rig.cli("load", "slips-third/v1"), 1, "could not load adapter 'slips-third/v1'",
                         "injected load fault")
        assert_one_error(rig.cli("run", "--lora", "slips-third/v1", "hello"), 5, "injected load fault")
        # And over HTTP: the OpenAI error schema, a 4xx, the cause in its message.
        fourth = good(demo, tmp_path / "fourth", name="slips-fourth")
        rig.ok("pull", str(fourth), "--name", "slips-fourth/v1")
        rig.load_fault.write_text(Path(json.loads(rig.ok("show", "slips-fourth/v1", "--json").stdout)["path"]).resolve().name)
        response = httpx.post(rig.http + "/v1/chat/completions", timeout=60, json={
            "model": "slips-fourth/v1", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4})
        assert 400 <= response.status_code < 500, response.text
        assert "could not load adapter 'slips-fourth/v1'" in response.json()["error"]["message"]
        base_is_reference(rig, reference)
    finally:
        rig.load_fault.unlink(missing_ok=True)
        for name in ("slips/v1", "slips-other/v1", "slips-third/v1", "slips-fourth/v1"):
            rig.cli("rm", name)


def test_without_the_base_models_shapes_the_engines_loader_still_refuses_a_misfit(demo, tmp_path, reference):
    """The base model's shapes unknown to loractl (weights it cannot read headers of, as a Hub
    id not yet downloaded was): loractl's own shape checks are off, and the preflight's check
    against the engine's buffers refuses an adapter for another model size, wider or narrower
    (vLLM would copy a narrower one into part of its buffers and serve it wrong, silently)."""
    import torch
    from safetensors.torch import load_file

    from adapter_factory import replace_tensors
    from conftest import start_daemon

    root = Path(tempfile.mkdtemp(prefix="lct-pf-", dir="/tmp"))
    model = root / "model-bin"
    shutil.copytree(demo / "model", model)
    torch.save(load_file(model / "model.safetensors"), model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    daemon = start_daemon(root, model=str(model), name="pf")
    try:
        def pull(folder, name):
            return run_cli("pull", str(folder), "--name", name, "--socket", str(daemon.socket))

        key = "base_model.model.model.layers.1.mlp.down_proj.lora_A.weight"
        wider = replace_tensors(good(demo, tmp_path / "wider"), lambda t: t.__setitem__(key, torch.zeros(8, 1024)))
        narrower = replace_tensors(good(demo, tmp_path / "narrower"), lambda t: t.__setitem__(key, torch.zeros(8, 256)))
        assert_one_error(pull(wider, "wider/v1"), 5, "cannot load this adapter", "down_proj", "512")
        assert_one_error(pull(narrower, "narrower/v1"), 5, "cannot load this adapter", "down_proj", "512")
        fine = good(demo, tmp_path / "fine")
        assert pull(fine, "fine/v1").returncode == 0
        out = run_cli("run", "-t", "0", "-n", "8", "--lora", "fine/v1", "hello", "--socket", str(daemon.socket))
        assert out.stdout == reference.text(reference.greedy(reference.chat_ids("hello"), fine, 8)) + "\n"
        assert "shapes unknown" in daemon.log.read_text()
    finally:
        daemon.stop()
        shutil.rmtree(root, ignore_errors=True)
