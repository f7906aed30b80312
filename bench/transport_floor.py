"""What loractld's gRPC front end costs per token with no engine behind it.

    .venv/bin/python bench/transport_floor.py --rounds 3 --out bench/results/transport-floor-cpu.json

loractld's own process spends CPU on three things per streamed token: vLLM's output handling
(detokenizing, the request's output queue: what in-process ``AsyncLLM`` pays too), loractl's
layers around it, and the gRPC transport (protobuf, grpclib, h2's HTTP/2 frames). This
benchmark measures the last alone: a daemon process serves ``LoractlService.Generate`` — the
real handler, the real ``CoalescingServer`` the daemon runs, on a Unix socket, under uvloop as
the daemon runs — over a core double that yields one token per event-loop turn for every
open request (as an engine step wakes every stream it advanced in one turn) and renders no
template. ``loractl.Client`` drives it as serve_bench.py does: ``--streams`` closed-loop
clients, the same chat request, ``max_tokens`` = ``min_tokens`` = each ``--tokens`` level, over
each RPC in turn (alternating per round): ``many`` (one ``GenerateMany`` stream carries the
client's generations, what ``loractl.Client`` does) and ``generate`` (a ``Generate`` stream
per generation, as before ``GenerateMany`` and for a client with a deadline).

Figures per level: the serving process's CPU per token (user + system, from psutil), and
the client's. Two levels fit ``CPU = per_request + tokens x per_token``; docs/benchmarks.md
sets these against serve_bench.py's figures for the whole daemon, vLLM's API server and
``AsyncLLM`` (item 3 of issue 25: what share of the daemon's cost the transport is).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parent.parent
PROMPT_IDS = list(range(1, 26))   # serve_bench's chat prompt is 25 tokens on the tiny model
MESSAGES = [{"role": "user", "content": "Write a query that lists every user who ordered twice"}]


# -- the serving side (a subprocess) ------------------------------------------------------
class StepCore:
    """What ``LoractlService.Generate`` asks of ``Core``, with no engine: every open request
    gets one token each loop turn, the first reply carrying the prompt's ids, the last the
    finish reason (the replies the real daemon sends)."""

    async def prepare(self, generation):
        return SimpleNamespace(adapter=None, prompt_ids=PROMPT_IDS, sampling=generation.sampling)

    async def run(self, prepared):
        from loractld.engine.sampling import Delta

        count = prepared.sampling.max_tokens
        for i in range(count):
            await asyncio.sleep(0)
            yield Delta(text=" word", token_ids=[1000 + i], finish_reason="length" if i == count - 1 else None,
                        prompt_token_ids=PROMPT_IDS if i == 0 else None)


async def serve(socket_path: str) -> None:
    from loractld.api.coalesce import CoalescingServer
    from loractld.api.grpc_service import LoractlService

    server = CoalescingServer([LoractlService(StepCore())])  # type: ignore[arg-type]
    await server.start(path=socket_path)
    print("ready", flush=True)
    await server.wait_closed()


# -- the driving side ---------------------------------------------------------------------
async def drive(socket_path: str, rpc: str, streams: int, requests: int, tokens: int, pid: int) -> dict:
    import psutil

    from loractl import Client

    client, served, left = Client(socket_path), psutil.Process(pid), [requests]
    client._unary_only = rpc == "generate"   # what the client does with a daemon before GenerateMany

    async def one_stream() -> int:
        got = 0
        while left[0] > 0:
            left[0] -= 1
            async for chunk in client.generate(messages=MESSAGES, max_tokens=tokens, min_tokens=tokens,
                                               temperature=0.0):
                got += len(chunk.token_ids)
        return got

    await one_stream_warm(client)
    cpu = served.cpu_times()
    before, client_before, began = cpu.user + cpu.system, time.process_time(), time.perf_counter()
    produced = sum(await asyncio.gather(*(one_stream() for _ in range(streams))))
    wall = time.perf_counter() - began
    cpu = served.cpu_times()
    client.close()
    if produced != requests * tokens:
        raise RuntimeError(f"{produced} tokens arrived, {requests * tokens} were sent")
    return {"rpc": rpc, "tokens": tokens, "requests": requests, "streams": streams,
            "server_cpu_us_per_token": round((cpu.user + cpu.system - before) / produced * 1e6, 1),
            "client_cpu_us_per_token": round((time.process_time() - client_before) / produced * 1e6, 1),
            "tokens_per_s": round(produced / wall, 1)}


async def one_stream_warm(client) -> None:
    for _ in range(20):
        async for _chunk in client.generate(messages=MESSAGES, max_tokens=4, min_tokens=4):
            pass


def fit(levels: list[dict]) -> dict | None:
    """Per request and per token from the shortest and the longest level (µs); None with one level."""
    if len({c["tokens"] for c in levels}) < 2:
        return None
    short, long_ = min(levels, key=lambda c: c["tokens"]), max(levels, key=lambda c: c["tokens"])
    a, b = short["server_cpu_us_per_token"] * short["tokens"], long_["server_cpu_us_per_token"] * long_["tokens"]
    per_token = (b - a) / (long_["tokens"] - short["tokens"])
    return {"per_request_us": round(a - per_token * short["tokens"], 1), "per_token_us": round(per_token, 1)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--serve", help=argparse.SUPPRESS)
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--tokens", default="8,32,128", help="output lengths, comma-separated")
    parser.add_argument("--token-budget", type=int, default=200_000, help="tokens per level and round")
    parser.add_argument("--rpc", default="many,generate", help="RPCs to measure, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out")
    args = parser.parse_args()
    if args.serve:
        sys.path.insert(0, str(ROOT / "daemon"))
        try:
            import uvloop
        except ImportError:
            asyncio.run(serve(args.serve))
        else:
            uvloop.run(serve(args.serve))
        return
    levels, rpcs = [int(t) for t in args.tokens.split(",")], args.rpc.split(",")
    rounds = []
    with tempfile.TemporaryDirectory(prefix="lct-floor-") as work:
        socket_path = os.path.join(work, "floor.sock")
        server = subprocess.Popen([sys.executable, __file__, "--serve", socket_path], stdout=subprocess.PIPE, text=True)
        try:
            if server.stdout.readline().strip() != "ready":
                raise SystemExit("the serving process did not start")
            for r in range(args.rounds):
                measured = {}
                for rpc in (rpcs if r % 2 == 0 else rpcs[::-1]):
                    cells = [asyncio.run(drive(socket_path, rpc, args.streams, max(args.streams, args.token_budget // t),
                                               t, server.pid)) for t in (levels if r % 2 == 0 else levels[::-1])]
                    cells.sort(key=lambda c: c["tokens"])
                    measured[rpc] = {"cells": cells, "fit": fit(cells)}
                rounds.append({"rpcs": measured, "load_1m": round(os.getloadavg()[0], 2)})
                print(json.dumps(rounds[-1]), flush=True)
        finally:
            server.terminate()
            server.wait()
    summary = {rpc: summarize([r["rpcs"][rpc] for r in rounds], levels) for rpc in rpcs}
    result = {"machine": {"cpus": os.cpu_count()}, "settings": vars(args) | {"serve": None},
              "rounds": rounds, "median": summary}
    print(json.dumps(summary))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


def summarize(measured: list[dict], levels: list[int]) -> dict:
    """Medians over the rounds of one RPC: the fit, and CPU per token per level (serving, client)."""
    fits = [m["fit"] for m in measured if m["fit"]]
    out = {"fit": {k: statistics.median(f[k] for f in fits) for k in ("per_request_us", "per_token_us")}
           if fits else None}
    for side in ("server", "client"):
        out[f"{side}_cpu_us_per_token"] = {t: statistics.median(c[f"{side}_cpu_us_per_token"] for m in measured
                                                                for c in m["cells"] if c["tokens"] == t)
                                           for t in levels}
    return out


if __name__ == "__main__":
    main()
