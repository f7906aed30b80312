"""Concurrency storm: commands and requests interleaved at random over a few adapters, then the
daemon's promises checked (tests/test_storm.py runs a short one on the shared rig; run longer
here, with its own daemon, for docs/reliability.md).

    .venv/bin/python bench/storm.py --seconds 300 --out bench/results/storm-cpu.json

Clients generate (short prompts and one over 2,048 characters, streamed to the end or cancelled
after the first chunk), while an operator pulls, re-pulls a new revision under the same name,
``rm --force``es, loads, evicts, pins and unpins (host and device) over ``--names`` names whose
content is drawn from the demo adapters, and gives up a fifth of those commands at a random
moment within their first 50 ms (``--abandon``: the client cancels the call). Afterwards: the
engine is alive, no request took longer than ``--bound`` seconds, ``ls`` lists exactly the store's names, the engine's residency and pins
stay within their caps, nothing is left in the store's temporaries or unreferenced in .objects/,
and every answer (tokens and the content it ran with, from the reply's adapter identity) equals
the HF + PEFT reference; a cancelled answer is a prefix of it.

Expected refusals (an adapter removed meanwhile, a pin cap reached, a name busy) are counted,
not failures; any other error is a failure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

EXPECTED_KINDS = {"adapter_not_found", "invalid_request", "invalid_adapter"}   # of commands
EXPECTED_REQUEST_KINDS = {"adapter_not_found", "invalid_adapter"}               # of generations
LONG_PROMPT = "The quick brown fox jumps over the lazy dog near the river bank. " * 36   # 2,340 characters
PROMPTS = ("Once upon a time", "Write a query", LONG_PROMPT)
MAX_TOKENS = 8


def content_digest(folder: Path) -> str:
    """What the daemon derives the adapter's engine identity from (loractld.store.identity)."""
    from loractld.store.disk import files_digest
    from loractld.store.sources import sha256_file

    return files_digest([{"name": f.name, "sha256": sha256_file(f)} for f in sorted(folder.iterdir()) if f.is_file()])


@dataclass
class Report:
    seconds: float = 0.0
    requests: Counter = field(default_factory=Counter)       # completed, cancelled, refused
    operations: Counter = field(default_factory=Counter)     # "pin host: ok", "rm: invalid_request", ...
    failures: list[str] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)
    answers: list[dict] = field(default_factory=list)        # prompt_ids, folder (None: base), ids, complete

    def summary(self) -> dict:
        lat = sorted(self.latencies) or [0.0]
        return {"seconds": round(self.seconds, 1), "requests": dict(self.requests),
                "operations": dict(sorted(self.operations.items())), "failures": self.failures,
                "latency_s": {"p50": round(lat[len(lat) // 2], 3), "p99": round(lat[int(len(lat) * 0.99)], 3),
                              "max": round(lat[-1], 3)}, "answers_checked": len(self.answers)}


async def storm(socket: str, folders: list[Path], *, names: list[str], seconds: float, seed: int,
                clients: int = 3, bound: float = 60.0, abandon: float = 0.2, abandon_window: float = 0.05) -> Report:
    """Run the storm against the daemon on ``socket``; return what happened (answers unchecked).
    A share ``abandon`` of the commands is given up by its client after a random time of up to
    ``abandon_window`` seconds."""
    from loractl import Client
    from loractl.errors import LoractlError

    rng = random.Random(seed)
    by_digest = {content_digest(f)[:16]: f for f in folders}
    report = Report()
    began = time.monotonic()
    end = began + seconds

    async def generate(client: Client) -> None:
        name = rng.choice(names + [""])
        prompt = rng.choice(PROMPTS)
        cancel = rng.random() < 0.25
        answer = {"prompt_ids": [], "ids": [], "folder": None, "complete": False}
        started = time.monotonic()
        try:
            stream = client.generate(prompt, lora=name or None, max_tokens=MAX_TOKENS, temperature=0)
            async for chunk in stream:
                answer["prompt_ids"] += chunk.prompt_token_ids
                answer["ids"] += chunk.token_ids
                if chunk.adapter:
                    answer["folder"] = str(by_digest[chunk.adapter.rsplit("@", 1)[1]])
                if cancel and answer["ids"]:
                    await stream.aclose()
                    break
            else:
                answer["complete"] = True
            report.requests["cancelled" if cancel and not answer["complete"] else "completed"] += 1
            if prompt == LONG_PROMPT and answer["ids"]:
                report.requests["of which over 2,048 characters"] += 1
            if name and answer["folder"] is None and answer["ids"]:
                report.failures.append(f"an answer for {name} without the adapter's identity")
            if answer["prompt_ids"]:
                report.answers.append(answer)
        except LoractlError as e:
            if e.kind not in EXPECTED_REQUEST_KINDS:
                report.failures.append(f"generate {name or 'base'}: {e.kind}: {e.message}")
            report.requests[f"refused: {e.kind}"] += 1
        report.latencies.append(time.monotonic() - started)

    async def generator() -> None:
        async with Client(socket, timeout=bound) as client:
            while time.monotonic() < end:
                await generate(client)

    async def run_op(client: Client, op: str, name: str) -> None:
        if op in ("pull", "re-pull"):
            async for _ in client.pull(str(rng.choice(folders)), name=name, force=True):   # another folder: replaced
                pass
        elif op == "rm":
            await client.remove(name, force=True)
        elif op.startswith("load"):
            await client.load(name, to=op.split()[1])
        elif op.startswith("evict"):
            await client.evict(name, source=op.split()[1])
        elif op.startswith("pin"):
            await client.pin(name, to=op.split()[1])
        else:
            await client.unpin(name)

    async def operate(client: Client) -> None:
        name = rng.choice(names)
        op = rng.choice(["pull", "re-pull", "rm", "load device", "load host", "evict device", "evict host",
                         "pin host", "pin device", "unpin", "unpin"])
        # The client goes away at a random moment (a deadline, Ctrl-C): whatever the daemon had
        # begun must end whole, or be undone.
        abandon_after = rng.random() * abandon_window if rng.random() < abandon else None
        try:
            if abandon_after is None:
                await run_op(client, op, name)
            else:
                try:
                    await asyncio.wait_for(run_op(client, op, name), abandon_after)
                except asyncio.TimeoutError:
                    report.operations[f"{op}: abandoned"] += 1
                    return
            report.operations[f"{op}: ok"] += 1
        except LoractlError as e:
            report.operations[f"{op}: {e.kind}"] += 1
            if e.kind not in EXPECTED_KINDS:
                report.failures.append(f"{op} {name}: {e.kind}: {e.message}")

    async def operator() -> None:
        async with Client(socket, timeout=bound) as client:
            while time.monotonic() < end:
                started = time.monotonic()
                await operate(client)
                if time.monotonic() - started > bound:
                    report.failures.append(f"an operation took {time.monotonic() - started:.1f} s")
                await asyncio.sleep(rng.random() * 0.2)

    await asyncio.gather(*(generator() for _ in range(clients)), operator(), operator())
    report.seconds = time.monotonic() - began
    await asyncio.sleep(1.0)   # what abandoned commands left to finish on their own
    if report.latencies and max(report.latencies) > bound:
        report.failures.append(f"a request took {max(report.latencies):.1f} s (bound {bound} s)")
    report.failures += await check_after(socket)
    return report


async def check_after(socket: str) -> list[str]:
    """The state after the storm: alive, ``ls`` = the store, residency and pins within caps."""
    from loractl import Client

    failures = []
    async with Client(socket, timeout=30) as client:
        status = await client.status()
        if not status["ready"]:
            failures.append("the daemon is not ready after the storm")
        # Adapters only: a profile is a name in ls too, but a file of its own, not a link in the store.
        listed = {a["name"]: a for a in await client.list() if a.get("kind", "adapter") != "profile"}
    cap = status["capacity"]
    store = Path(status["home"]) / "adapters"
    on_disk = {str(p.relative_to(store)) for p in store.rglob("*") if p.is_symlink() and not p.name.startswith(".")
               and ".objects" not in p.parts}
    # A weighted profile's own merge (<profile>-merged) is in the store but listed with its profile,
    # not as an adapter (issue 60, item 3).
    on_disk = {name for name in on_disk if name in listed or not name.endswith("-merged")}
    if set(listed) != on_disk:
        failures.append(f"ls lists {sorted(listed)}, the store has {sorted(on_disk)}")
    device = {a["name"] for a in listed.values() if a["tier"] == "device"}
    if cap["device_used"] > cap["device_slots"] or cap["host_used"] > cap["host_slots"]:
        failures.append(f"residency over capacity: {cap}")
    if cap["pins"] > cap["max_pins"] or cap["device_pins"] > cap["max_device_pins"]:
        failures.append(f"pins over their caps: {cap}")
    pinned = {n for n, a in listed.items() if a["pin"]}
    # A pin holds content: names sharing that content (another test's pull of the same files) all show it.
    pinned_contents = {tuple(sorted(f["sha256"] for f in listed[n]["files"])) for n in pinned}
    if len(pinned_contents) > cap["max_pins"] + cap["max_device_pins"]:
        failures.append(f"ls shows {sorted(pinned)} pinned, over the caps")
    contents = {tuple(sorted(f["sha256"] for f in listed[n]["files"])) for n in device}  # names may share one
    if len(contents) > cap["device_slots"]:
        failures.append(f"ls shows {sorted(device)} on the device, {cap['device_slots']} slots")
    admission = status["admission"]
    if admission["pinned"] > admission["places"] - 1:
        failures.append(f"the gate holds {admission['pinned']} of {admission['places']} places for pins")
    leftovers = list((store / ".tmp").iterdir())
    if leftovers:
        failures.append(f"temporaries left in the store: {leftovers}")
    linked = {p.resolve() for p in store.rglob("*") if p.is_symlink() and ".objects" not in p.parts}
    stray = [o for o in (store / ".objects").iterdir() if o.resolve() not in linked]
    if stray:
        failures.append(f"objects no name holds, after every request ended: {stray}")
    return failures


async def tidy(socket: str, names: list[str]) -> None:
    """Unpin and remove the storm's names (the rig is shared with other tests)."""
    from loractl import Client
    from loractl.errors import LoractlError

    async with Client(socket, timeout=60) as client:
        for name in names:
            for step in (client.unpin, lambda n: client.remove(n, force=True)):
                try:
                    await step(name)
                except LoractlError:
                    pass


def check_answers(report: Report, reference) -> list[str]:
    """Every answer against HF + PEFT (``reference.greedy``); a cancelled one as a prefix."""
    wrong = []
    for a in report.answers:
        expected = reference.greedy(a["prompt_ids"], Path(a["folder"]) if a["folder"] else None, MAX_TOKENS)
        ok = a["ids"] == expected if a["complete"] else a["ids"] == expected[:len(a["ids"])]
        if not ok:
            wrong.append(f"{a['folder'] or 'base'}: {a['ids']} != {expected}")
    return wrong


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=300)
    p.add_argument("--names", type=int, default=3)
    p.add_argument("--clients", type=int, default=3)
    p.add_argument("--bound", type=float, default=60.0)
    p.add_argument("--seed", type=int, default=22)
    p.add_argument("--abandon", type=float, default=0.2, help="the share of commands cancelled midway")
    p.add_argument("--out", type=Path)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from conftest import ENGINE_FLAGS, RIG_CONTEXT, Reference, start_daemon

    import tempfile

    from loractld.models.tiny import ensure_demo

    home = Path(tempfile.mkdtemp(prefix="lct-storm-", dir="/tmp"))
    tiny = ensure_demo(home / "tiny")
    # The rig's context (1,024 tokens), so that the long prompt fits, as in tests/test_storm.py.
    daemon = start_daemon(home, name="storm", engine_flags=[*ENGINE_FLAGS, "--max-model-len", str(RIG_CONTEXT)])
    folders = sorted(d / "v1" for d in (tiny / "adapters").iterdir())
    names = [f"storm/{chr(ord('a') + i)}" for i in range(args.names)]
    try:
        report = asyncio.run(storm(str(daemon.socket), folders, names=names, seconds=args.seconds, seed=args.seed,
                                   clients=args.clients, bound=args.bound, abandon=args.abandon))
    finally:
        daemon.stop()
    wrong = check_answers(report, Reference(tiny / "model"))
    result = {**report.summary(), "wrong_answers": wrong, "machine": "see docs/reliability.md"}
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return 1 if report.failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
