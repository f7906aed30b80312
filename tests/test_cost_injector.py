"""bench/cost_injector.py, the plugin that gives a CPU a GPU's cost ratios (issue 58, item 4):
it patches what it says in this vLLM, and pads and charges what it says. The sweep that uses it
is measured by running bench/exchange_sweep.py (docs/benchmarks.md), not here."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace

from conftest import REPO

sys.path.insert(0, str(REPO / "bench"))
import cost_injector  # noqa: E402


def test_a_step_is_padded_to_the_set_time_and_an_idle_one_is_not():
    step = cost_injector._padded_step(lambda self, out: "done", 0.05)
    began = time.perf_counter()
    assert step(None, SimpleNamespace(total_num_scheduled_tokens=3)) == "done"
    assert time.perf_counter() - began >= 0.05
    began = time.perf_counter()
    step(None, SimpleNamespace(total_num_scheduled_tokens=0))
    assert time.perf_counter() - began < 0.04


def test_an_exchange_is_charged_only_when_it_copied(tmp_path, monkeypatch):
    monkeypatch.setenv(cost_injector.LOG, str(tmp_path))
    activate = cost_injector._charged(lambda lora_id: lora_id == 1, "exchange", 0.05, only_if_true=True)
    began = time.perf_counter()
    assert activate(1) is True
    assert time.perf_counter() - began >= 0.05
    assert activate(2) is False   # already in a slot: no copy, no charge
    load = cost_injector._charged(lambda request: "model", "disk", 0.0, only_if_true=False)
    assert load("req") == "model"
    assert cost_injector.counts(tmp_path) == {"exchange": 1, "disk": 1}
    assert cost_injector.counts(tmp_path, pids={os.getpid() + 1}) == {"exchange": 0, "disk": 0}


def test_the_plugin_is_found_by_vllm_and_wraps_its_three_targets(tmp_path):
    """Through vLLM's own plugin loader, in a fresh process with only the environment the
    benchmark sets: a vLLM that renamed a target would fail here, not skew a sweep."""
    env = {**os.environ, **cost_injector.environment(tmp_path / "plugin", step_ms=5, exchange_ms=1, disk_ms=2,
                                                      log=tmp_path / "log")}
    probe = (
        "import json\n"
        "from vllm.plugins import load_general_plugins\n"
        "load_general_plugins()\n"
        "from vllm.lora.model_manager import LoRAModelManager\n"
        "from vllm.lora.worker_manager import WorkerLoRAManager\n"
        "from vllm.v1.worker.gpu_worker import Worker\n"
        "print(json.dumps({name: getattr(fn, '_loractl_bench_cost', None) for name, fn in (\n"
        "    ('step', Worker.execute_model), ('exchange', LoRAModelManager.activate_adapter),\n"
        "    ('disk', WorkerLoRAManager._load_adapter))}))\n")
    done = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    wrapped = json.loads(done.stdout.strip().splitlines()[-1])
    assert wrapped == {"step": "step", "exchange": "exchange", "disk": "disk"}
