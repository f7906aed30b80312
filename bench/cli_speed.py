"""CLI start-up cost: `loractl --help` and `loractl ls` (against a running daemon) beside
`python -c pass`, all on this machine in the same run; the figures are ratios to that floor.

Usage:  .venv/bin/python bench/cli_speed.py [--socket PATH] [--runs N] [--json OUT]

Without --socket it starts a daemon on the embedded demo model in a temporary home (and
stops it afterwards). Also checks that neither command imports torch or vllm.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BIN = Path(sys.executable).parent


def wall(cmd: list[str], runs: int, env: dict) -> list[float]:
    subprocess.run(cmd, capture_output=True, env=env, check=True)  # warm the page cache
    times = []
    for _ in range(runs):
        began = time.perf_counter()
        subprocess.run(cmd, capture_output=True, env=env, check=True)
        times.append(time.perf_counter() - began)
    return times


def imports_heavy(argv: list[str], env: dict) -> list[str]:
    code = ("import sys\nfrom loractl.cli.app import app\n"
            f"try:\n    app({argv!r})\nexcept SystemExit:\n    pass\n"
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'torch', 'vllm', 'transformers'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env).stdout
    return json.loads(out.strip().splitlines()[-1].replace("'", '"'))


def start_daemon(home: Path) -> subprocess.Popen:
    sock = home / "d.sock"
    proc = subprocess.Popen([str(BIN / "loractld"), "--model", "tiny", "--home", str(home), "--socket", str(sock),
                             "--device", "cpu", "--kv-cache-memory", "64MiB", "--max-model-len", "256"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    for _ in range(600):
        result = subprocess.run([str(BIN / "loractl"), "status", "--json", "--socket", str(sock)],
                                capture_output=True, text=True)
        if result.returncode == 0 and json.loads(result.stdout)["ready"]:
            return proc
        time.sleep(0.5)
    raise SystemExit("the daemon did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    env = {**os.environ, "NO_COLOR": "1"}
    daemon = None
    socket = args.socket
    if socket is None:
        home = Path(tempfile.mkdtemp(prefix="lct-bench-", dir="/tmp"))
        daemon = start_daemon(home)
        socket = str(home / "d.sock")
    try:
        cases = {
            "python -c pass": [sys.executable, "-c", "pass"],
            "loractl --help": [str(BIN / "loractl"), "--help"],
            "loractl ls": [str(BIN / "loractl"), "ls", "--socket", socket],
        }
        results = {name: wall(cmd, args.runs, env) for name, cmd in cases.items()}
        floor = statistics.median(results["python -c pass"])
        report = {
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "runs": args.runs,
            "median_s": {k: round(statistics.median(v), 4) for k, v in results.items()},
            "p90_s": {k: round(sorted(v)[int(0.9 * (len(v) - 1))], 4) for k, v in results.items()},
            "ratio_to_python": {k: round(statistics.median(v) / floor, 2) for k, v in results.items()},
            "heavy_imports": {"--help": imports_heavy(["--help"], env), "ls": imports_heavy(["ls", "--socket", socket], env)},
        }
    finally:
        if daemon is not None:
            daemon.terminate()
            daemon.wait(60)
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
