"""An adapter used in place (a folder given to --lora) is served from a private copy named by
its content, so what preflight checked is what the engine loads, whatever happens to the folder
afterwards; and a failure copying an adapter into a device slot inside a step cannot end the
engine (issue 37, finding 1). A real daemon and engine; outputs checked against HF + PEFT."""

from __future__ import annotations

import asyncio
import hashlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from adapter_factory import good, replace_tensors
from conftest import collect
from loractl import Client
from loractl.errors import LoractlError
from loractld.store.disk import files_digest
from loractld.store.validate import CONFIG_FILE, WEIGHTS_FILE

ADAPTERS = ("sql-expert/v1", "poet/v1")   # same rank and targets: same file size, other weights


@pytest.fixture(scope="module")
def isolated(hooked):
    """conftest's ``hooked`` daemon (its own home; pause points, the activation fault and the
    poison armable through files)."""
    return hooked.daemon, hooked.root, hooked.pauses, hooked.activate_fault


def _copy(src: Path, dest: Path) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in (CONFIG_FILE, WEIGHTS_FILE):
        shutil.copyfile(src / name, dest / name)
    return dest


def _ask(sock, lora: str | None) -> list[int]:
    async def go():
        async with Client(sock) as client:
            return (await collect(client, messages=[{"role": "user", "content": "hi"}], lora=lora, max_tokens=8,
                                  min_tokens=8, temperature=0.0))["ids"]
    return asyncio.run(go())


def _wrong_shapes(tensors):
    import torch

    for key in [k for k in tensors if k.endswith("lora_A.weight")]:
        tensors[key] = torch.randn(tensors[key].shape[0], tensors[key].shape[1] * 2)


def test_a_folder_rewritten_after_its_preflight_is_served_as_checked(isolated, demo, reference, tmp_path):
    """The folder passes preflight, then (held at the 'preflighted' point, as a request waiting
    at the gate would be) its weights are replaced by ones of the wrong size under the same
    names. Before, vLLM then loaded the new bytes inside a step: set_lora raised and the engine
    died. Now the request is served from the checked copy, as the reference says."""
    d, root, pauses, _ = isolated
    folder = _copy(demo / "adapters" / ADAPTERS[0], tmp_path / "live")
    expected = reference.greedy(reference.chat_ids("hi"), demo / "adapters" / ADAPTERS[0], 8, 8)
    arming = pauses / "preflighted"
    arming.touch()
    got: dict = {}
    runner = threading.Thread(target=lambda: got.update(ids=_ask(d.socket, str(folder))))
    runner.start()
    deadline = time.monotonic() + 120
    while not (pauses / "preflighted.reached").exists():
        assert time.monotonic() < deadline and runner.is_alive(), "the request never reached its preflight"
        time.sleep(0.05)
    replace_tensors(folder, _wrong_shapes)
    arming.unlink()
    runner.join(120)
    assert got.get("ids") == expected
    assert d.proc.poll() is None
    assert _ask(d.socket, None) == reference.greedy(reference.chat_ids("hi"), None, 8, 8)


def test_a_same_size_rewrite_with_its_mtime_restored_is_seen(isolated, demo, reference, tmp_path):
    """Before, the folder's digest was cached by path, inode, size and mtime: a same-size rewrite
    that restored the mtime was never hashed again, and the new bytes were served under the
    old content's name once vLLM reloaded them. The ctime moves with any write."""
    d, *_ = isolated
    folder = _copy(demo / "adapters" / ADAPTERS[0], tmp_path / "edited")
    first = _ask(d.socket, str(folder))
    assert first == reference.greedy(reference.chat_ids("hi"), demo / "adapters" / ADAPTERS[0], 8, 8)
    weights = folder / WEIGHTS_FILE
    before = weights.stat()
    shutil.copyfile(demo / "adapters" / ADAPTERS[1] / WEIGHTS_FILE, weights)
    assert weights.stat().st_size == before.st_size
    os.utime(weights, ns=(before.st_atime_ns, before.st_mtime_ns))
    other = _copy(folder, tmp_path / "other-copy")   # the reference keys by path: a path of its own
    assert _ask(d.socket, str(folder)) == reference.greedy(reference.chat_ids("hi"), other, 8, 8) != first


def test_a_failed_copy_into_a_device_slot_fails_that_request_only(isolated, demo, reference, tmp_path):
    """The activation (set_lora into a slot, inside a step) fails once, injected: the request
    is refused in one line before any token, the engine keeps serving, and the content is
    marked failed."""
    d, _, _, fault = isolated
    folder = good(demo, tmp_path / "activate", name="activate-fault/v1")  # content of its own: marked failed after
    records = [{"name": n, "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest()}
               for n in (CONFIG_FILE, WEIGHTS_FILE)]
    engine_id = int(files_digest(records)[:8], 16) & ((1 << 31) - 1) or 1
    fault.write_text(str(engine_id))
    with pytest.raises(LoractlError) as refused:
        _ask(d.socket, str(folder))
    assert refused.value.kind == "invalid_adapter" and "injected activation fault" in refused.value.message, \
        (refused.value.message, d.log_tail(60))
    assert not fault.exists(), "the fault was not reached: the adapter took another id"
    assert d.proc.poll() is None
    assert _ask(d.socket, None) == reference.greedy(reference.chat_ids("hi"), None, 8, 8)
    assert _ask(d.socket, str(demo / "adapters" / ADAPTERS[0])) == reference.greedy(
        reference.chat_ids("hi"), demo / "adapters" / ADAPTERS[0], 8, 8)


def test_an_adapter_with_a_nan_weight_never_reaches_the_engine(isolated, demo, reference, tmp_path):
    """Issue 37, finding 2: one NaN weight, served, turned the adapter's answer to token 0 and
    then other clients' base-model answers too (stale non-finite values in reused KV blocks:
    reproduced on the CPU engine). It is refused at first use by folder and by a name placed by
    hand, before the engine loads it; every other answer beside it stays the reference's."""
    d, root, _, _ = isolated

    def nan(tensors):
        key = sorted(k for k in tensors if "lora_B" in k)[0]
        tensors[key] = tensors[key].clone()
        tensors[key].view(-1)[5] = float("nan")

    folder = replace_tensors(_copy(demo / "adapters" / ADAPTERS[0], tmp_path / "nan"), nan)
    placed = root / "adapters" / "poison" / "v1"
    _copy(folder, placed)
    base = reference.greedy(reference.chat_ids("hi"), None, 8, 8)
    for lora in (str(folder), "poison/v1"):
        with pytest.raises(LoractlError) as refused:
            _ask(d.socket, lora)
        assert refused.value.kind == "invalid_adapter" and "not finite (NaN or inf)" in refused.value.message
        assert _ask(d.socket, None) == base
    assert _ask(d.socket, str(demo / "adapters" / ADAPTERS[1])) == reference.greedy(
        reference.chat_ids("hi"), demo / "adapters" / ADAPTERS[1], 8, 8)
    shutil.rmtree(placed.parent)


def _ask_ids(sock, prompt_ids: list[int], lora: str | None, n: int = 12) -> list[int]:
    async def go():
        async with Client(sock) as client:
            ids = []
            async for chunk in client.generate(reference_text(prompt_ids), lora=lora, max_tokens=n, min_tokens=n,
                                               temperature=0.0):
                ids += chunk.token_ids
            return ids
    return asyncio.run(go())


def reference_text(ids):  # set by the test: prompts are sent as text, checked as ids
    return _TEXTS[tuple(ids)]


_TEXTS: dict = {}


def test_an_adapter_that_turns_nan_in_the_engine_changes_no_other_answer(isolated, demo, reference, tmp_path):
    """The last line behind the refusals: an adapter whose values go non-finite inside the engine
    (injected: its lora_B weights set to NaN as it loads) answers garbage itself, but every
    base-model and adapter answer after it equals HF + PEFT. Before the engine scrubbed fresh KV
    blocks, a later request of another client was turned to token 0 by the NaN values its
    freed blocks kept (issue 37, finding 2)."""
    d, root, _, _ = isolated
    folder = good(demo, tmp_path / "poisoned", name="poisoned/v1")   # new content: loaded (and poisoned) now
    records = [{"name": n, "sha256": hashlib.sha256((folder / n).read_bytes()).hexdigest()}
               for n in (CONFIG_FILE, WEIGHTS_FILE)]
    (root / "poison").write_text(files_digest(records)[:16])   # its private copy's folder name
    texts = [f"Tell me about item number {i} " + "and more " * i for i in range(10)]
    prompts = [reference.tokenizer(t)["input_ids"] for t in texts]
    _TEXTS.update({tuple(p): t for p, t in zip(prompts, texts)})
    poisoned = _ask_ids(d.socket, prompts[0], str(folder), n=24)
    assert not (root / "poison").exists(), "the poison was not reached"
    assert set(poisoned) == {0}, poisoned   # NaN logits: what the engine makes of them
    wrong = [i for i, p in enumerate(prompts) if _ask_ids(d.socket, p, None) != reference.greedy(p, None, 12, 12)]
    assert wrong == [], f"base-model answers changed after the NaN adapter: prompts {wrong}"
    other = demo / "adapters" / ADAPTERS[0]
    assert _ask_ids(d.socket, prompts[1], str(other)) == reference.greedy(prompts[1], other, 12, 12)
