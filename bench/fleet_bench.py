"""Two loractl hosts behind Dynamo's frontend: its LoRA-aware routing against plain round-robin.

    .venv/bin/python bench/fleet_bench.py --rounds 3 --out bench/results/fleet-cpu.json

The fleet of tests/test_fleet.py (tests/fleet_rig.py): a real etcd, two daemons on the tiny
model, each in a network namespace of its own, ``--dynamo --auto-pull``, their Hub a local stub
holding ``--adapters`` distinct adapters. Placement: host 1 stores the even adapters, host 2 the
odd ones (each host's share fits its ``--max-loras`` device slots). Two frontends watch the same
etcd: one with ``DYN_LORA_ENABLED=true`` (routes an adapter's requests to the hosts holding it),
one without (round-robin over every worker of the base model, whatever it holds).

Cells, each ``--streams`` closed-loop clients sharing ``--requests`` streamed chat requests of
``--tokens`` tokens (``min_tokens`` too), adapters drawn Zipf(1.1), the same sequence in every
cell, through the ``openai`` package:

- ``lora``      — the LoRA-aware frontend, hosts holding the placement above;
- ``rr-cold``   — round-robin from the same placement: a host sent an adapter it lacks pulls it
  from the Hub first (``--auto-pull``), as a host new to the fleet would;
- ``rr-warm``   — round-robin with every adapter already on both hosts (the best case for it).

Each daemon's engine is bound to a core of its own (``VLLM_CPU_OMP_THREADS_BIND``: host 1 core 0,
host 2 core 1), as two machines; etcd, the frontends, the Hub stub and the client share the
machine. Before each cell the placement is restored (``loractl rm`` of what a host should not hold, or
``pull`` of what it should). Per cell: tokens/s, TTFT p50/p99, requests per host, device loads
per request (``loractl_adapter_loads_total{tier="device"}`` over both hosts) and Hub pulls.
The order of the cells rotates per round; ratios are each round-robin cell over ``lora``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402
from serve_bench import ServerSystem, adapter_sequence, settle  # noqa: E402

sys.path.insert(0, str(_setup.REPO / "tests"))
from fleet_rig import Rig, free_port, frontend_python, models, wait_for, why_no_namespaces  # noqa: E402
from hub_stub import HubStub  # noqa: E402

CELLS = ("lora", "rr-cold", "rr-warm")
LOADER = _setup.BIN / "loractl"


def cli(daemon_socket: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([str(LOADER), *args, "--socket", str(daemon_socket)], capture_output=True, text=True,
                          timeout=300)


def metric_sum(socket: Path, name: str, **labels: str) -> float:
    total = 0.0
    for line in cli(socket, "metrics").stdout.splitlines():
        if line.startswith(name) and all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def stored(socket: Path) -> set[str]:
    return {a["name"] for a in json.loads(cli(socket, "ls", "--json").stdout)}


def place(rig: Rig, hosts: dict[int, Path], names: list[str], everywhere: bool) -> None:
    """Host 1 holds the even adapters, host 2 the odd ones (``everywhere``: both hold all)."""
    for host, socket in hosts.items():
        want = set(names) if everywhere else {n for i, n in enumerate(names) if i % 2 == host - 1}
        have = stored(socket)
        for name in sorted(have - want):
            assert cli(socket, "rm", name).returncode == 0, f"rm {name} on host {host}"
        for name in sorted(want - have):
            done = cli(socket, "pull", name)
            assert done.returncode == 0, done.stderr
    # The frontends see the cards through etcd's watch; give them a moment after the last change.
    time.sleep(2)


async def run_cell(system: ServerSystem, sequence: list[int], streams: int, tokens: int) -> dict:
    await settle()
    queue = list(reversed(sequence))
    samples, failures = [], []

    async def client() -> None:
        while queue:
            adapter = queue.pop()
            try:
                samples.append(await system.request(adapter, tokens))
            except Exception as e:  # noqa: BLE001 - counted and reported, not hidden
                failures.append(f"{type(e).__name__}: {e}"[:200])

    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    wall = time.perf_counter() - began
    ttfts = [s.ttft for s in samples]
    return {"requests": len(samples), "failures": len(failures), "failure_examples": failures[:3],
            "tokens_per_s": round(sum(s.tokens for s in samples) / wall, 1),
            "ttft_p50_ms": round(1000 * statistics.median(ttfts), 1) if ttfts else None,
            "ttft_p99_ms": round(1000 * _setup.percentile(ttfts, 0.99), 1) if ttfts else None,
            "wall_s": round(wall, 2)}


def counters(hosts: dict[int, Path], names: list[str]) -> dict:
    return {host: {"device_loads": metric_sum(s, "loractl_adapter_loads_total", tier="device"),
                   "tokens": metric_sum(s, "vllm:generation_tokens_total"),
                   "gate_wait_s": metric_sum(s, "loractl_admission_wait_seconds_sum"),
                   "load_s": metric_sum(s, "loractl_adapter_load_seconds_sum"),
                   **{f"requests {n}": metric_sum(s, "loractl_adapter_requests_total", adapter=n) for n in names}}
            for host, s in hosts.items()}


def weight_downloads(hub: HubStub) -> int:
    return sum(1 for method, path in hub.requests if method == "GET" and path.endswith("adapter_model.safetensors"))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    _setup.engine_arguments(p, adapters=4)
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--requests", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--omp-wait", default=None, choices=("ACTIVE", "PASSIVE"),
                   help="OMP_WAIT_POLICY for the engines (default: the OpenMP runtime's own)")
    p.add_argument("--work", default=None)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    why = why_no_namespaces()
    if why:
        raise SystemExit(f"fleet_bench: {why}")
    python = frontend_python()
    if python is None:
        raise SystemExit("fleet_bench: Dynamo's frontend is not installed (bash scripts/setup.sh makes .venv-frontend)")
    work = _setup.workdir(args.work)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"acme/bench-{i}" for i in range(len(paths))]
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "args": vars(args), "rounds": []}
    root = work / "fleet"
    root.mkdir(exist_ok=True)
    with Rig(root, hosts=2) as rig:
        hub = HubStub(host=rig.gateway(1)).start()
        for name, path in zip(names, paths):
            hub.add_commit(name, {f.name: f.read_bytes() for f in path.iterdir() if f.is_file()})
        hosts: dict[int, Path] = {}
        for host in (1, 2):
            home = root / f"host{host}"
            home.mkdir(exist_ok=True)
            socket = home / "d.sock"
            env = {**rig.dynamo_env(host), "DYN_SYSTEM_PORT": str(free_port()), "HF_ENDPOINT": hub.endpoint,
                   # A core each, as two machines would have: vLLM's default binds every CPU
                   # worker on a 2-core machine to core 0, and the two engines would share it.
                   "VLLM_CPU_OMP_THREADS_BIND": str((host - 1) % os.cpu_count()),
                   **({"OMP_WAIT_POLICY": args.omp_wait} if args.omp_wait else {})}
            rig.spawn(f"host{host}", ["ip", "netns", "exec", rig.ns(host), str(_setup.BIN / "loractld"), "--model",
                                      model, "--home", str(home), "--socket", str(socket), "--served-model-name",
                                      "tiny", "--dynamo", "--dynamo-discovery", "etcd", "--auto-pull",
                                      *_setup.engine_flags(args)], env=env)
            hosts[host] = socket
        for host, socket in hosts.items():
            wait_for(lambda: socket.exists() and cli(socket, "status", "--json").returncode == 0
                     and json.loads(cli(socket, "status", "--json").stdout).get("ready"), 600, f"host {host}", 1)
        ports = {"lora": free_port(), "rr": free_port()}
        rig.frontend(python, ports["lora"], lora_routing=True)
        rig.frontend(python, ports["rr"], lora_routing=False)
        place(rig, hosts, names, everywhere=False)
        for port in ports.values():
            wait_for(lambda: set(names) <= models(port), 90, "the frontends to list every adapter")
        systems = {"lora": ServerSystem(ports["lora"], "tiny", names), "rr": ServerSystem(ports["rr"], "tiny", names)}
        sequence = adapter_sequence("zipf", args.requests, len(names), seed=7)

        async def one_round(index: int) -> dict:
            order = CELLS[index % 3:] + CELLS[:index % 3]
            out = {"order": list(order), "cells": {}}
            for cell in order:
                place(rig, hosts, names, everywhere=(cell == "rr-warm"))
                for port in ports.values():
                    wait_for(lambda: set(names) <= models(port), 60, "the frontends to list every adapter")
                pulls_before = weight_downloads(hub)
                before = counters(hosts, names)
                figures = await run_cell(systems["lora" if cell == "lora" else "rr"], sequence, args.streams,
                                         args.tokens)
                after = counters(hosts, names)
                figures["per_host"] = {h: {k: after[h][k] - before[h][k] for k in after[h]} for h in after}
                loads = sum(v["device_loads"] for v in figures["per_host"].values())
                figures["device_loads_per_request"] = round(loads / max(1, figures["requests"]), 3)
                figures["hub_pulls"] = weight_downloads(hub) - pulls_before
                figures["load_average"] = os.getloadavg()
                out["cells"][cell] = figures
                print(f"round {index + 1} {cell}: {json.dumps(figures)}", flush=True)
            return out

        async def all_rounds() -> None:
            for index in range(args.rounds):
                report["rounds"].append(await one_round(index))
            for system in systems.values():
                await system.close()

        try:
            asyncio.run(all_rounds())
        finally:
            hub.stop()
    report["summary"] = summarize(report["rounds"])
    print(json.dumps(report["summary"], indent=1))
    _setup.write(report, args.out)


def summarize(rounds: list[dict]) -> dict:
    out = {}
    for cell in CELLS:
        cells = [r["cells"][cell] for r in rounds]
        out[cell] = {k: statistics.median(c[k] for c in cells) for k in
                     ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "device_loads_per_request", "hub_pulls")}
        if cell != "lora":
            for k in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms"):
                r = [c[k] / l[k] for c, l in zip(cells, (x["cells"]["lora"] for x in rounds))]
                out[cell][f"{k}_vs_lora"] = _setup.spread(r, digits=3)
    return out


if __name__ == "__main__":
    main()
