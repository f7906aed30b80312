"""The daemon starts on CUDA with its defaults: nothing in its process initializes CUDA before
vLLM starts its engine core (a forked core cannot use CUDA the parent initialized), and what
``status`` reports is what vLLM settled on. Run here with a torch whose CUDA entry points
record their callers (tests/cuda_spy.py); see loractld/engine/device.py for the why."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from conftest import CUDA_SPY as SPY


def _spied(tmp_path: Path, code: str, env: dict[str, str]) -> list[dict]:
    sys.path.insert(0, str(SPY.parent))
    import cuda_spy

    script, record = tmp_path / "prog.py", tmp_path / "record.jsonl"
    script.write_text(code)
    clean = {k: v for k, v in os.environ.items() if k != "PYTORCH_NVML_BASED_CUDA_CHECK"}
    result = subprocess.run([sys.executable, str(SPY), str(record), str(script)], env={**clean, **env},
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert record.exists() and "spy installed" in record.read_text()  # the spy really ran
    return cuda_spy.calls(str(record))


def test_the_spy_sees_the_call_that_poisons_fork(tmp_path):
    """What the daemon did before: torch.cuda.is_available() with the variable unset."""
    found = _spied(tmp_path, "import torch\nassert not torch.cuda.is_available()\n", {})
    assert [c["call"] for c in found] == [
        "torch._C._cuda_getDeviceCount (cudaGetDeviceCount: initializes CUDA, poisons fork)"]


def test_auto_device_is_resolved_through_nvml_only(tmp_path):
    code = ("from loractld.engine.device import resolve_device\n"
            "assert resolve_device('auto') == 'cpu', 'the CPU wheel: vLLM finds no GPU'\n"
            "import os, torch\n"
            "assert os.environ['PYTORCH_NVML_BASED_CUDA_CHECK'] == '1'\n"
            "assert not torch.cuda.is_available()  # anyone's later check stays on NVML too\n")
    assert _spied(tmp_path, code, {}) == []


def test_auto_device_follows_vllms_platform(monkeypatch):
    import vllm.platforms

    from loractld.engine.device import resolve_device

    for platform, device in ((SimpleNamespace(is_cuda=lambda: True, is_cpu=lambda: False), "cuda"),
                             (SimpleNamespace(is_cuda=lambda: False, is_cpu=lambda: True), "cpu")):
        monkeypatch.setattr(vllm.platforms, "_current_platform", platform)
        assert resolve_device("auto") == device
    monkeypatch.setattr(vllm.platforms, "_current_platform",
                        SimpleNamespace(is_cuda=lambda: False, is_cpu=lambda: False, device_name="tpu"))
    from loractl.errors import EngineUnavailable

    with pytest.raises(EngineUnavailable, match="tpu") as info:
        resolve_device("auto")
    assert "--device cpu" in info.value.hint


def test_a_default_start_never_initializes_cuda_in_the_daemon(hooked, home):
    """loractld --device auto, the whole start (model check, demo assets, engine) and a
    generation with an adapter, under the spy: no CUDA call in the daemon's own process. The
    daemon is conftest's ``hooked`` (started under the spy, shared with the modules that arm
    its test hooks); its fixture checks the record again after its stop, over its whole life."""
    d = hooked.daemon

    async def use():
        async with d.client() as c:
            status = await c.status()
            text = "".join([chunk.text async for chunk in c.generate(
                "hello", lora=str(home / "tiny" / "adapters" / "sql-expert/v1"), max_tokens=4, temperature=0)])
            return status, text
    status, text = asyncio.run(use())
    assert status["engine"]["device"] == "cpu" and status["engine"]["dtype"] == "float32"
    assert int(status["engine"]["kv_cache_bytes"]) == 64 << 20 and text
    found = hooked.cuda_calls()
    assert found == [], "CUDA touched in the daemon before/while serving:\n" + "\n".join(
        c["call"] + "\n" + "".join(c["stack"]) for c in found)


def test_status_reports_what_vllm_settled_on_cuda():
    """On CUDA the start asks for dtype auto and no KV size; status shows vLLM's choices."""
    import torch

    from loractld.engine.device import kv_cache_bytes, settled_dtype

    model = SimpleNamespace(dtype=torch.bfloat16, get_num_layers=lambda p: 32, get_num_kv_heads=lambda p: 8,
                            get_head_size=lambda: 128)
    config = SimpleNamespace(model_config=model, parallel_config=None,
                             cache_config=SimpleNamespace(num_gpu_blocks=1000, block_size=16, cache_dtype="auto"))
    assert settled_dtype(config) == "bfloat16"
    # 1000 blocks x 16 tokens x 32 layers x (K, V) x 8 heads x 128 x 2 bytes
    assert kv_cache_bytes(config) == 1000 * 16 * 32 * 2 * 8 * 128 * 2
    config.cache_config.cache_dtype = "fp8"
    assert kv_cache_bytes(config) == 1000 * 16 * 32 * 2 * 8 * 128
    config.cache_config.num_gpu_blocks = None
    assert kv_cache_bytes(config) is None
