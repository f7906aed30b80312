"""The engine's OpenMP threads are placed as vLLM's own server places them: a thread per bound
core, a core left for the rest (docs/benchmarks.md, "CPU contention").

Without it the engine core (which holds its worker: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``) ran an
unbound OpenMP thread per core, and any other busy process on the machine stalled each parallel
region: a tenth of vLLM's server's tokens/s beside the same CPU-bound job.
"""

from __future__ import annotations

import asyncio
import os

import psutil

from conftest import collect


def _cores(spec: str) -> set[int]:
    """``0``, ``0,2-3`` (GOMP_CPU_AFFINITY) or ``{0,2,3}`` (OMP_PLACES) as a set of core ids."""
    cores: set[int] = set()
    for part in spec.strip("{}").replace(" ", ",").split(","):
        if "-" in part:
            low, high = part.split("-")
            cores.update(range(int(low), int(high) + 1))
        elif part:
            cores.add(int(part))
    return cores


def _environ(pid: int) -> dict[str, str]:
    """/proc/PID/environ read as is: vLLM renames the engine core (``VLLM::EngineCore``) by
    writing over its argv, which leaves empty entries psutil's ``environ()`` stops at."""
    with open(f"/proc/{pid}/environ", "rb") as f:
        entries = f.read().decode(errors="replace").split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_the_engine_runs_one_openmp_thread_per_bound_core_and_leaves_a_core_free(daemon):
    async def one_request():
        async with daemon.client() as client:
            return await collect(client, messages=[{"role": "user", "content": "hi"}], max_tokens=4, temperature=0.0)

    assert asyncio.run(one_request())["ids"], "the engine answered"  # a parallel region has run
    engines = [p for p in psutil.Process(daemon.proc.pid).children() if "EngineCore" in " ".join(p.cmdline())
               or p.name().startswith("VLLM")]
    assert len(engines) == 1, [p.cmdline() for p in psutil.Process(daemon.proc.pid).children()]
    environ = _environ(engines[0].pid)
    threads = int(environ["OMP_NUM_THREADS"])
    placed = _cores(environ.get("GOMP_CPU_AFFINITY") or environ["OMP_PLACES"])
    assert threads == len(placed) >= 1
    # The engine's main thread is OpenMP's first thread: bound to the placed cores, not all of them.
    bound = os.sched_getaffinity(engines[0].pid)
    assert bound <= placed, (bound, placed)
    machine = os.sched_getaffinity(0)
    if len(machine) >= 2:
        assert placed < machine, "a core is left for the daemon and the scheduler, as vLLM's server leaves one"
