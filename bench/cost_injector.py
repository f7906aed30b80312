"""A GPU's cost ratios on a CPU: a vLLM general plugin that pads steps and charges exchanges.

Loaded into loractl's engine and into vLLM's own server alike (``environment()`` below puts it
on both processes' path as a ``vllm.general_plugins`` entry point, nothing is installed), so
that the two systems pay the same costs and differ only in how they schedule adapters:

- ``LORACTL_BENCH_STEP_MS``: every step that runs the model takes at least this long (the
  worker's ``execute_model`` sleeps out the rest). Set above the CPU's own step time, a step
  costs the same whatever its batch and however many adapters it mixes: a GPU's decode, which
  is memory-bound and nearly free to widen.
- ``LORACTL_BENCH_EXCHANGE_MS``: each copy of an adapter into a device slot
  (``LoRAModelManager.activate_adapter`` that did copy) costs this much more, inside the step,
  as the real copy does.
- ``LORACTL_BENCH_DISK_MS``: each load of an adapter from its files (the worker manager's
  ``_load_adapter``, a host-cache miss) costs this much more, inside the step.
- ``LORACTL_BENCH_COST_LOG``: a folder; each process appends one line per charged event to
  ``<pid>.log`` (``exchange`` or ``disk``), so a benchmark can count them per system.

With none of these set the plugin patches nothing. It is a benchmark's instrument, not part of
loractl: it lives in ``bench/`` and is never on a daemon's path unless a benchmark puts it there.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

STEP_MS, EXCHANGE_MS, DISK_MS, LOG = ("LORACTL_BENCH_STEP_MS", "LORACTL_BENCH_EXCHANGE_MS", "LORACTL_BENCH_DISK_MS",
                                      "LORACTL_BENCH_COST_LOG")
PLUGIN = "loractl_bench_cost"


def environment(folder: Path, *, step_ms: float, exchange_ms: float, disk_ms: float, log: Path | None) -> dict:
    """Environment variables that load this plugin in every vLLM process started with them:
    a copy of this file and a ``.dist-info`` naming it as an entry point, in ``folder``."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{PLUGIN}.py").write_text(Path(__file__).read_text())
    info = folder / f"{PLUGIN}-0.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {PLUGIN}\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.general_plugins]\n{PLUGIN} = {PLUGIN}:register\n")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    env = {"PYTHONPATH": path, STEP_MS: str(step_ms), EXCHANGE_MS: str(exchange_ms), DISK_MS: str(disk_ms)}
    if log is not None:
        log.mkdir(parents=True, exist_ok=True)
        env[LOG] = str(log)
    return env


def counts(log: Path, pids: set[int] | None = None) -> dict[str, int]:
    """Charged events so far, per kind, over the processes' logs in ``log`` (all, or ``pids``)."""
    out = {"exchange": 0, "disk": 0}
    for file in log.glob("*.log"):
        if pids is None or int(file.stem) in pids:
            for line in file.read_text().split():
                out[line] = out.get(line, 0) + 1
    return out


def _ms(name: str) -> float:
    try:
        return max(0.0, float(os.environ.get(name, "0")))
    except ValueError:
        return 0.0


def _note(kind: str) -> None:
    folder = os.environ.get(LOG)
    if folder:
        with open(Path(folder) / f"{os.getpid()}.log", "a") as f:
            f.write(kind + "\n")


def _padded_step(execute_model, step_s: float):
    @functools.wraps(execute_model)
    def execute(self, scheduler_output, *args, **kwargs):
        began = time.perf_counter()
        out = execute_model(self, scheduler_output, *args, **kwargs)
        if scheduler_output.total_num_scheduled_tokens > 0:   # an idle step does no work on a GPU either
            left = step_s - (time.perf_counter() - began)
            if left > 0:
                time.sleep(left)
        return out

    execute._loractl_bench_cost = "step"   # type: ignore[attr-defined]
    return execute


def _charged(fn, kind: str, cost_s: float, *, only_if_true: bool):
    @functools.wraps(fn)
    def charged(*args, **kwargs):
        out = fn(*args, **kwargs)
        if out or not only_if_true:   # activate_adapter answers False when the adapter was already in a slot
            time.sleep(cost_s)
            _note(kind)
        return out

    charged._loractl_bench_cost = kind   # type: ignore[attr-defined]
    return charged


def register() -> None:
    step, exchange, disk = _ms(STEP_MS), _ms(EXCHANGE_MS), _ms(DISK_MS)
    if not (step or exchange or disk or os.environ.get(LOG)):
        return
    from vllm.lora.model_manager import LoRAModelManager
    from vllm.lora.worker_manager import WorkerLoRAManager
    from vllm.v1.worker.gpu_worker import Worker

    if getattr(Worker, "_loractl_bench_cost", False):   # vLLM loads general plugins more than once a process
        return
    Worker._loractl_bench_cost = True
    if step:
        Worker.execute_model = _padded_step(Worker.execute_model, step / 1000)
    LoRAModelManager.activate_adapter = _charged(LoRAModelManager.activate_adapter, "exchange", exchange / 1000,
                                                 only_if_true=True)
    WorkerLoRAManager._load_adapter = _charged(WorkerLoRAManager._load_adapter, "disk", disk / 1000,
                                               only_if_true=False)
