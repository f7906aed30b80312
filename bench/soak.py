"""Soak: many load/evict/pin/unpin/rm cycles over more adapters than slots, with generation from
concurrent clients, watching the daemon's and the engine's memory and file descriptors.

    .venv/bin/python bench/soak.py --cycles 1000 --out bench/results/soak-cpu.json

Each cycle does one tier operation chosen by a seeded RNG over ``--adapters`` adapters
(``load --to device|host``, ``evict --from device|host``, ``pin``, ``unpin``, ``rm`` followed by
a fresh ``pull`` of the same folder) while ``--clients`` clients keep generating (greedy, a
fixed prompt per adapter or the base model). Every answer is compared with the first answer
seen for its adapter, which is itself checked against HF transformers + PEFT at the start, so
a wrong output anywhere counts. Host RSS and open file descriptors of the daemon and of the
engine process are sampled at checkpoints (10, 100, 1000 cycles by default) and after a
settle pause at the end. Expected refusals (pin cap reached, nothing to evict, an adapter
busy with requests) are counted, not failures; any other error is.

The result is JSON: checkpoints, failures (must be 0), wrong outputs (must be 0), operation
counts. ``--check-growth MB`` exits non-zero when RSS grew by more than MB between the first
checkpoint and the last (what tests/test_soak.py runs for a short version).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _setup import Daemon, engine_arguments, prepare  # noqa: E402

PROMPT = "Once upon a time"
MAX_TOKENS = 8


def _processes(daemon_pid: int) -> dict:
    import psutil

    daemon = psutil.Process(daemon_pid)
    engine = daemon.children(recursive=True)

    def usage(procs) -> dict:
        rss = fds = 0
        for p in procs:
            try:
                rss += p.memory_info().rss
                fds += p.num_fds()
            except psutil.Error:
                pass
        return {"rss_mb": round(rss / 2**20, 1), "fds": fds}
    return {"daemon": usage([daemon]), "engine": usage(engine)}


def reference_ids(model: str, adapter: Path | None, prompt: str, n: int) -> list[int]:
    """Greedy ids from HF transformers (+ PEFT) in float32: the independent oracle."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model)
    net = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    if adapter is not None:
        from peft import PeftModel

        net = PeftModel.from_pretrained(net, str(adapter))
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        out = net.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=tokenizer.pad_token_id)
    return out[0, len(ids):].tolist()


async def soak(args, daemon: Daemon, adapters: list[Path]) -> dict:
    from loractl import Client
    from loractl.errors import LoractlError

    names = [f"soak/a{i}" for i in range(len(adapters))]
    rng = random.Random(args.seed)
    golden: dict[str | None, list[int]] = {}
    counts: dict[str, int] = {}
    failures: list[str] = []
    wrong: list[str] = []
    refused = 0
    answered = 0
    stop = asyncio.Event()

    async with Client(daemon.socket, timeout=120) as admin:
        for name, folder in zip(names, adapters):
            async for _ in admin.pull(str(folder), name=name):
                pass

        async def answer(client, lora):
            ids = []
            async for chunk in client.generate(PROMPT, lora=lora, max_tokens=MAX_TOKENS, min_tokens=MAX_TOKENS,
                                               temperature=0):
                ids += chunk.token_ids
            return ids

        # The golden answers, checked once against the independent reference.
        for lora, folder in [(None, None), *zip(names, adapters)]:
            golden[lora] = await answer(admin, lora)
            expected = reference_ids(daemon.model, folder, PROMPT, MAX_TOKENS)
            if golden[lora] != expected:
                wrong.append(f"{lora or 'base'}: {golden[lora]} != reference {expected}")

        async def client_loop(k: int):
            nonlocal answered
            crng = random.Random(args.seed * 1000 + k)
            async with Client(daemon.socket, timeout=120) as client:
                while not stop.is_set():
                    lora = crng.choice([None, *names])
                    try:
                        ids = await answer(client, lora)
                    except LoractlError as e:
                        if "no adapter named" in e.message:  # removed by a cycle a moment ago
                            continue
                        failures.append(f"generate {lora}: {e.message}")
                        continue
                    answered += 1
                    if ids != golden[lora]:
                        wrong.append(f"{lora or 'base'}: {ids} != {golden[lora]}")

        clients = [asyncio.create_task(client_loop(k)) for k in range(args.clients)]
        checkpoints = []
        began = time.monotonic()
        marks = sorted(set(args.checkpoints + [args.cycles]))
        for cycle in range(1, args.cycles + 1):
            op = rng.choice(["load-device", "load-host", "evict-device", "evict-host", "pin", "unpin", "rm"])
            i = rng.randrange(len(names))
            name, folder = names[i], adapters[i]
            counts[op] = counts.get(op, 0) + 1
            try:
                if op.startswith("load"):
                    await admin.load(name, to=op.split("-")[1])
                elif op.startswith("evict"):
                    await admin.evict(name, source=op.split("-")[1])
                elif op == "pin":
                    await admin.pin(name)
                elif op == "unpin":
                    await admin.unpin(name)
                else:
                    await admin.remove(name, force=True)
                    async for _ in admin.pull(str(folder), name=name):
                        pass
            except LoractlError as e:
                if e.kind in ("invalid_request", "invalid_adapter") or "cap" in e.message or "busy" in e.message:
                    refused += 1
                else:
                    failures.append(f"cycle {cycle} {op} {name}: {e.kind}: {e.message}")
            if cycle in marks:
                checkpoints.append({"cycle": cycle, "elapsed_s": round(time.monotonic() - began, 1),
                                    "answered": answered, **_processes(daemon.proc.pid)})
                print(f"soak: {checkpoints[-1]}", flush=True)
        stop.set()
        await asyncio.gather(*clients)
        await asyncio.sleep(args.settle)
        checkpoints.append({"cycle": args.cycles, "settled": True, "answered": answered,
                            **_processes(daemon.proc.pid)})
    return {"checkpoints": checkpoints, "operations": counts, "refused": refused, "answered": answered,
            "failures": failures, "wrong_outputs": wrong}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    engine_arguments(p, adapters=6)
    p.add_argument("--cycles", type=int, default=1000)
    p.add_argument("--checkpoints", type=int, nargs="*", default=[10, 100, 1000])
    p.add_argument("--clients", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--settle", type=float, default=2.0, help="seconds after the last cycle before the final sample")
    p.add_argument("--out", type=Path)
    p.add_argument("--check-growth", type=float, metavar="MB",
                   help="fail when daemon or engine RSS grew more than MB from the first checkpoint to the last")
    args = p.parse_args()
    args.max_cpu_loras = max(args.max_cpu_loras, 3)
    work = Path(tempfile.mkdtemp(prefix="lct-soak-", dir="/tmp"))
    model, adapters = prepare(args.model, args.adapters, args.rank, work)
    daemon = Daemon(model, args, work)
    daemon.model = model
    try:
        result = asyncio.run(soak(args, daemon, adapters))
    finally:
        daemon.stop()
    result["settings"] = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    text = json.dumps(result, indent=2)
    if args.out:
        args.out.write_text(text + "\n")
    print(json.dumps({k: result[k] for k in ("operations", "refused", "answered")}))
    print(f"soak: {len(result['failures'])} failures, {len(result['wrong_outputs'])} wrong outputs")
    for line in (result["failures"] + result["wrong_outputs"])[:10]:
        print("  " + line)
    code = 1 if result["failures"] or result["wrong_outputs"] else 0
    if args.check_growth is not None:
        first, last = result["checkpoints"][0], result["checkpoints"][-1]
        for part in ("daemon", "engine"):
            grew = last[part]["rss_mb"] - first[part]["rss_mb"]
            print(f"soak: {part} RSS {first[part]['rss_mb']} -> {last[part]['rss_mb']} MB ({grew:+.1f})")
            if grew > args.check_growth:
                code = 1
    return code


if __name__ == "__main__":
    sys.exit(main())
