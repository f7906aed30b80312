"""A store of many adapters placed by hand: what listing, status and start-up cost at N adapters.

Issue 48's goals at 10,000 adapters (rank 4, two modules each, placed by hand in the seeds'
``<org>/<name>`` layout): ``loractl ls --json``, ``loractl status --json`` and ``GET /v1/models``
under 0.5 s, and the daemon's start-up (process start to ready) within 1.2x of the same daemon
with an empty store, both measured in the same run.

Issue 61 added what a user meets first: each of ``ls``, ``ls --json``, ``show``, ``status``,
``status --json``, ``/v1/models`` and ``/api/tags`` once, right after the daemon said it is ready
(``first_call_s``), before its warm medians and maxima; and the store of N started a second time
(``full_restarted``: what the first start learned is kept in ``.known.json``).

Usage:  .venv/bin/python bench/store_scale.py [--adapters N] [--runs R] [--json OUT]
        .venv/bin/python bench/store_scale.py --profile [--adapters N]   # in-process, no engine

The adapters are one real adapter for the tiny test model written once, then copied N times with
its last weight changed, so every copy has content (and a digest) of its own. ``--profile`` runs
the path of ``ls --json`` in this process stage by stage (store, views, the text the daemon
writes for ``ls --json``, the gRPC reply of messages and the CLI's decoding and JSON of it: the
path of other clients), then under cProfile (no engine), to show where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
sys.path.insert(0, str(REPO / "daemon"))


def make_adapters(home: Path, count: int, first: int = 0) -> Path:
    """``count`` hand-placed adapters ``scale/a00000``... under ``home``'s store, each of its own
    content (``first`` offsets it: stores made with other offsets share none); returns the tiny
    model's folder (built under ``home`` as the daemon would)."""
    from loractl import paths
    from loractld.models.tiny import ensure_demo

    tiny = ensure_demo(paths.layout(home).tiny_dir)
    template = Path(tempfile.mkdtemp(prefix="lct-scale-"))
    try:
        _two_module_adapter(tiny / "model", template)
        weights = (template / "adapter_model.safetensors").read_bytes()
        config = (template / "adapter_config.json").read_bytes()
        root = paths.layout(home).data_dir / "adapters" / "scale"
        root.mkdir(parents=True, exist_ok=True)
        for i in range(count):
            folder = root / f"a{i:05d}"
            folder.mkdir()
            # The last float32 of the last tensor: distinct for every i, small like its neighbours.
            (folder / "adapter_model.safetensors").write_bytes(weights[:-4] + struct.pack("<f", 0.01 + (first + i) * 1e-7))
            (folder / "adapter_config.json").write_bytes(config)
    finally:
        shutil.rmtree(template, ignore_errors=True)
    return tiny / "model"


def _two_module_adapter(model_dir: Path, out: Path) -> None:
    """A rank-4 LoRA on q_proj and v_proj of every layer of the tiny model."""
    import torch
    from safetensors.torch import save_file

    config = json.loads((model_dir / "config.json").read_text())
    hidden = config["hidden_size"]
    kv = config["num_key_value_heads"] * (hidden // config["num_attention_heads"])
    generator = torch.Generator().manual_seed(48)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj, fan_out in (("q_proj", hidden), ("v_proj", kv)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(4, hidden, generator=generator) * 0.08
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, 4, generator=generator) * 0.08
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, out / "adapter_model.safetensors", metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": "loractl/demo-tiny-llama",
        "r": 4, "lora_alpha": 8, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"], "bias": "none",
        "fan_in_fan_out": False, "inference_mode": True, "use_rslora": False, "use_dora": False}, indent=2))


def start(home: Path, port: int) -> tuple[subprocess.Popen, float, float]:
    """Start a daemon on the tiny model; return it, its seconds from spawn to ready, and the wall
    clock at spawn (for :func:`startup_stages`)."""
    sock = home / "d.sock"
    began, spawned = time.perf_counter(), time.time()
    proc = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(home), "--socket", str(sock),
                             "--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "256",
                             "--http", f"127.0.0.1:{port}", "--max-cpu-loras", str(HOST_ENTRIES)],
                            stdout=open(home / "d.log", "wb"), stderr=subprocess.STDOUT, start_new_session=True)
    while time.perf_counter() - began < 600:
        if proc.poll() is not None:
            raise SystemExit(f"the daemon exited: {(home / 'd.log').read_text()[-3000:]}")
        result = subprocess.run([str(BIN / "loractl"), "status", "--json", "--socket", str(sock)],
                                capture_output=True, text=True)
        if result.returncode == 0 and json.loads(result.stdout)["ready"]:
            return proc, time.perf_counter() - began, spawned
        time.sleep(0.1)
    raise SystemExit("the daemon did not come up")


_STAGES = (("listening", "loractld: listening on"), ("store opened", "loractld: store "),
           ("engine up", "loractld.engine: engine up in"), ("ready", "loractld: ready:"))


def startup_stages(log: Path, spawned: float, startup: float) -> dict[str, float]:
    """Where a start-up's seconds went, from the daemon's log lines (its logging clock is the
    wall clock): spawn to each stage's line, each from the one before; and what remained until
    the bench's ``status`` poll saw it ready. Stages without a line are left out."""
    import datetime

    stages, last = {}, spawned
    lines = log.read_text(errors="replace").splitlines()
    for stage, marker in _STAGES:
        line = next((line for line in lines if marker in line), None)
        if line is None:
            continue
        at = datetime.datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        stages[stage] = round(at - last, 2)
        last = at
    stages["seen ready by the bench"] = round(spawned + startup - last, 2)
    return stages


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    proc.wait(120)


SHOWN = "scale/a00005"   # the adapter `show` asks for (every store of more than 5 has it)
HOST_ENTRIES = 4   # the daemon's default --max-cpu-loras, given so that "the host tier full" is explicit


def timed(fn, runs: int) -> list[float]:
    fn()  # warm: the first ask after start may fill caches
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        fn()
        times.append(time.perf_counter() - began)
    return times


def measure(home: Path, runs: int, expect: int, pulls: list[Path] = ()) -> dict:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    proc, startup, spawned = start(home, port)
    sock = str(home / "d.sock")
    try:
        def cli(*args: str) -> str:
            return subprocess.run([str(BIN / "loractl"), *args, "--socket", sock], capture_output=True,
                                  text=True, check=True).stdout

        def models() -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/v1/models", timeout=60) as r:
                return r.read()

        def tags() -> bytes:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/tags", timeout=60) as r:
                return r.read()

        asks = {"ls": lambda: cli("ls"), "ls --json": lambda: cli("ls", "--json"),
                "show": lambda: cli("show", SHOWN), "status": lambda: cli("status"),
                "status --json": lambda: cli("status", "--json"), "/v1/models": models, "/api/tags": tags}
        if not expect:
            del asks["show"]
        # What a user meets first: each ask once, right after the daemon said it is ready, in
        # this order (the table first: what a user types), before anything warmed a cache.
        first = {}
        for name, ask in asks.items():
            began = time.perf_counter()
            ask()
            first[name] = round(time.perf_counter() - began, 3)
        listed = json.loads(cli("ls", "--json"))
        served = len(json.loads(models())["data"])
        assert len(listed) == expect, (len(listed), expect)
        states = sorted({a["state"] for a in listed})
        listed = len(listed)
        times = {name: timed(ask, runs) for name, ask in asks.items()}
        report = {"startup_s": round(startup, 2), "startup_stages_s": startup_stages(home / "d.log", spawned, startup),
                  "listed": listed, "states_after_first_calls": states, "served_models": served, "first_call_s": first,
                  "median_s": {k: round(statistics.median(v), 3) for k, v in times.items()},
                  "max_s": {k: round(max(v), 3) for k, v in times.items()}}
        if expect > 10:
            report["hand_placed_change"] = hand_placed_change(home, cli, expect)
        if pulls:
            report["pull_s"], report["pull_cpu_s"] = timed_pulls(cli, pulls, expect, proc.pid)
        if expect:
            report["rss"] = rss_host_full(proc.pid, cli)
        return report
    finally:
        stop(proc)


def hand_placed_change(home: Path, cli, expect: int) -> dict:
    """An adapter placed by hand, then removed, while the daemon runs: the next ``ls`` must show
    each change (the daemon keeps its listing between asks); its seconds are those of a listing
    after a change (the store read again, each unchanged entry from its cache)."""
    from loractl import paths

    root = paths.layout(home).data_dir / "adapters" / "scale"
    shutil.copytree(root / "a00000", root / "added")
    (root / "added" / "adapter_model.safetensors").write_bytes(
        (root / "a00000" / "adapter_model.safetensors").read_bytes()[:-4] + struct.pack("<f", -1.0))
    began = time.perf_counter()
    listed = json.loads(cli("ls", "--json"))
    added_s = time.perf_counter() - began
    assert len(listed) == expect + 1 and any(a["name"] == "scale/added" for a in listed), len(listed)
    shutil.rmtree(root / "added")
    began = time.perf_counter()
    listed = json.loads(cli("ls", "--json"))
    removed_s = time.perf_counter() - began
    assert len(listed) == expect, len(listed)
    return {"ls after one added (s)": round(added_s, 3), "ls after it was removed (s)": round(removed_s, 3)}


PULL_QUIET_S = 3.0   # after the last rm: the daemon's work that follows an event (the registry entry) is done


def _cpu_s(pid: int) -> float:
    """The daemon process's CPU seconds so far (user + system, all its threads, no children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def timed_pulls(cli, folders: list[Path], expect: int, pid: int) -> tuple[list[float], float]:
    """Seconds of ``loractl pull FOLDER`` into this store, one per folder, each removed after
    (every pull is number ``expect + 1``), back to back as a user's script would; and the daemon's
    CPU seconds per pull and rm, what follows them included (measured to PULL_QUIET_S after the
    last): wall seconds on a shared machine swing with its load, the CPU spent much less."""
    times = []
    cpu_began = _cpu_s(pid)
    for i, folder in enumerate(folders):
        name = f"pulled/p{i}"
        began = time.perf_counter()
        cli("pull", str(folder), "--name", name, "--json")
        times.append(round(time.perf_counter() - began, 3))
        cli("rm", name, "--json")
    time.sleep(PULL_QUIET_S)
    cpu = (_cpu_s(pid) - cpu_began) / len(folders)
    assert len(json.loads(cli("ls", "--json"))) == expect
    return times, round(cpu, 3)


def rss_host_full(pid: int, cli) -> dict:
    """The daemon's RSS with its host tier full: ``HOST_ENTRIES`` adapters loaded into host RAM,
    listed a few times (its listing kept, as in use), then read from /proc: the daemon alone and
    its process tree (the engine's workers too)."""
    from scale_matrix import rss_mib   # one reader of /proc

    names = [a["name"] for a in json.loads(cli("ls", "--json"))[:HOST_ENTRIES]]
    for name in names:
        cli("load", name, "--to", "host", "--json")
    for _ in range(3):
        listed = json.loads(cli("ls", "--json"))
    in_host = sum(a["tier"] in ("host", "device") for a in listed)
    assert in_host >= HOST_ENTRIES, in_host
    time.sleep(1)
    with open(f"/proc/{pid}/status") as f:
        own = next(int(line.split()[1]) for line in f if line.startswith("VmRSS:"))
    return {"host_entries": in_host, "daemon_mib": round(own / 1024, 1), "tree_mib": rss_mib(pid)}


def profile(count: int) -> None:
    """The listing path of ``ls --json`` in this process, stage by stage: the store's listing, the
    core's views (resolution, residency), the gRPC reply built and encoded, then the CLI's decoding
    and JSON; cold (first pass: hashes and validates every adapter), then warm, then cProfile of
    a warm pass. No engine, no sockets."""
    import asyncio
    import cProfile
    import pstats

    from loractl import paths
    from loractl.cli._output import dumps_indented
    from loractl.message_json import messages_json
    from loractl.messages import to_dict
    from loractl.v1 import loractl_pb2 as pb
    from loractl.message_json import message_json
    from loractld.api.grpc_service import ListedMessages, adapter_message
    from loractld.api.listed_text import ListedText
    from loractld.core.disk_ops import DiskOps
    from loractld.core.tier_ops import TierOps
    from loractld.engine.client import EngineSettings
    from loractld.lifecycle import DaemonSettings, open_catalog

    home = Path(tempfile.mkdtemp(prefix="lct-scale-prof-"))
    try:
        model = make_adapters(home, count)
        began = time.perf_counter()
        catalog = open_catalog(DaemonSettings(engine=EngineSettings(model="tiny")),
                               paths.layout(home).data_dir / "adapters", str(model))
        print(f"open the store: {time.perf_counter() - began:.2f} s")

        class Listing(DiskOps, TierOps):   # the core's listing, without an engine
            tiers = None
            _warming = None
            _manifest_views: dict = {}
            started_up = True
            _unchecked: list = []
            _foreground = 0

            async def _wait_catalog(self):
                return catalog

        core, listed = Listing(), ListedMessages()
        as_text = ListedText(lambda view: message_json(adapter_message(view)))

        def ls() -> dict[str, float]:
            took, began = {}, time.perf_counter()

            def lap(stage: str) -> None:
                nonlocal began
                took[stage] = round(time.perf_counter() - began, 4)
                began = time.perf_counter()
            views = asyncio.run(core.list_adapters())
            lap("daemon: store + views")
            written = as_text.reply(views)
            lap("daemon: ls --json's text (what ls --json asks)")
            data = listed.reply(views).SerializeToString()
            lap("daemon: gRPC reply")
            # The reply made from the kept messages is the one made afresh (not timed).
            assert data == pb.ListReply(adapters=[adapter_message(v) for v in views]).SerializeToString()
            began = time.perf_counter()
            text = messages_json(pb.ListReply.FromString(data).adapters)
            lap("cli: JSON from the messages")
            dumps_indented(to_dict(pb.ListReply.FromString(data))["adapters"])
            lap("cli: JSON through dicts (other commands)")
            assert text is not None and written.decode() == text
            return took
        for label in ("first (cold)", "second (warm)", "third (warm)"):
            print(f"== {label}: {json.dumps(ls())}")
        prof = cProfile.Profile()
        prof.enable()
        ls()
        prof.disable()
        pstats.Stats(prof).sort_stats("cumulative").print_stats(20)
    finally:
        shutil.rmtree(home, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--adapters", type=int, default=10_000)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--pulls", type=int, default=3, help="pulls timed into each store (pull 1 against N + 1)")
    parser.add_argument("--profile", action="store_true", help="profile the listing path in-process instead")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if args.profile:
        profile(args.adapters)
        return
    empty = Path(tempfile.mkdtemp(prefix="lct-scale-empty-", dir="/tmp"))
    full = Path(tempfile.mkdtemp(prefix="lct-scale-full-", dir="/tmp"))
    ten = Path(tempfile.mkdtemp(prefix="lct-scale-ten-", dir="/tmp"))
    sources = Path(tempfile.mkdtemp(prefix="lct-scale-src-", dir="/tmp"))
    load_before = os.getloadavg()   # other jobs on the machine: read the ratios, not the seconds
    try:
        began = time.perf_counter()
        make_adapters(full, args.adapters)
        made_s = time.perf_counter() - began
        from loractl import paths
        from loractld.models.tiny import ensure_demo
        ensure_demo(paths.layout(empty).tiny_dir)
        make_adapters(ten, 10)
        # Folders to pull, of content no store holds: pull 1 (into the empty store) against pull
        # N + 1 (into the full one), median of --pulls each.
        make_adapters(sources, 2 * args.pulls, first=10 * args.adapters + 1000)
        folders = sorted((paths.layout(sources).data_dir / "adapters" / "scale").iterdir())
        # Empty, full, empty again: start-up on a shared machine drifts; the ratio is to the mean.
        first_empty = measure(empty, args.runs, 0, pulls=folders[:args.pulls])
        with_adapters = measure(full, args.runs, args.adapters, pulls=folders[args.pulls:])
        # The same store started again: what the first start learned is kept (store.known).
        restarted = measure(full, args.runs, args.adapters)
        second_empty = measure(empty, args.runs, 0)
        with_ten = measure(ten, args.runs, 10)
        empty_startup = (first_empty["startup_s"] + second_empty["startup_s"]) / 2
        report = {
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "adapters": args.adapters, "made_in_s": round(made_s, 1), "runs": args.runs,
            "empty": [first_empty, second_empty], "full": with_adapters, "full_restarted": restarted, "ten": with_ten,
            "rss_full_minus_ten_mib": {k: round(with_adapters["rss"][k] - with_ten["rss"][k], 1)
                                       for k in ("daemon_mib", "tree_mib")},
            "pull_median_s": {"first (empty store)": statistics.median(first_empty["pull_s"]),
                              f"number {args.adapters + 1}": statistics.median(with_adapters["pull_s"])},
            "daemon_cpu_s_per_pull_and_rm": {"empty store": first_empty["pull_cpu_s"],
                                             f"{args.adapters} adapters": with_adapters["pull_cpu_s"]},
            "startup_ratio_full_over_empty": round(with_adapters["startup_s"] / empty_startup, 2),
            "startup_ratio_restarted_over_empty": round(restarted["startup_s"] / empty_startup, 2),
            "load_average_1_5_15_min": {"before": [round(x, 2) for x in load_before],
                                        "after": [round(x, 2) for x in os.getloadavg()]},
        }
    finally:
        shutil.rmtree(empty, ignore_errors=True)
        shutil.rmtree(full, ignore_errors=True)
        shutil.rmtree(ten, ignore_errors=True)
        shutil.rmtree(sources, ignore_errors=True)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
