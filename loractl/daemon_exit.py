"""Why the last daemon of a home stopped, and whether one is starting there now.

A daemon that fails at start (a corrupt GGUF file, a model it cannot serve, a dead engine)
exits before anyone can ask it why. It leaves the reason in ``<state>/last-exit.json`` so that
``loractl status`` and ``status --wait`` can say "loractld exited 20 s ago: ..." at once instead
of waiting for a socket that will never answer. Standard library only: the CLI reads this.

Invariants:
- A daemon clears the record as soon as it holds its home (``loractld.lock``), and writes one
  only on a failed exit: a record present means the last daemon of this home failed, and no
  daemon has taken the home since.
- The record names the socket the daemon served: a CLI pointed at another socket ignores it.
- Written atomically (a temporary file renamed into place); an unreadable record reads as
  none, never as an error of its own.
- ``starting_pid`` reads the home lock's holder (``loractld.lock``: pid and socket) and asks the
  kernel whether that process lives; it never takes the lock (a daemon starting at that moment
  would find its home in use).
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from pathlib import Path

from loractl import paths

EXIT_FILE = "last-exit.json"
LOCK_FILE = "loractld.lock"
FORMAT = 1


@dataclass(frozen=True)
class DaemonExit:
    """One failed exit: when, which daemon, and the error it printed."""

    pid: int
    socket: str
    time: float            # seconds since the epoch
    message: str
    hint: str
    log: str = ""           # where its log went, when the daemon knows (a file or the journal)

    def ago(self, now: float | None = None) -> str:
        seconds = max(0.0, (time.time() if now is None else now) - self.time)
        if seconds < 120:
            return f"{seconds:.0f} s ago"
        if seconds < 7200:
            return f"{seconds / 60:.0f} min ago"
        if seconds < 2 * 86400:
            return f"{seconds / 3600:.0f} h ago"
        return time.strftime("on %Y-%m-%d %H:%M", time.localtime(self.time))


def exit_path(layout: paths.Layout) -> Path:
    return layout.state_dir / EXIT_FILE


def record_exit(layout: paths.Layout, *, socket: str, message: str, hint: str, log: str = "") -> None:
    """Keep this process's failed exit for the CLI (best effort: a full disk loses only this)."""
    path = exit_path(layout)
    body = {"format": FORMAT, "pid": os.getpid(), "socket": socket, "time": time.time(), "message": message,
            "hint": hint, "log": log}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{EXIT_FILE}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(body, indent=2) + "\n")
        os.replace(tmp, path)
    except OSError:
        pass


def clear_exit(layout: paths.Layout) -> None:
    try:
        exit_path(layout).unlink(missing_ok=True)
    except OSError:
        pass


def read_exit(layout: paths.Layout, socket: str | os.PathLike[str] | None = None) -> DaemonExit | None:
    """The last failed exit recorded in this home (for ``socket``, when given), or None."""
    try:
        body = json.loads(exit_path(layout).read_text())
        record = DaemonExit(pid=int(body["pid"]), socket=str(body["socket"]), time=float(body["time"]),
                            message=str(body["message"]), hint=str(body.get("hint") or ""),
                            log=str(body.get("log") or ""))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if socket is not None and record.socket != str(socket):
        return None
    return record


def starting_pid(layout: paths.Layout, socket: str | os.PathLike[str] | None = None) -> int | None:
    """The pid of a live daemon holding this home (serving ``socket``, when given), or None."""
    try:
        holder = json.loads((layout.data_dir / LOCK_FILE).read_text() or "{}")
        pid = int(holder["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if socket is not None and holder.get("socket") not in (None, str(socket)):
        return None
    if pid == os.getpid() or not _alive_daemon(pid):
        return None
    return pid


def _alive_daemon(pid: int) -> bool:
    """Whether ``pid`` is a running loractld (not a zombie, not a reused pid)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's live process: read what /proc shows
    try:
        with open(f"/proc/{pid}/stat") as f:
            if f.read().rsplit(")", 1)[-1].split()[0] == "Z":  # exited, not reaped by its parent yet
                return False
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"loractld" in f.read()
    except OSError:
        return True  # no /proc here: the signal check is all there is


def log_destination() -> str:
    """Where this process's stderr goes, for a hint: the journal, a file, or '' (a terminal)."""
    if os.environ.get("JOURNAL_STREAM") or os.environ.get("INVOCATION_ID"):
        return "journalctl -u loractld (add --user for a user unit)"
    try:
        target = os.readlink("/proc/self/fd/2")
    except OSError:
        return ""
    return target if target.startswith("/") and os.path.isfile(target) else ""
