"""Run a Python program with torch's CUDA entry points recording who calls them.

usage: python tests/cuda_spy.py RECORD SCRIPT [ARGS...]

On this CPU machine torch has no CUDA, so ``torch.cuda.is_available()`` returns at once and
nothing could ever initialize CUDA. The spy gives ``torch.cuda`` the behaviour of a CUDA build
whose NVML sees no GPU: ``is_available()`` without ``PYTORCH_NVML_BASED_CUDA_CHECK=1`` makes the
runtime call ``cudaGetDeviceCount`` (which initializes the CUDA driver and poisons fork), and
that call and ``torch.cuda._lazy_init`` (every real CUDA use) append the caller's stack to
RECORD as a JSON line, with this process's pid. The NVML-based count (the variable set, and
``device_count()``) answers 0 devices without recording: that path keeps fork safe. Child processes started with spawn (vLLM's engine
core on the CPU) do not run the spy; a forked child carries it, and records with its own pid.
"""

from __future__ import annotations

import json
import os
import runpy
import sys
import traceback


def install(record: str) -> None:
    import torch

    def note(call: str) -> None:
        with open(record, "a") as f:
            f.write(json.dumps({"pid": os.getpid(), "call": call,
                                "stack": traceback.format_stack(limit=12)[:-2]}) + "\n")

    def runtime_count() -> int:
        note("torch._C._cuda_getDeviceCount (cudaGetDeviceCount: initializes CUDA, poisons fork)")
        return 0

    def is_available() -> bool:  # torch.cuda.is_available's own logic, for a CUDA build
        return device_count() > 0 if os.getenv("PYTORCH_NVML_BASED_CUDA_CHECK") == "1" else runtime_count() > 0

    def device_count() -> int:  # NVML works and sees no GPU: no runtime call
        return 0

    real_lazy_init = torch.cuda._lazy_init

    def lazy_init() -> None:
        note("torch.cuda._lazy_init (CUDA initialized)")
        real_lazy_init()

    # Patched in torch.cuda's namespace, not torch._C: a torch._C that claims CUDA makes
    # torch's own modules import CUDA symbols this CPU build does not have.
    torch.cuda.is_available = is_available
    torch.cuda.device_count = device_count
    torch.cuda._lazy_init = lazy_init
    with open(record, "a") as f:
        f.write(json.dumps({"pid": os.getpid(), "call": "spy installed"}) + "\n")


def calls(record: str, pid: int | None = None) -> list[dict]:
    """The CUDA calls RECORD holds (of process ``pid``, if given), without the spy's own line."""
    if not os.path.exists(record):
        return []
    with open(record) as f:
        lines = [json.loads(line) for line in f if line.strip()]
    return [c for c in lines if c["call"] != "spy installed" and (pid is None or c["pid"] == pid)]


if __name__ == "__main__":
    record_file, script = sys.argv[1], sys.argv[2]
    install(record_file)
    sys.argv = sys.argv[2:]
    runpy.run_path(script, run_name="__main__")
