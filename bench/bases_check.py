"""The bases users run, on a lent device (issue 59): a small quantized base and a small
mixture-of-experts base, each with an adapter, checked against HF + PEFT on this machine's CPU.
Run by scripts/gpu_check.sh (step ``bases``); runs on the CPU too (``--device cpu``), which is how
it was checked before any lease.

    python bench/bases_check.py --device cuda --workdir /tmp/bases --out bases.json

The models are built here (tests/quantized_factory.py, tests/moe_factory.py): a tiny Llama as a
4-bit AWQ (and GPTQ) checkpoint with its dequantized float32 twin, and a random Qwen3-MoE, with
adapters made by ``peft``. ``--model`` is not used (the bases are these). Checks:

- each quantized base, and an adapter trained on its float twin: the chosen tokens' logprobs
  against HF + PEFT on the twin in float32 (the gap is written; it passes under ``--tolerance``);
- the MoE base and its attention adapter: the same comparison (on the model itself);
- the MoE expert adapters (``models.moe``): on the CPU both forms are refused by name; on a GPU
  the per-expert one (the form vLLM takes for Qwen3-MoE) is compared with the base merged with
  it by hand in float32, and PEFT's fused form is refused by name.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))
import _setup  # noqa: E402

PROMPTS = ["hello world", "The quick brown fox", "def main():"]
TOKENS = 12


async def _pull(socket: Path, folder: Path, name: str) -> str:
    """'' when pulled, else the daemon's one-line refusal."""
    from loractl import Client
    from loractl.errors import LoractlError

    try:
        async with Client(socket) as client:
            async for _ in client.pull(str(folder), name=name):
                pass
        return ""
    except LoractlError as e:
        return f"{e.message} (hint: {e.hint})"


def _served(socket: Path, lora: str | None):
    from loractl import Client
    from quantized_factory import served

    async def go():
        async with Client(socket) as client:
            return await served(client, PROMPTS, TOKENS, lora)
    return asyncio.run(go())


def compare(socket: Path, reference: Path, lora: str | None, adapter: Path | None, tolerance: float) -> dict:
    from quantized_factory import gap, hf_logprobs

    runs = _served(socket, lora)
    measured = gap([r[2] for r in runs], hf_logprobs(reference, adapter, runs))
    return {"max_logprob_gap": round(measured, 5), "pass": measured < tolerance, "tokens": [r[1] for r in runs]}


def check_quantized(fmt: str, args, work: Path, tokenizer: Path) -> dict:
    import quantized_factory

    root = work / fmt
    folder, twin = root / "quantized" / f"tiny-llama-{fmt.upper()}", root / "float" / "tiny-llama"
    quantized_factory.build(folder, twin, tokenizer, fmt=fmt)
    quantized_factory.build_adapter(twin, root / "a-float")
    (root / "home").mkdir(exist_ok=True)
    started = time.monotonic()
    daemon = _setup.Daemon(str(folder), args, root / "home")
    try:
        out = {"start_s": round(time.monotonic() - started, 1), "base": compare(daemon.socket, twin, None, None,
                                                                                 args.tolerance)}
        refused = asyncio.run(_pull(daemon.socket, root / "a-float", f"{fmt}/float"))
        out["adapter"] = {"pass": False, "refused": refused} if refused else compare(
            daemon.socket, twin, f"{fmt}/float", root / "a-float", args.tolerance)
        return out
    finally:
        daemon.stop()


def check_moe(args, work: Path, tokenizer: Path) -> dict:
    import moe_factory

    root = work / "moe"
    folder = moe_factory.build(root, tokenizer)
    (root / "home").mkdir(exist_ok=True)
    started = time.monotonic()
    daemon = _setup.Daemon(str(folder), args, root / "home")
    try:
        out = {"start_s": round(time.monotonic() - started, 1),
               "base": compare(daemon.socket, folder, None, None, args.tolerance)}
        refused = asyncio.run(_pull(daemon.socket, root / "a-attn", "moe/attn"))
        out["attention_adapter"] = {"pass": False, "refused": refused} if refused else compare(
            daemon.socket, folder, "moe/attn", root / "a-attn", args.tolerance)
        per_expert = moe_factory.per_expert_adapter(root, "a-per-expert")
        refused = asyncio.run(_pull(daemon.socket, per_expert, "moe/per-expert"))
        if args.device == "cpu":
            out["per_expert_adapter"] = {"refused": refused, "pass": "no CPU kernel runs expert LoRA" in refused}
        else:
            reference = moe_factory.merged(folder, per_expert, root / "moe-merged")
            out["per_expert_adapter"] = {"pass": False, "refused": refused} if refused else compare(
                daemon.socket, reference, "moe/per-expert", None, args.tolerance)
        refused = asyncio.run(_pull(daemon.socket, root / "a-experts", "moe/fused"))
        expected = "no CPU kernel runs expert LoRA" if args.device == "cpu" else "as per-expert modules"
        out["fused_expert_adapter"] = {"refused": refused, "pass": expected in refused}
        return out
    finally:
        daemon.stop()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=1)
    p.add_argument("--formats", default="awq,gptq", help="quantized formats to build and check")
    p.add_argument("--tolerance", type=float, default=0.02,
                   help="largest logprob gap that passes (0.0005 measured on the CPU; a GPU's float16 kernels differ)")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    work = _setup.workdir(args.workdir)
    from loractld.models.tiny import build_tokenizer

    tokenizer = work / "tokenizer"
    build_tokenizer(tokenizer)
    report: dict = {"machine": _setup.machine(), "versions": _setup.versions(), "device": args.device,
                    "tolerance": args.tolerance, "checks": {}}
    for fmt in args.formats.split(","):
        report["checks"][fmt] = check_quantized(fmt, args, work, tokenizer)
    report["checks"]["moe"] = check_moe(args, work, tokenizer)
    passed = all(part.get("pass", True) for check in report["checks"].values() for part in check.values()
                 if isinstance(part, dict))
    report["pass"] = passed
    _setup.write(report, args.out)
    sys.exit(0 if passed else 1)


if __name__ == "__main__":
    main()
