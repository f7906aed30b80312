"""The GPU workstation's check (issue 56), one short call on a lent GPU: the defaults loractld chose
on this card against what nvidia-smi says, a sleep and a wake at each level (``--keep-alive``,
vLLM's sleep mode) with nvidia-smi before and after and the wake's time, and one vLLM engine flag
passed through (``--gpu-memory-utilization 0.5``). Run by scripts/gpu_check.sh (step
``workstation``); refuses without nvidia-smi.

    python bench/workstation_check.py --device cuda --model tiny --workdir /tmp/ws --out ws.json

Each phase starts its own daemon (the engine's start is most of the time: 60-95 s on the H200
leases). The answers after a wake are compared with the answer before the sleep, token for token.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

BIN = Path(sys.executable).parent
PROMPT = "The three primary colors are"


def smi() -> dict:
    """Used and free memory of each GPU (MiB), and who holds it."""
    try:
        rows = subprocess.run(["nvidia-smi", "--query-gpu=index,memory.used,memory.free,memory.total",
                               "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30).stdout
        apps = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                              capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        return {"error": str(e)}
    gpus = [dict(zip(("index", "used_mib", "free_mib", "total_mib"), map(int, r.split(","))))
            for r in rows.strip().splitlines() if r.strip()]
    return {"gpus": gpus, "apps": [a.strip() for a in apps.strip().splitlines() if a.strip()]}


def cli(home: Path, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "LORACTL_HOME": str(home), "NO_COLOR": "1"}
    return subprocess.run([str(BIN / "loractl"), *args], capture_output=True, text=True, env=env, timeout=timeout)


def status(home: Path) -> dict:
    result = cli(home, "status", "--json", timeout=60)
    return json.loads(result.stdout) if result.returncode == 0 else {"error": result.stderr.strip()}


def answer(home: Path) -> tuple[list[int], float]:
    began = time.monotonic()
    result = cli(home, "run", "--raw", "-t", "0", "-n", "16", "--json", PROMPT)
    took = time.monotonic() - began
    if result.returncode != 0:
        raise RuntimeError(f"loractl run failed: {result.stderr.strip()}")
    return json.loads(result.stdout)["token_ids"], took


def daemon(home: Path, model: str, device: str, *flags: str) -> subprocess.Popen:
    home.mkdir(parents=True, exist_ok=True)
    log = open(home / "loractld.log", "wb")
    proc = subprocess.Popen([str(BIN / "loractld"), "--model", model, "--device", device, "--home", str(home), *flags],
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    waited = cli(home, "status", "--wait", "--timeout", "400", timeout=900)
    if waited.returncode != 0:
        proc.terminate()
        raise RuntimeError(f"loractld did not start: {waited.stderr.strip()}")
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(90)
    except subprocess.TimeoutExpired:
        proc.kill()


def sleep_phase(work: Path, model: str, device: str, level: int, keep_alive: int) -> dict:
    home = work / f"level{level}"
    began = time.monotonic()
    proc = daemon(home, model, device, "--keep-alive", f"{keep_alive}s", "--sleep-level", str(level))
    out = {"level": level, "start_s": round(time.monotonic() - began, 1)}
    try:
        info = status(home)
        out["engine"] = {k: info.get("engine", {}).get(k) for k in ("max_loras", "max_cpu_loras", "kv_cache_bytes",
                                                                    "choices", "engine_args_json")}
        out["smi_awake"] = smi()
        tokens, out["first_answer_s"] = answer(home)
        deadline = time.monotonic() + keep_alive + 120
        while status(home).get("state") != "asleep" and time.monotonic() < deadline:
            time.sleep(1)
        out["state"] = status(home).get("state")
        out["smi_asleep"] = smi()
        again, out["wake_answer_s"] = answer(home)
        out["same_tokens_after_wake"] = again == tokens
        out["smi_woken"] = smi()
    finally:
        stop(proc)
    return out


def passthrough_phase(work: Path, model: str, device: str) -> dict:
    home = work / "share"
    proc = daemon(home, model, device, "--gpu-memory-utilization", "0.5")
    try:
        info = status(home)
        args = json.loads(info.get("engine", {}).get("engine_args_json") or "{}")
        return {"gpu_memory_utilization": args.get("gpu_memory_utilization"),
                "kv_cache_bytes": info.get("engine", {}).get("kv_cache_bytes"), "smi": smi()}
    finally:
        stop(proc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--model", default="tiny")
    p.add_argument("--kv-cache", default=None, help="ignored: the defaults are what is checked")
    p.add_argument("--workdir", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--keep-alive", type=int, default=15, help="seconds of idle before the engine sleeps")
    args = p.parse_args()
    if shutil.which("nvidia-smi") is None:
        print("workstation_check: error: no nvidia-smi\nhint: run it on a GPU machine (scripts/gpu_check.sh)",
              file=sys.stderr)
        return 1
    work = Path(args.workdir)
    result = {"model": args.model, "smi_before": smi()}
    failed = False
    for name, run in (("level1", lambda: sleep_phase(work, args.model, args.device, 1, args.keep_alive)),
                      ("level2", lambda: sleep_phase(work, args.model, args.device, 2, args.keep_alive)),
                      ("share", lambda: passthrough_phase(work, args.model, args.device))):
        try:
            result[name] = run()
        except Exception as e:  # noqa: BLE001 - each phase is reported, the next still runs
            result[name] = {"error": f"{type(e).__name__}: {e}"}
            failed = True
        Path(args.out).write_text(json.dumps(result, indent=2))
        print(name, json.dumps(result[name])[:400], flush=True)
    ok = (not failed and result["level1"].get("same_tokens_after_wake") and result["level2"].get("same_tokens_after_wake")
          and result["share"].get("gpu_memory_utilization") == 0.5)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
