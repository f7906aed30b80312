"""A record of the engine's processes, so a start can clear an engine its dead daemon left.

The engine core normally dies with the daemon (``vllm_plugin.die_with_daemon``), but a kernel
without the parent-death signal, or an engine started by an older loractld, can still leave one
running: hundreds of MB of RAM, and on a GPU the device memory a new engine needs. So after the
engine starts the daemon writes ``state/engine.json`` (pid and start time of each engine
process, and its own pid), removes it on a clean stop, and the next start under the same home
kills whatever that record still names.

Invariant: only a process whose pid AND start time match the record is killed, so a pid the
system has since reused for something else is never touched.
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path

_log = logging.getLogger("loractld.enginepid")
FILE = "engine.json"


def engine_processes(daemon_pid: int | None = None) -> list[dict]:
    """The daemon's child processes (vLLM's engine core and anything it started)."""
    import psutil

    try:
        children = psutil.Process(daemon_pid or os.getpid()).children(recursive=True)
    except psutil.Error:
        return []
    found = []
    for child in children:
        try:
            found.append({"pid": child.pid, "create_time": child.create_time(), "name": child.name()})
        except psutil.Error:
            continue
    return found


def record(state_dir: Path) -> None:
    state_dir.mkdir(parents=True, exist_ok=True)
    path = state_dir / FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"daemon_pid": os.getpid(), "processes": engine_processes()}))
    os.replace(tmp, path)


def forget(state_dir: Path) -> None:
    (state_dir / FILE).unlink(missing_ok=True)


def clear_stale(state_dir: Path) -> list[int]:
    """Kill the processes a previous daemon's record names, if still running; return their pids."""
    import psutil

    path = state_dir / FILE
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return []
    if data.get("daemon_pid") and psutil.pid_exists(data["daemon_pid"]) and data["daemon_pid"] != os.getpid():
        try:  # that daemon still runs (the socket check refuses a second daemon on its socket)
            if "loractld" in " ".join(psutil.Process(data["daemon_pid"]).cmdline()):
                return []
        except psutil.Error:
            pass
    killed = []
    for entry in data.get("processes", []):
        try:
            proc = psutil.Process(entry["pid"])
            if abs(proc.create_time() - entry["create_time"]) > 0.01:
                continue  # the pid was reused: not ours
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue  # dead already, waiting for a parent (a container's init) to reap it
            proc.send_signal(signal.SIGKILL)
        except (psutil.Error, KeyError, TypeError):
            continue
        killed.append(entry["pid"])
        try:  # its memory is free once it is gone; a zombie (reaped by someone else) is gone enough
            proc.wait(10)
        except psutil.Error:
            pass
    if killed:
        _log.warning("killed %d engine process(es) left running by a daemon that died: pid %s",
                     len(killed), ", ".join(map(str, killed)))
    path.unlink(missing_ok=True)
    return killed
