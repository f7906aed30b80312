"""Head to head under load: loractl vs vLLM's own OpenAI server vs in-process ``AsyncLLM``.

    .venv/bin/python bench/serve_bench.py --rounds 3 --out bench/results/serve-cpu.json

All three run the same model with the same engine and LoRA settings, in the same run, and
are driven with the same load, one system at a time (the others sit idle), alternating the
order every round:

- ``loractl``  — loractld through its Unix socket, driven by ``loractl.Client`` (gRPC);
- ``server``   — ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs;
  on the CPU wheel ``vllm serve`` fails its version lookup), driven by the ``openai`` package
  over ``/v1/chat/completions`` with streaming;
- ``asyncllm`` — vLLM's ``AsyncLLM`` in this process, prompts tokenized once up front.

Workloads: ``base`` (no adapter), ``one`` (every request names adapter 0), ``zipf`` (adapter
drawn Zipf(1.1) over ``--adapters`` adapters, more than ``--max-cpu-loras`` host entries, the
same sequence for every system), each at every ``--streams`` level: N closed-loop clients that
share a queue of max(16, 4N) requests of ``--tokens`` tokens (``min_tokens`` too, so every
request does the same work). Activation (one stream): TTFT of adapter 0 when hot (on
device), warm (pushed off the device by requests for ``max_loras`` others) and cold (pushed
out of host RAM by ``max_cpu_loras`` others, files dropped from the page cache).

Interleaved (one stream): blocks of 20 requests alternate between the systems, so the
machine's drift hits all alike; this is the figure for loractl's added time to first token.
Before every cell and block the benchmark pauses 0.4 s: the engines share a core, and
OpenMP threads spin for up to ~200 ms after the last step of the engine that ran before.

Figures per cell: tokens/s over the cell's wall time, TTFT p50/p99/max, inter-token latency
p50 (per request: time from first to last token over tokens - 1). Ratios are loractl over
each baseline, per round; the report gives their median and spread over the rounds.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import os
import random
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import _setup  # noqa: E402

PROMPT = "Write a query that lists every user who ordered twice"
MESSAGES = [{"role": "user", "content": PROMPT}]
SETTLE_S = 0.4
INTERLEAVE_BLOCK = 20


@dataclass
class Sample:
    ttft: float
    tokens: int
    itl: float | None   # mean gap between tokens after the first; None with < 2 tokens


def _sample(began: float, stamps: list[float], tokens: int) -> Sample:
    if not stamps:
        raise RuntimeError("the request produced no token")
    itl = (stamps[-1] - stamps[0]) / (tokens - 1) if tokens > 1 else None
    return Sample(stamps[0] - began, tokens, itl)


# -- the three systems behind one interface ----------------------------------------------
class LoractlSystem:
    name = "loractl"

    def __init__(self, socket_path: Path, names: list[str], *, stream_per_request: bool = False) -> None:
        from loractl import Client

        self.client = Client(socket_path)
        self.names = names
        if stream_per_request:
            # ``loractl-generate``: the same daemon, a Generate stream per request, as the client
            # did before GenerateMany (and does with a deadline, or a daemon without it).
            self.name = "loractl-generate"
            self.client._unary_only = True

    async def request(self, adapter: int | None, tokens: int) -> Sample:
        began, stamps, n = time.perf_counter(), [], 0
        async for chunk in self.client.generate(messages=MESSAGES, max_tokens=tokens, min_tokens=tokens,
                                                temperature=0.0,
                                                lora=self.names[adapter] if adapter is not None else None):
            if chunk.token_ids:
                stamps.append(time.perf_counter())
                n += len(chunk.token_ids)
        return _sample(began, stamps, n)

    async def close(self) -> None:
        self.client.close()


def httpx_module(openai):
    """The HTTP library the ``openai`` package is built on (``httpx``, or ``httpx2`` in newer releases)."""
    base = openai._base_client
    return getattr(base, "httpx2", None) or base.httpx


class ServerSystem:
    name = "server"

    def __init__(self, port: int, model: str, names: list[str], serves_adapters: bool = True) -> None:
        self.serves_adapters = serves_adapters
        import openai

        # Pooled connections expire before uvicorn's 5 s keep-alive does: a request sent on one
        # the server had just closed failed with ReadError once other systems' runs left it idle ~5 s.
        limits = httpx_module(openai).Limits(max_connections=1000, max_keepalive_connections=100,
                                                  keepalive_expiry=2.0)
        self.client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="bench", max_retries=0,
                                         timeout=600, http_client=openai.DefaultAsyncHttpxClient(limits=limits))
        self.model = model
        self.names = names

    async def request(self, adapter: int | None, tokens: int) -> Sample:
        began, stamps, n = time.perf_counter(), [], 0
        stream = await self.client.chat.completions.create(
            model=self.names[adapter] if adapter is not None else self.model, messages=MESSAGES,
            max_tokens=tokens, temperature=0.0, stream=True, stream_options={"include_usage": True},
            extra_body={"min_tokens": tokens})
        usage = None
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                stamps.append(time.perf_counter())
                n += 1
            if chunk.usage is not None:
                usage = chunk.usage.completion_tokens
        # A chunk can hold more than one token; the usage chunk has the true count.
        return _sample(began, stamps, usage or n)

    async def close(self) -> None:
        await self.client.close()


class LoractlHttpSystem(ServerSystem):
    """loractld's ``--http`` door (vLLM's serving classes over loractl's core), driven exactly
    as the server is: adapters by their store names, the base model by its served name."""

    name = "loractl-http"


class AsyncLLMSystem:
    name = "asyncllm"

    def __init__(self, llm, paths: list[Path]) -> None:
        from vllm.lora.request import LoRARequest

        self.llm = llm
        self.loras = [LoRARequest(lora_name=f"a{i}", lora_int_id=i + 1, lora_path=str(p)) for i, p in enumerate(paths)]
        tokenizer = llm.get_tokenizer()
        text = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
        self.prompt = {"prompt_token_ids": tokenizer.encode(text, add_special_tokens=False)}
        self.counter = itertools.count()

    async def request(self, adapter: int | None, tokens: int) -> Sample:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(max_tokens=tokens, min_tokens=tokens, temperature=0.0,
                                output_kind=RequestOutputKind.DELTA)
        began, stamps, n = time.perf_counter(), [], 0
        async for out in self.llm.generate(self.prompt, params, f"r{next(self.counter)}",
                                           lora_request=self.loras[adapter] if adapter is not None else None):
            k = len(out.outputs[0].token_ids)
            if k:
                stamps.append(time.perf_counter())
                n += k
        return _sample(began, stamps, n)

    async def close(self) -> None:
        _setup.shutdown_vllm_engine(self.llm)


# -- the load -----------------------------------------------------------------------------
def adapter_sequence(workload: str, count: int, adapters: int, seed: int, exponent: float = 1.1) -> list[int | None]:
    if workload == "base":
        return [None] * count
    if workload == "one":
        return [0] * count
    weights = [1 / (i + 1) ** exponent for i in range(adapters)]
    return random.Random(seed).choices(range(adapters), weights=weights, k=count)


async def cell(system, workload: str, streams: int, args, seed: int) -> dict:
    count = args.requests or max(16, 4 * streams)
    await settle()
    queue = list(reversed(adapter_sequence(workload, count, args.adapters, seed)))
    if workload == "one":
        await system.request(0, 2)  # this cell measures serving an adapter, not its first load
    samples: list[Sample] = []

    async def client() -> None:
        while queue:
            samples.append(await system.request(queue.pop(), args.tokens))

    frontend = _process(getattr(system, "frontend_pid", None))
    cpu_before, client_before = _cpu(frontend), time.process_time()
    began = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(streams)))
    result = figures(samples, time.perf_counter() - began)
    tokens = sum(s.tokens for s in samples)
    if frontend is not None and tokens:
        # The process that answers the client (loractld's own, or the server's API process), not its
        # engine core; and this benchmark process, which for AsyncLLM *is* the front end.
        result["frontend_cpu_us_per_token"] = round((_cpu(frontend) - cpu_before) / tokens * 1e6, 1)
    if tokens:
        result["client_cpu_us_per_token"] = round((time.process_time() - client_before) / tokens * 1e6, 1)
    return result


def _process(pid: int | None):
    if pid is None:
        return None
    import psutil

    return psutil.Process(pid)


def _cpu(process) -> float:
    if process is None:
        return 0.0
    times = process.cpu_times()
    return times.user + times.system


def figures(samples: list[Sample], wall: float) -> dict:
    """A cell's figures from its samples and its wall time."""
    ttfts = [s.ttft for s in samples]
    itls = [s.itl for s in samples if s.itl is not None]
    return {"requests": len(samples), "tokens_per_s": round(sum(s.tokens for s in samples) / wall, 1),
            "ttft_p50_ms": _ms(statistics.median(ttfts)), "ttft_p99_ms": _ms(_setup.percentile(ttfts, 0.99)),
            "ttft_p999_ms": _ms(_setup.percentile(ttfts, 0.999)),
            "ttft_max_ms": _ms(max(ttfts)), "itl_p50_ms": _ms(statistics.median(itls)) if itls else None,
            "wall_s": round(wall, 3)}


async def activation(system, args, work: Path, paths: list[Path]) -> dict:
    """TTFT of adapter 0: hot, warm (off the device only), cold (out of host RAM too)."""
    out = {}
    await settle()
    await system.request(0, 2)
    out["hot"] = (await system.request(0, 2)).ttft
    for other in range(1, args.max_loras + 1):
        await system.request(other, 2)
    out["warm"] = (await system.request(0, 2)).ttft
    for other in range(1, args.max_cpu_loras + 1):
        await system.request(other, 2)
    _setup.drop_page_cache(paths[0])
    out["cold"] = (await system.request(0, 2)).ttft
    return {tier: _ms(value) for tier, value in out.items()}


async def settle() -> None:
    """Let the engine that ran last go quiet: OpenMP worker threads spin for up to ~200 ms
    after their last parallel region, and every engine here is bound to the same core, so
    the next system's first requests would pay for the previous one's spinning."""
    await asyncio.sleep(SETTLE_S)


async def interleaved_ttft(systems: list, args) -> dict:
    """One stream, blocks of requests alternating between the systems (so drift in this
    noisy machine's speed hits all alike): TTFT p50 per system and workload."""
    out = {}
    for workload in ("base", "one"):
        adapter = 0 if workload == "one" else None
        serving = [s for s in systems if adapter is None or getattr(s, "serves_adapters", True)]
        samples: dict[str, list[float]] = {s.name: [] for s in serving}
        for _ in range(max(1, args.interleaved // INTERLEAVE_BLOCK)):
            for system in serving:
                await settle()
                await system.request(adapter, 2)
                for _ in range(INTERLEAVE_BLOCK):
                    samples[system.name].append((await system.request(adapter, 2)).ttft)
        out[workload] = {name: _ms(statistics.median(values)) for name, values in samples.items()}
    return out


def _ms(seconds: float) -> float:
    return round(1000 * seconds, 2)


# -- starting the systems -------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(model: str, names: list[str], paths: list[Path], args, log: Path) -> tuple[subprocess.Popen, int]:
    port = free_port()
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--host", "127.0.0.1",
           "--port", str(port), "--max-model-len", str(args.max_model_len), "--seed", "0",
           "--disable-uvicorn-access-log"]
    if not getattr(args, "server_without_lora", False):
        cmd += ["--enable-lora", "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras),
                "--max-lora-rank", str(args.rank), "--lora-modules", *(f"{n}={p}" for n, p in zip(names, paths))]
    cmd += ["--dtype", _setup.dtype(args)]
    if args.device == "cpu":
        cmd += ["--enforce-eager", "--kv-cache-memory-bytes",
                str(_setup.parse_kv(args.kv_cache) or 256 << 20)]
    elif args.kv_cache:
        # The same KV cache as the daemon's: a fair comparison, and on a shared GPU the server
        # then does not size its cache from 90% of memory while a daemon starts beside it.
        cmd += ["--kv-cache-memory-bytes", str(_setup.parse_kv(args.kv_cache))]
    if args.max_num_seqs:
        cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    proc = subprocess.Popen(cmd, stdout=open(log, "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    import urllib.request

    for _ in range(600):
        if proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited; see {log}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return proc, port
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit("the vLLM server did not come up")


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)


# -- the report ------------------------------------------------------------------------------
def ratios(rounds: list[dict], system: str, baseline: str) -> dict:
    """Per cell and figure: loractl/baseline per round -> median and [min, max]."""
    out = {}
    for key in rounds[0][system]["cells"]:
        if "skipped" in rounds[0][baseline]["cells"][key]:
            continue
        figures = {}
        for figure in ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "itl_p50_ms", "frontend_cpu_us_per_token"):
            values = [r[system]["cells"][key][figure] / r[baseline]["cells"][key][figure] for r in rounds
                      if r[baseline]["cells"][key].get(figure) and r[system]["cells"][key].get(figure) is not None]
            if values:
                figures[figure] = _setup.spread(values)
        out[key] = figures
    return out


def markdown(report: dict) -> str:
    lines = ["| load | tok/s ×server | TTFT p50 ×server | TTFT p99 ×server | ITL p50 ×server | "
             "tok/s ×AsyncLLM | TTFT p50 ×AsyncLLM | worst TTFT loractl / server (ms) |",
             "|---|---|---|---|---|---|---|---|"]
    vs_server, vs_llm = report["ratios"]["loractl_over_server"], report["ratios"]["loractl_over_asyncllm"]

    def fmt(r: dict, figure: str) -> str:
        v = r.get(figure)
        return f"{v['median']:.2f} ({v['min']:.2f}–{v['max']:.2f})" if v else "—"

    for key in vs_server:
        worst = {s: max(r[s]["cells"][key]["ttft_max_ms"] for r in report["rounds"]) for s in ("loractl", "server")}
        lines.append(f"| {key} | {fmt(vs_server[key], 'tokens_per_s')} | {fmt(vs_server[key], 'ttft_p50_ms')} | "
                     f"{fmt(vs_server[key], 'ttft_p99_ms')} | {fmt(vs_server[key], 'itl_p50_ms')} | "
                     f"{fmt(vs_llm[key], 'tokens_per_s')} | {fmt(vs_llm[key], 'ttft_p50_ms')} | "
                     f"{worst['loractl']:.0f} / {worst['server']:.0f} |")
    act = ["", "| activation TTFT p50 (ms) | loractl | server | AsyncLLM | ×server | ×AsyncLLM |", "|---|---|---|---|---|---|"]
    for tier in ("hot", "warm", "cold"):
        med = {s: statistics.median(r[s]["activation"][tier] for r in report["rounds"])
               for s in ("loractl", "server", "asyncllm")}
        act.append(f"| {tier} | {med['loractl']:.1f} | {med['server']:.1f} | {med['asyncllm']:.1f} | "
                   f"{med['loractl'] / med['server']:.2f} | {med['loractl'] / med['asyncllm']:.2f} |")
    inter = ["", "| one stream, interleaved: TTFT p50 (ms) | loractl | server | AsyncLLM | loractl − AsyncLLM |",
             "|---|---|---|---|---|"]
    for workload in ("base", "one"):
        med = {s: statistics.median(r["interleaved_ttft_p50_ms"][workload][s] for r in report["rounds"])
               for s in ("loractl", "server", "asyncllm")}
        spread = [r["interleaved_ttft_p50_ms"][workload]["loractl"] - r["interleaved_ttft_p50_ms"][workload]["asyncllm"]
                  for r in report["rounds"]]
        inter.append(f"| {workload} | {med['loractl']:.2f} | {med['server']:.2f} | {med['asyncllm']:.2f} | "
                     f"{statistics.median(spread):+.2f} ({min(spread):+.2f} to {max(spread):+.2f}) |")
    return "\n".join(lines + act + inter)


async def run_round(systems: list, args, work: Path, paths: list[Path], round_no: int) -> dict:
    out = {}
    order = systems[round_no % len(systems):] + systems[:round_no % len(systems)]
    for system in order:
        cells = {}
        adapters = getattr(system, "serves_adapters", True)
        for workload in args.workloads:
            for streams in args.streams:
                cells[f"{workload}@{streams}"] = await cell(system, workload, streams, args, seed=round_no) \
                    if adapters or workload == "base" else {"skipped": "started without LoRA (--server-without-lora)"}
                print(f"round {round_no} {system.name:8s} {workload}@{streams}: {cells[f'{workload}@{streams}']}",
                      file=sys.stderr, flush=True)
        out[system.name] = {"cells": cells, "activation": await activation(system, args, work, paths) if adapters
                            else {}}
    out["interleaved_ttft_p50_ms"] = await interleaved_ttft(order, args)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    _setup.engine_arguments(p, adapters=6)
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: each system's own (vLLM's) default")
    p.add_argument("--tokens", type=int, default=32)
    p.add_argument("--streams", default="1,8,32,64")
    p.add_argument("--workloads", default="base,one,zipf")
    p.add_argument("--systems", default="loractl,server,asyncllm",
                   help="also loractl-generate: the same daemon driven with a Generate stream per request; "
                        "loractl-http: the same daemon through its --http door, driven as the server is")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--server-without-lora", action="store_true",
                   help="start vLLM's server without LoRA and drive it with the base workload only: on the CPU "
                        "it dies at the first request on a mixture-of-experts base with LoRA on (issue 59)")
    p.add_argument("--interleaved", type=int, default=100,
                   help="requests per system in the one-stream interleaved TTFT comparison")
    p.add_argument("--requests", type=int, default=None, help="requests per cell (default: max(16, 4 x streams))")
    p.add_argument("--workdir")
    p.add_argument("--out")
    args = p.parse_args()
    args.streams = [int(s) for s in args.streams.split(",")]
    args.workloads = args.workloads.split(",")
    if args.adapters <= args.max_cpu_loras:
        raise SystemExit("--adapters must exceed --max-cpu-loras (zipf and cold need evictions from host RAM)")
    work = _setup.workdir(args.workdir)
    model, paths = _setup.prepare(args.model, args.adapters, args.rank, work)
    names = [f"bench/a{i}" for i in range(len(paths))]
    wanted = args.systems.split(",")
    home = work / "home"  # fresh each run: pins and the store of an earlier run would skew it
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir()

    daemon = server = None
    try:
        extra = ["--max-num-seqs", str(args.max_num_seqs)] if args.max_num_seqs else []
        http_port = free_port() if "loractl-http" in wanted else None
        if http_port:
            extra += ["--http", f"127.0.0.1:{http_port}"]
        daemon = _setup.Daemon(model, args, home, extra) \
            if {"loractl", "loractl-generate", "loractl-http"} & set(wanted) else None
        server = start_server(model, [n.replace("/", "-") for n in names], paths, args, work / "server.log") \
            if "server" in wanted else None

        async def go() -> dict:
            systems = []
            if daemon:
                from loractl import Client

                async with Client(daemon.socket) as c:
                    for name, path in zip(names, paths):
                        async for _ in c.pull(str(path), name=name):
                            pass
                for stream_per_request in [False] * ("loractl" in wanted) + [True] * ("loractl-generate" in wanted):
                    systems.append(LoractlSystem(daemon.socket, names, stream_per_request=stream_per_request))
                    systems[-1].frontend_pid = daemon.proc.pid
                if http_port:
                    systems.append(LoractlHttpSystem(http_port, model, names))
                    systems[-1].frontend_pid = daemon.proc.pid
            if server:
                systems.append(ServerSystem(server[1], model, [n.replace("/", "-") for n in names],
                                            serves_adapters=not args.server_without_lora))
                systems[-1].frontend_pid = server[0].pid  # the API server process; its engine core is a child
            if "asyncllm" in wanted:
                systems.append(AsyncLLMSystem(_setup.vllm_engine(model, args), paths))
            try:
                return {"rounds": [await run_round(systems, args, work, paths, i) for i in range(args.rounds)]}
            finally:
                for s in systems:
                    await s.close()

        results = asyncio.run(go())
    finally:
        if daemon:
            daemon.stop()
        if server:
            stop(server[0])
    report = {"machine": _setup.machine(), "versions": _setup.versions(), "model": args.model,
              "settings": {k: getattr(args, k) for k in ("device", "rank", "adapters", "max_loras", "max_cpu_loras",
                                                         "max_model_len", "max_num_seqs", "kv_cache", "tokens",
                                                         "streams", "workloads", "rounds", "server_without_lora")},
              **results}
    if "loractl" in wanted:
        report["ratios"] = {f"loractl_over_{baseline}": ratios(report["rounds"], "loractl", baseline)
                            for baseline in ("server", "asyncllm", "loractl-generate") if baseline in wanted}
    if {"loractl-http", "server"} <= set(wanted):
        report.setdefault("ratios", {})["loractl-http_over_server"] = ratios(report["rounds"], "loractl-http", "server")
    if {"loractl", "server", "asyncllm"} <= set(wanted):
        report["markdown"] = markdown(report)
        print(report["markdown"], file=sys.stderr)
    _setup.write(report, args.out)


if __name__ == "__main__":
    main()
