"""Adapter thrash: loractl's admission policies against vLLM's own OpenAI server.

    .venv/bin/python bench/thrash_bench.py --rounds 3 --out bench/results/thrash-cpu.json

Load: each request names an adapter drawn Zipf(1.1) over ``--adapters`` adapters (default 8:
more than the ``--max-cpu-loras`` host entries and far more than the ``--max-loras`` device
slots), the same sequence for every system; ``--streams`` closed-loop clients (default 4, 8,
16) share a queue of ``--requests`` requests of ``--tokens`` tokens (``min_tokens`` too, so
every request does the same work).

Systems, same model, same engine and LoRA settings, in the same run, one at a time (the others
idle); at each load level every system's cell runs back to back, the order rotated per level
and round:

- ``measured``   — loractld ``--admission measured`` (its default: loractld/serving/handover.py);
- ``batching``   — loractld ``--admission batching`` (the default before issue 40), through ``loractl.Client``;
- ``adaptive``   — loractld ``--admission adaptive`` (batching, the bound from measured drains; opt in);
- ``first-come`` — loractld ``--admission first-come``;
- ``passthrough`` — loractld ``--admission passthrough`` (vLLM's own schedule while no device pin is held);
- ``server``     — ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs),
  through the ``openai`` package, streaming chat.

Figures per cell: tokens/s over the cell's wall time, TTFT p50/p99/max; for loractl also the
longest any request waited at the admission gate (from its WAITED_FOR_SLOT events). Ratios
are each loractl policy over the server, per round; the report gives median and range.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import re
import shutil
import statistics
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
from serve_bench import LoractlSystem, ServerSystem, cell, start_server, stop  # noqa: E402

POLICIES = ("measured", "batching", "adaptive", "first-come", "passthrough")
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_max_ms")


class PolicySystem(LoractlSystem):
    """loractl under one admission policy; records each wait at its gate (``WAITED_FOR_SLOT``)."""

    def __init__(self, policy: str, socket_path: Path, names: list[str]) -> None:
        super().__init__(socket_path, names)
        self.name = policy
        self.longest_wait_s = 0.0
        self.gate_waits_s: list[float] = []   # since the last take_gate_waits
        self._watch: asyncio.Task | None = None

    async def start_watching(self) -> None:
        async def follow() -> None:
            async for event in self.client.events():
                found = re.search(r"waited ([0-9.]+) s", event["message"]) if event["kind"] == "WAITED_FOR_SLOT" else None
                if found:
                    self.longest_wait_s = max(self.longest_wait_s, float(found.group(1)))
                    self.gate_waits_s.append(float(found.group(1)))

        self._watch = asyncio.create_task(follow())
        await asyncio.sleep(0.2)

    def take_longest_wait(self) -> float:
        longest, self.longest_wait_s = self.longest_wait_s, 0.0
        return longest

    def take_gate_waits(self) -> list[float]:
        waits, self.gate_waits_s = self.gate_waits_s, []
        return waits

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await super().close()


async def run_round(systems: list, args, round_no: int) -> dict:
    """Per load level, every system's cell back to back (drift hits all alike), the order
    rotated per level and round."""
    out: dict = {s.name: {} for s in systems}
    for level, streams in enumerate(args.streams):
        turn = (round_no + level) % len(systems)
        for system in systems[turn:] + systems[:turn]:
            result = await cell(system, "zipf", streams, args, seed=1000 + streams)  # same sequence every round
            if isinstance(system, PolicySystem):
                await asyncio.sleep(0.3)  # the last WAITED_FOR_SLOT event reaches the watcher
                result["longest_gate_wait_ms"] = round(system.take_longest_wait() * 1000, 1)
            out[system.name][f"zipf@{streams}"] = result
            print(f"round {round_no} {system.name:10s} zipf@{streams}: {result}", file=sys.stderr, flush=True)
    return out


def ratios(rounds: list[dict], system: str, baseline: str) -> dict:
    out = {}
    for key in rounds[0][system]:
        out[key] = {}
        for figure in FIGURES:
            values = [r[system][key][figure] / r[baseline][key][figure] for r in rounds if r[baseline][key][figure]]
            out[key][figure] = _setup.spread(values)
    return out


def markdown(report: dict) -> str:
    lines = ["| load | policy | tok/s ×server | TTFT p50 ×server | TTFT p99 ×server | TTFT max ×server | "
             "longest gate wait (ms) | TTFT p99 (ms) policy / server |", "|---|---|---|---|---|---|---|---|"]
    for policy in POLICIES:
        if policy not in report["ratios"]:
            continue
        for key, figures in report["ratios"][policy].items():
            def fmt(figure: str) -> str:
                v = figures[figure]
                return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})"

            waits = max(r[policy][key]["longest_gate_wait_ms"] for r in report["rounds"])
            p99 = {s: statistics.median(r[s][key]["ttft_p99_ms"] for r in report["rounds"]) for s in (policy, "server")}
            lines.append(f"| {key} | {policy} | {fmt('tokens_per_s')} | {fmt('ttft_p50_ms')} | {fmt('ttft_p99_ms')} | "
                         f"{fmt('ttft_max_ms')} | {waits:.0f} | {p99[policy]:.0f} / {p99['server']:.0f} |")
    return "\n".join(lines)


def server_names(names: list[str]) -> list[str]:
    """The server's names for the adapters (its --lora-modules take no '/')."""
    return [n.replace("/", "-") for n in names]


@contextlib.contextmanager
def launched(model: str, names: list[str], paths: list[Path], args, work: Path, wanted: list[str]):
    """Start a loractld per wanted policy and vLLM's server, side by side (all with ``args``'s
    engine settings); yield ``(daemons, server)`` and stop them all after."""
    jobs = {}
    with ThreadPoolExecutor(4) as pool:
        for system in wanted:
            policy, _, wait = system.partition("@")   # "batching@0.02": that policy, that --admission-max-wait
            policy, _, flag = policy.partition("+")   # "measured+no-prefetch": that policy, --no-prefetch
            if policy in POLICIES:
                home = work / f"home-{system}"
                shutil.rmtree(home, ignore_errors=True)
                home.mkdir(parents=True)
                extra = ["--admission", policy]
                if args.max_num_seqs:
                    extra += ["--max-num-seqs", str(args.max_num_seqs)]
                wait = wait or (str(args.max_wait) if args.max_wait is not None else "")
                if policy != "first-come" and wait:
                    extra += ["--admission-max-wait", wait]
                extra += [f"--{flag}"] if flag else []
                jobs[system] = pool.submit(_setup.Daemon, model, args, home, extra)
        if "server" in wanted:
            jobs["server"] = pool.submit(start_server, model, server_names(names), paths, args, work / "server.log")
    started = {key: job.result() for key, job in jobs.items() if job.exception() is None}
    server = started.pop("server", None)
    try:
        for job in jobs.values():
            if job.exception() is not None:
                raise job.exception()
        yield started, server
    finally:
        for daemon in started.values():
            daemon.stop()
        if server:
            stop(server[0])


async def connect(daemons: dict, server, model: str, names: list[str], paths: list[Path]) -> list:
    """The systems to drive: each daemon (its store given the adapters), then the server."""
    from loractl import Client

    systems = []
    for policy, daemon in daemons.items():
        async with Client(daemon.socket) as c:
            for name, path in zip(names, paths):
                async for _ in c.pull(str(path), name=name):
                    pass
        system = PolicySystem(policy, daemon.socket, names)
        await system.start_watching()
        systems.append(system)
    if server:
        systems.append(ServerSystem(server[1], model, server_names(names)))
    return systems


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=8)
    p.set_defaults(max_cpu_loras=4)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: vLLM's own")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streams", default="4,8,16")
    p.add_argument("--requests", type=int, default=192, help="requests per cell")
    p.add_argument("--systems", default="measured,batching,first-come,server")
    p.add_argument("--max-wait", type=float, default=None, help="--admission-max-wait for the batching and adaptive daemons")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    if args.adapters <= args.max_cpu_loras:
        raise SystemExit("--adapters must exceed --max-cpu-loras: the point is thrash")
    wanted = args.systems.split(",")
    work = _setup.workdir(args.workdir)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/a{i}" for i in range(len(paths))]

    with launched(model, names, paths, args, work, wanted) as (daemons, server):
        async def go() -> dict:
            systems = await connect(daemons, server, model, names, paths)
            try:
                return {"rounds": [await run_round(systems, args, i) for i in range(args.rounds)]}
            finally:
                for s in systems:
                    await s.close()

        results = asyncio.run(go())
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
              "settings": {k: getattr(args, k) for k in ("device", "rank", "adapters", "max_loras", "max_cpu_loras",
                                                         "max_model_len", "max_num_seqs", "kv_cache", "tokens",
                                                         "streams", "requests", "max_wait", "rounds")},
              **results}
    if "server" in wanted:
        report["ratios"] = {policy: ratios(report["rounds"], policy, "server") for policy in daemons}
        report["markdown"] = markdown(report)
        print(report["markdown"], file=sys.stderr)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
