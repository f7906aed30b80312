"""The scale matrix (issue 48, item 1): a thousand adapters of mixed ranks, 64 clients, loractl
against vLLM's own OpenAI server holding the same adapters, in the same run.

    .venv/bin/python bench/scale_matrix.py --out bench/results/scale-matrix.json
    .venv/bin/python bench/scale_matrix.py --cells uniform/32/closed,zipf1.0/32/closed --rounds 1
    .venv/bin/python bench/scale_matrix.py --store 10000 ...   # the same, 10,000 adapters in the store
    .venv/bin/python bench/scale_matrix.py --quick              # a smoke run: 24 adapters, 2 cells

Adapters: ``--adapters`` (1,000) adapters for the tiny test model, ranks 8, 16, 32 and 64 in turn
(all seven projections, ``alpha`` = rank), each of its own content. loractl finds them placed by
hand in its store (the seeds' layout, ``scale/r<rank>-<i>``) before it starts — the case that
failed from outside — and the server gets them as ``--lora-modules``. Both run with
``--max-lora-rank 64`` and the same slots and host entries (``--max-loras``, ``--max-cpu-loras``).
With ``--store N`` loractl's store also holds N - adapters rank-4 adapters nobody asks for
(bench/store_scale.py's), so a listing or a start-up that walks the store pays for them.

Cells: popularity (uniform, Zipf 0.5, Zipf 1.0) x answer length (32, 128 tokens, ``min_tokens``
too) x arrival (closed loop: 64 clients sharing the requests; open loop: Poisson at ``--rate``).
Per round and cell both systems run back to back, the order rotated; the request sequence is
the same for both. Figures per run: tokens/s over the run's wall time, TTFT p50/p99/p99.9, the
resident memory of the system's processes (the daemon or API server and their children: vLLM's
engine core) after the run, and the bytes its processes read from storage (``/proc/PID/io``
``read_bytes``: page-cache hits are free and not counted) per served request. For loractl also
where its requests waited (``waits``, from the daemon's metrics before and after the run): at
the admission gate for a device slot (``loractl_admission_wait_seconds``) and, past the gate,
for an adapter that was not on the device (``loractl_adapter_load_wait_seconds``, admission to
first token: its load and prefill) — each as a count, a sum and bucket bounds of its p50/p99
(the histogram's: the upper bound of the bucket the quantile falls in); and the requests that
waited for a slot, each wait to the millisecond from its ``WAITED_FOR_SLOT`` event
(``gate_events``).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
import matrix_bench  # noqa: E402
from serve_bench import ServerSystem, start_server, stop  # noqa: E402
from thrash_bench import PolicySystem  # noqa: E402

RANKS = (8, 16, 32, 64)
POPULARITY = {"uniform": 0.0, "zipf0.5": 0.5, "zipf1.0": 1.0}
FIGURES = ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "ttft_p999_ms")


def cells(args) -> list[dict]:
    out = []
    for popularity, exponent in POPULARITY.items():
        for tokens in (32, 128):
            for arrival in ("closed", "open"):
                name = f"{popularity}/{tokens}/{arrival}"
                requests = args.requests if tokens <= 32 else args.requests // 3
                out.append({"name": name, "adapters": args.adapters, "zipf": exponent, "tokens": tokens,
                            "arrival": arrival, "rate": args.rate, "clients": args.clients,
                            "requests": max(requests, 2 * args.clients), "timeout_s": args.run_timeout})
    wanted = args.cells.split(",") if args.cells else None
    if wanted:
        unknown = set(wanted) - {c["name"] for c in out}
        if unknown:
            raise SystemExit(f"unknown cells: {sorted(unknown)} (known: {', '.join(c['name'] for c in out)})")
        out = [c for c in out if c["name"] in wanted]
    return out


def mixed_adapters(model_dir: Path, count: int, work: Path) -> tuple[list[str], list[Path]]:
    """``count`` adapters, ranks cycling through :data:`RANKS`, built once per work folder."""
    from loractld.models.tiny import DemoAdapter, build_adapter

    names, paths = [], []
    for i in range(count):
        rank = RANKS[i % len(RANKS)]
        name = f"scale/r{rank}-{i:05d}"
        dest = work / "adapters" / name
        if not (dest / "adapter_model.safetensors").exists():
            build_adapter(model_dir, DemoAdapter(name, rank=rank, alpha=rank), dest,
                          base_model="loractl/demo-tiny-llama")
        names.append(name)
        paths.append(dest)
    return names, paths


def place(home: Path, names: list[str], paths: list[Path], store_total: int) -> None:
    """The adapters placed by hand in ``home``'s store (hard links: no bytes copied), plus the
    rank-4 filler up to ``store_total``."""
    from loractl import paths as layout

    store = layout.layout(home).data_dir / "adapters"
    for name, path in zip(names, paths):
        shutil.copytree(path, store / name, copy_function=os.link)
    if store_total > len(names):
        import store_scale

        store_scale.make_adapters(home, store_total - len(names))


def process_tree(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        try:
            for task in os.listdir(f"/proc/{current}/task"):
                with open(f"/proc/{current}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except OSError:
            pass
    return found


def _tree_sum(pid: int, file: str, field: str) -> int:
    """``field``'s first number in ``/proc/P/file``, summed over ``pid``'s process tree."""
    total = 0
    for p in process_tree(pid):
        try:
            with open(f"/proc/{p}/{file}") as f:
                total += next(int(line.split()[1]) for line in f if line.startswith(field))
        except (OSError, StopIteration):
            pass
    return total


def rss_mib(pid: int) -> float:
    return round(_tree_sum(pid, "status", "VmRSS:") / 1024, 1)


def read_bytes(pid: int) -> int:
    return _tree_sum(pid, "io", "read_bytes:")


async def run_matrix(systems: list, pids: dict[str, int], specs: list[dict], args) -> dict:
    results = {spec["name"]: {"spec": spec, "rounds": []} for spec in specs}
    for round_no in range(args.rounds):
        for index, spec in enumerate(specs):
            turn = (round_no + index) % len(systems)
            order = systems[turn:] + systems[:turn]
            entry = {"round": round_no, "order": [s.name for s in order],
                     "load_average_before": matrix_bench.load_average()}
            for system in order:
                before = read_bytes(pids[system.name])
                histograms = await wait_histograms(system)
                if histograms is not None:
                    await asyncio.sleep(0.5)   # the last run's events read
                    system.take_gate_waits()
                result = await matrix_bench.run(system, spec, seed=2000 + index)
                served = max(result["requests"], 1)
                if histograms is not None:
                    result["waits"] = waits(histograms, await wait_histograms(system))
                    await asyncio.sleep(0.5)
                    result["waits"]["gate_events"] = gate_events(system.take_gate_waits())
                result["rss_mib"] = rss_mib(pids[system.name])
                result["disk_bytes_per_request"] = round((read_bytes(pids[system.name]) - before) / served)
                entry[system.name] = result
                print(f"round {round_no} {spec['name']:22s} {system.name:9s} {result}", file=sys.stderr, flush=True)
            results[spec["name"]]["rounds"].append(entry)
            _setup.write_quietly({"partial": True, "cells": results}, args.out)
    for entry in results.values():
        rounds = entry["rounds"]
        entry["ratios"] = matrix_bench.ratios(rounds, "measured", figures=FIGURES)
        entry["medians"] = {s: {f: statistics.median(r[s][f] for r in rounds if r[s].get(f) is not None)
                                for f in (*FIGURES, "rss_mib", "disk_bytes_per_request")
                                if any(r[s].get(f) is not None for r in rounds)}
                            for s in ("measured", "server")}
    return results


WAITS = {"gate": ("loractl_admission_wait_seconds", None),                 # per adapter: summed
         "load": ("loractl_adapter_load_wait_seconds", "from")}              # per tier it came from


async def wait_histograms(system) -> dict | None:
    """The daemon's wait histograms now, summed over adapters (``{(kind, group): {le: count}}``,
    cumulative, with ``"sum"``); None for a system that is not loractl."""
    if not isinstance(system, PolicySystem):
        return None
    found: dict = {}
    for line in (await system.client.metrics()).splitlines():
        for kind, (name, by) in WAITS.items():
            if not line.startswith(name):
                continue
            labels = dict(part.split("=", 1) for part in line[line.find("{") + 1:line.rfind("}")].split(",")
                          if "=" in part) if "{" in line else {}
            group = labels.get(by, "").strip('"') if by else ""
            series = found.setdefault((kind, group), {})
            value = float(line.rsplit(" ", 1)[1])
            if line.startswith(name + "_bucket"):
                le = labels["le"].strip('"')
                series[le] = series.get(le, 0) + value
            elif line.startswith(name + "_sum"):
                series["sum"] = series.get("sum", 0) + value
    return found


def gate_events(waits_s: list[float]) -> dict:
    """The requests that waited for a slot, from their ``WAITED_FOR_SLOT`` events (each names its
    wait to the millisecond): how many, and their waits' p50, p90, p99 and longest."""
    if not waits_s:
        return {"count": 0}
    ordered = sorted(waits_s)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000, 1)
    return {"count": len(ordered), "p50_ms": at(0.5), "p90_ms": at(0.9), "p99_ms": at(0.99),
            "max_ms": round(ordered[-1] * 1000, 1)}


def waits(before: dict, after: dict) -> dict:
    """What the requests of one run waited for (:func:`wait_histograms` before and after it)."""
    report = {}
    for key, series in after.items():
        old = before.get(key, {})
        delta = {le: v - old.get(le, 0) for le, v in series.items()}
        count = delta.get("+Inf", 0)
        if not count:
            continue
        bounds = sorted((float(le), v) for le, v in delta.items() if le not in ("sum", "+Inf"))

        def quantile(q: float) -> str:
            return next((f"<= {le:g} s" for le, v in bounds if v >= q * count), "> largest bound")
        report["/".join(filter(None, key))] = {
            "count": int(count), "sum_s": round(delta.get("sum", 0), 3),
            "over_1ms": int(count - next((v for le, v in bounds if le == 0.001), 0)),
            "p50": quantile(0.5), "p99": quantile(0.99)}
    return report


def markdown(results: dict) -> str:
    lines = ["| cell | tok/s ×server | TTFT p50 ×server | TTFT p99 ×server | TTFT p99.9 ×server | "
             "tok/s loractl / server | TTFT p99 ms loractl / server | RSS MiB loractl / server | "
             "disk bytes per request loractl / server |", "|---|---|---|---|---|---|---|---|---|"]
    for name, entry in results.items():
        r, m = entry["ratios"], entry["medians"]

        def ratio(figure: str) -> str:
            v = r.get(figure)
            return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else "—"

        def pair(figure: str, digits: int = 0) -> str:
            return " / ".join(f"{m[s][figure]:.{digits}f}" if figure in m.get(s, {}) else "—"
                              for s in ("measured", "server"))

        lines.append(f"| {name} | {ratio('tokens_per_s')} | {ratio('ttft_p50_ms')} | {ratio('ttft_p99_ms')} | "
                     f"{ratio('ttft_p999_ms')} | {pair('tokens_per_s')} | {pair('ttft_p99_ms')} | "
                     f"{pair('rss_mib')} | {pair('disk_bytes_per_request')} |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--adapters", type=int, default=1000, help="adapters asked for (ranks 8/16/32/64 in turn)")
    p.add_argument("--store", type=int, default=0, help="adapters in loractl's store in all (filler: rank 4)")
    p.add_argument("--max-loras", type=int, default=4)
    p.add_argument("--max-cpu-loras", type=int, default=32)
    p.add_argument("--max-model-len", type=int, default=256)
    p.add_argument("--kv-cache", default="256MiB")
    p.add_argument("--clients", type=int, default=64)
    p.add_argument("--requests", type=int, default=768, help="requests per 32-token cell (a third for 128)")
    p.add_argument("--rate", type=float, default=12.0, help="open-loop arrival rate, requests/s")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--run-timeout", type=float, default=600.0)
    p.add_argument("--cells", default=None, help="comma-separated cell names, e.g. uniform/32/closed")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False,
                   help="loractld --prefetch or --no-prefetch (docs/benchmarks.md, 'Prefetch at the gate'; default: off)")
    p.add_argument("--quick", action="store_true", help="smoke run: 24 adapters, 8 clients, 2 cells, 1 round")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.model, args.device, args.rank, args.max_num_seqs = "tiny", "cpu", max(RANKS), None
    if args.quick:
        args.adapters, args.clients, args.requests, args.rounds = 24, 8, 32, 1
        args.cells = args.cells or "uniform/32/closed,zipf1.0/32/open"
        args.rate = 4.0
    work = _setup.workdir(args.workdir)
    from loractld.models.tiny import ensure_demo

    model_dir = ensure_demo(work / "tiny") / "model"
    began = time.perf_counter()
    names, paths = mixed_adapters(model_dir, args.adapters, work)
    print(f"adapters ready in {time.perf_counter() - began:.0f} s", file=sys.stderr, flush=True)
    home = work / "home-measured"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    place(home, names, paths, args.store)
    specs = cells(args)
    daemon = _setup.Daemon(str(model_dir), args, home, ["--admission", "measured"]
                           + (["--prefetch"] if args.prefetch else ["--no-prefetch"]))
    server = None
    try:
        server = start_server(str(model_dir), names, paths, args, work / "server.log")

        async def drive() -> dict:
            systems = [PolicySystem("measured", daemon.socket, names), ServerSystem(server[1], str(model_dir), names)]
            await systems[0].start_watching()
            try:
                return await run_matrix(systems, {"measured": daemon.proc.pid, "server": server[0].pid}, specs, args)
            finally:
                for system in systems:
                    await system.close()
        results = asyncio.run(drive())
    finally:
        daemon.stop()
        if server:
            stop(server[0])
    report = {"machine": _setup.machine(), "versions": _setup.versions(),
              "settings": {k: v for k, v in vars(args).items() if k not in ("out", "workdir")},
              "cells": results, "markdown": markdown(results)}
    _setup.write(report, args.out)
    print(report["markdown"], file=sys.stderr)


if __name__ == "__main__":
    main()
