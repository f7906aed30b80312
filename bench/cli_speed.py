"""CLI start-up cost: `loractl --help`, and `ls`, `status`, `ps`, `show NAME` against a running
daemon, each as typed (the registry finds the daemon: LORACTL_HOME set, no --socket) and with
--socket, beside `python -c pass`, all on this machine in the same run, the cases taken in turn
in each run, with bytecode compiled as an installed wheel has it; the figures are ratios to that
floor (issue 26's bar: at most 8x for the everyday commands as typed; issue 61's: 6.5x).

Usage:  .venv/bin/python bench/cli_speed.py [--home DIR --socket PATH] [--runs N] [--json OUT]

Without --socket it starts a daemon on the tiny test model in a temporary home, with one of
its adapters pulled (and stops it afterwards). Also checks that no command imports torch or vllm.
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
ADAPTER = "sql-expert/v1"   # pulled into the daemon this script starts


def alternating(cases: dict[str, tuple[list[str], dict]], runs: int) -> dict[str, list[float]]:
    """Each case's wall times, the cases taken in turn within each run (a load that comes and
    goes falls on all of them alike, not on the commands timed while it lasted)."""
    for cmd, env in cases.values():
        subprocess.run(cmd, capture_output=True, env=env, check=True)  # warm the page cache
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(runs):
        for name, (cmd, env) in cases.items():
            began = time.perf_counter()
            subprocess.run(cmd, capture_output=True, env=env, check=True)
            times[name].append(time.perf_counter() - began)
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
            subprocess.run([str(BIN / "loractl"), "pull", str(home / "tiny" / "adapters" / ADAPTER), "--name", ADAPTER,
                            "--socket", str(sock)], capture_output=True, check=True)
            return proc
        time.sleep(0.5)
    raise SystemExit("the daemon did not come up")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--socket")
    parser.add_argument("--home", help="the daemon's home (its registry), with --socket")
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    env = {**os.environ, "NO_COLOR": "1"}
    # As installed: pip compiles a wheel's modules to bytecode. A shell with
    # PYTHONDONTWRITEBYTECODE=1 (this project's sessions have it) compiled every module of every
    # command from source: 6.8-7.8x here instead of 5.3-6.4x, with the same code.
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    import loractl

    subprocess.run([sys.executable, "-m", "compileall", "-q", str(Path(loractl.__file__).parent)], env=env,
                   capture_output=True, check=True)
    daemon = None
    socket, home = args.socket, args.home
    if socket is None:
        home = tempfile.mkdtemp(prefix="lct-bench-", dir="/tmp")
        daemon = start_daemon(Path(home))
        socket = str(Path(home) / "d.sock")
    typed = {**env, **({"LORACTL_HOME": str(home)} if home else {})}
    typed.pop("LORACTL_SOCKET", None)
    try:
        listing = json.loads(subprocess.run([str(BIN / "loractl"), "ls", "--json", "--socket", socket], env=env,
                                            capture_output=True, text=True, check=True).stdout)
        reads = {"ls": [], "status": [], "ps": []}
        if listing:  # show needs an adapter
            reads["show"] = [listing[0]["name"]]
        cases = {
            "python -c pass": ([sys.executable, "-c", "pass"], env),
            "loractl --help": ([str(BIN / "loractl"), "--help"], env),
        }
        for command, argv in reads.items():
            cases[f"loractl {command}"] = ([str(BIN / "loractl"), command, *argv], typed)
            cases[f"loractl {command} --socket"] = ([str(BIN / "loractl"), command, *argv, "--socket", socket], env)
        results = alternating(cases, args.runs)
        floor = statistics.median(results["python -c pass"])
        report = {
            "machine": f"{platform.node()} {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}",
            "runs": args.runs,
            "show": reads.get("show", [""])[0],
            "median_s": {k: round(statistics.median(v), 4) for k, v in results.items()},
            "p90_s": {k: round(sorted(v)[int(0.9 * (len(v) - 1))], 4) for k, v in results.items()},
            "ratio_to_python": {k: round(statistics.median(v) / floor, 2) for k, v in results.items()},
            "heavy_imports": {"--help": imports_heavy(["--help"], env),
                              **{command: imports_heavy([command, *argv], typed) for command, argv in reads.items()}},
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
