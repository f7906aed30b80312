"""GGUF files as ``--model``: converted once (keyed by sha256), tokenizer settings carried over,
refusals in one line. Uses the demo's real GGUF (SmolLM2-135M-Instruct, Q4_1) from the cache
that conftest's ``real_demo`` builds."""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from conftest import BIN, REAL_DEMO_CACHE, Reference, collect, start_daemon


@pytest.fixture(scope="module")
def demo_gguf(real_demo) -> Path:
    return next((REAL_DEMO_CACHE / "demo").glob("*.gguf"))


# A two-layer llama of width 128 (two heads of 64, the smallest vLLM's CPU attention takes; random float32 weights) with the demo's real tokenizer: a GGUF
# that converts and starts in seconds, where the demo's 135M parameters take half a minute.
_SHRUNK = {"llama.block_count": 2, "llama.embedding_length": 128, "llama.feed_forward_length": 256,
           "llama.attention.head_count": 2, "llama.attention.head_count_kv": 1, "llama.rope.dimension_count": 64,
           "general.file_type": 0}


def _shrunken_gguf(src: Path, dst: Path, **overrides) -> Path:
    """``src``'s metadata and tokenizer (with ``overrides``: key=value, dots as ``__``) over tiny
    random weights."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(str(src))
    values = {**_SHRUNK, **{k.replace("__", "."): v for k, v in overrides.items()}}
    writer = gguf.GGUFWriter(str(dst), "llama")
    for key, field in reader.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the writer writes these itself
        kind = field.types[0]
        sub = field.types[-1] if kind == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, values.get(key, field.contents()), kind, sub_type=sub)
    width, ffn, heads, kv_heads = (_SHRUNK[f"llama.{k}"] for k in ("embedding_length", "feed_forward_length",
                                                                  "attention.head_count", "attention.head_count_kv"))
    kv_width = width // heads * kv_heads
    vocab = int(reader.fields["llama.vocab_size"].contents())
    rng = np.random.default_rng(0)
    shapes = {"token_embd.weight": (vocab, width), "output_norm.weight": (width,)}
    for b in range(2):
        shapes.update({f"blk.{b}.attn_norm.weight": (width,), f"blk.{b}.ffn_norm.weight": (width,),
                       f"blk.{b}.attn_q.weight": (width, width), f"blk.{b}.attn_k.weight": (kv_width, width),
                       f"blk.{b}.attn_v.weight": (kv_width, width), f"blk.{b}.attn_output.weight": (width, width),
                       f"blk.{b}.ffn_gate.weight": (ffn, width), f"blk.{b}.ffn_up.weight": (ffn, width),
                       f"blk.{b}.ffn_down.weight": (width, ffn)})
    for name, shape in shapes.items():
        data = np.ones(shape) if name.endswith("norm.weight") else rng.normal(0, 0.2, shape)
        writer.add_tensor(name, data.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return dst


def test_a_gguf_that_asks_for_bos_is_served_with_bos(tmp_path, demo_gguf):
    """transformers' GGUF tokenizer drops add_bos_token; the converted folder must not."""
    from loractld.models.gguf import inspect

    gguf = _shrunken_gguf(demo_gguf, tmp_path / "bos.gguf", tokenizer__ggml__add_bos_token=True)
    assert inspect(gguf).add_bos is True
    home = Path(tempfile.mkdtemp(prefix="lct-g-", dir="/tmp"))  # short: socket paths have a limit
    d = start_daemon(home, name="g", model=str(gguf), engine_flags=["--kv-cache-memory", "64MiB"])
    try:
        folder = next((home / "models").glob("gguf-*"))
        marker = json.loads((folder / "loractl-gguf.json").read_text())
        assert marker["sha256"] == __import__("hashlib").sha256(gguf.read_bytes()).hexdigest()
        ref = Reference(folder)
        ids = ref.tokenizer("The three primary colors are")["input_ids"]
        assert ids[0] == ref.tokenizer.bos_token_id == 1  # the converted tokenizer adds BOS as the GGUF says

        async def go():
            async with d.client() as client:
                return await collect(client, prompt="The three primary colors are", max_tokens=16, temperature=0)
        got = asyncio.run(go())
        assert got["prompt_ids"] == ids and got["ids"] == ref.greedy(ids, None, 16)
        log = d.log.read_text()
        assert "converting bos.gguf" in log and "converted bos.gguf" in log
    finally:
        assert d.stop() == 0
    # The same file again finds the converted copy by its hash and does not convert again.
    from loractld.models.gguf import ensure_converted

    assert ensure_converted(gguf, home / "models") == folder
    assert len(list((home / "models").glob("gguf-*"))) == 1
    shutil.rmtree(home, ignore_errors=True)


def _refusal(gguf: Path, tmp_path: Path) -> subprocess.CompletedProcess:
    return subprocess.run([str(BIN / "loractld"), "--model", str(gguf), "--home", str(tmp_path / "h"),
                           "--socket", f"/tmp/lct-gr-{tmp_path.name[-8:]}.sock"],
                          capture_output=True, text=True, timeout=300)


def test_an_architecture_that_cannot_be_converted_is_refused_in_one_line(tmp_path):
    import gguf
    import numpy as np

    path = tmp_path / "odd.gguf"
    writer = gguf.GGUFWriter(str(path), "rwkv7")
    writer.add_block_count(1)
    writer.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    result = _refusal(path, tmp_path)
    assert result.returncode == 1
    assert "odd.gguf: GGUF architecture 'rwkv7' cannot be converted" in result.stderr
    assert "Traceback" not in result.stderr and not list((tmp_path / "h" / "models").glob("*"))


def test_a_disk_too_small_is_refused_before_writing(tmp_path, demo_gguf, monkeypatch):
    import shutil as sh

    from loractl.errors import DiskFull
    from loractld.models import gguf as gguf_import

    real = sh.disk_usage
    monkeypatch.setattr(gguf_import.shutil, "disk_usage",
                        lambda p: real(p)._replace(free=100 << 20))  # 100 MB free; 540 MB needed
    with pytest.raises(DiskFull) as e:
        gguf_import.ensure_converted(demo_gguf, tmp_path / "models")
    assert "needs 0.6 GB" in e.value.message and "0.1 GB are free" in e.value.message
    assert "LORACTL_HOME" in e.value.hint
    assert not [p for p in (tmp_path / "models").iterdir()], "nothing may be written"


def test_a_gguf_file_in_a_hub_repo_is_downloaded_converted_and_served(tmp_path, demo_gguf, real_demo, monkeypatch):
    from hub_stub import HubStub

    from loractld.models.gguf import hub_gguf

    assert hub_gguf("hf://acme/smol-gguf/q4/model.gguf") == ("acme/smol-gguf", "q4/model.gguf")
    assert hub_gguf("acme/smol-gguf/model.gguf") == ("acme/smol-gguf", "model.gguf")
    assert hub_gguf("./acme/x/model.gguf") is None and hub_gguf(str(demo_gguf)) is None
    home = Path(tempfile.mkdtemp(prefix="lct-gh-", dir="/tmp"))
    (home / "models").symlink_to(REAL_DEMO_CACHE / "models")  # the same bytes: found by hash, not converted again
    with HubStub() as stub:
        stub.add_commit("acme/smol-gguf", {"q4/smollm2.gguf": demo_gguf.read_bytes()})
        monkeypatch.setenv("HF_ENDPOINT", stub.endpoint)
        monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
        missing = _refusal(Path("acme/smol-gguf/nope.gguf"), tmp_path)
        assert missing.returncode == 1 and "the Hub repo acme/smol-gguf has no file 'nope.gguf'" in missing.stderr
        d = start_daemon(home, name="h", model="hf://acme/smol-gguf/q4/smollm2.gguf", engine_flags=[])
    try:
        log = d.log.read_text()
        assert "downloading q4/smollm2.gguf from the Hub repo acme/smol-gguf" in log
        assert "converted from smollm2.gguf earlier" in log
        # what keeping it quantized would save, said at each start (issue 59): its float weights and the file's bytes
        cost = re.search(r"served unquantized: ([\d.]+) GB of weights on the device, against ([\d.]+) GB in the GGUF", log)
        assert cost and float(cost[1]) > float(cost[2]) > 0, log[-2000:]
        ref = Reference(real_demo["model"])

        async def go():
            async with d.client() as client:
                return await collect(client, prompt="The three primary colors are", max_tokens=12, temperature=0)
        got = asyncio.run(go())
        assert got["ids"] == ref.greedy(ref.tokenizer("The three primary colors are")["input_ids"], None, 12)
    finally:
        d.stop()
        shutil.rmtree(home, ignore_errors=True)


def test_conversion_and_training_report_their_progress(tmp_path, demo_gguf, monkeypatch):
    """What `status` shows during a first start: tensors converted, then steps trained with the loss."""
    from loractld.models import demo
    from loractld.models.demo_train import TrainSpec
    from loractld.models.gguf import ensure_converted, inspect

    gguf = _shrunken_gguf(demo_gguf, tmp_path / "small.gguf")
    reports = []
    folder = ensure_converted(gguf, tmp_path / "models", report=lambda stage, message, **kw: reports.append(((stage, message), kw)))
    tensors = inspect(gguf).tensors
    converting = [kw for (stage, message), kw in reports if stage == "convert" and message.startswith("converting")]
    assert converting[0] == {"total": tensors, "unit": "tensors"}  # announced before the child starts
    counted = [kw["done"] for kw in converting[1:]]
    assert counted == list(range(1, tensors + 1)) and tensors == 20, counted

    monkeypatch.setattr(demo, "ADAPTERS", {"pirate/v1": TrainSpec("pirate", steps=3, batch_size=2)})
    reports.clear()
    demo.ensure_adapters(folder, tmp_path / "demo", lambda stage, message, **kw: reports.append(((stage, message), kw)))
    assert [a for a, _ in reports] == [("train", "training demo adapter pirate/v1 (once)")] * 4
    steps = [kw for _, kw in reports[1:]]
    assert [(kw["done"], kw["total"], kw["unit"]) for kw in steps] == [(1, 3, "steps"), (2, 3, "steps"), (3, 3, "steps")]
    assert all(re.fullmatch(r"loss \d+\.\d{3}", kw["detail"]) for kw in steps), steps


def test_the_demo_builder_child_reports_its_stages_to_the_daemon(real_demo):
    """The build runs in a child; its progress lines reach the daemon's report (here: all built,
    so the one stage is the check for a converted copy)."""
    from loractld.models.demo import build_in_child

    reports = []
    model = build_in_child(REAL_DEMO_CACHE, report=lambda stage, message, **kw: reports.append(((stage, message), kw)))
    assert model == real_demo["model"]
    assert ("convert", "checking SmolLM2-135M-Instruct.Q4_1.gguf for a converted copy") in [a for a, _ in reports]
