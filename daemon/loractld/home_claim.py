"""Claiming a home and a socket path before a daemon touches either.

Invariants: the home lock is taken before anything in the home is read or written and is held
until the process exits (the kernel drops it however the process ends); a socket path is bound
only when no live daemon answers there (a stale file is removed, a live one refused).
"""

from __future__ import annotations

import os
import socket
from pathlib import Path

from loractl import daemon_exit, paths
from loractl.errors import LoractlError


class HomeInUse(LoractlError):
    kind = "home_in_use"
    default_hint = ("Stop the other daemon first, or give this one a home of its own (--home DIR); daemons "
                    "with their own homes share a registry through LORACTL_REGISTRY.")


LOCK_FILE = daemon_exit.LOCK_FILE   # the CLI reads its holder to tell a starting daemon (loractl/daemon_exit.py)


def lock_home(data_dir: Path, sock_path: Path) -> int:
    """Hold the home for this process: a lock on ``<home>/loractld.lock``, taken before
    anything in the home is touched (socket, recovery, GC, state.json), held until exit (the
    kernel drops it with the process, however it ends). The file names the holder's pid and
    socket, for the refusal a second daemon gets. Returns the open descriptor.

    A POSIX record lock (``lockf``), not ``flock``: an ``flock`` belongs to the open file, which
    vLLM's forked engine processes would share, so an orphaned engine of a SIGKILLed daemon
    would hold the home against the restart that is to clear it (engine/pidfile.py)."""
    import fcntl
    import json

    data_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        try:
            holder = json.loads(os.pread(fd, 4096, 0) or b"{}")
        except ValueError:
            holder = {}
        os.close(fd)
        raise HomeInUse(f"another loractld (pid {holder.get('pid', '?')}, socket {holder.get('socket', '?')}) "
                        f"already serves {data_dir}") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, json.dumps({"pid": os.getpid(), "socket": str(sock_path)}).encode(), 0)
    return fd


class SocketInUse(LoractlError):
    kind = "socket_in_use"
    default_hint = "Stop the other daemon (loractl status shows its pid), or pass another --socket."


def claim_socket_path(path: Path) -> None:
    """Make ``path`` free to bind: refuse if a live daemon answers there, remove a stale file."""
    if len(os.fsencode(path)) > paths.MAX_SOCKET_PATH:
        raise LoractlError(f"socket path is longer than {paths.MAX_SOCKET_PATH} bytes: {path}",
                           "Use a shorter --socket or --home.")
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if not path.exists() and not path.is_symlink():
        return
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(str(path))
    except (ConnectionRefusedError, FileNotFoundError):
        path.unlink(missing_ok=True)  # stale: its daemon is gone
        return
    except OSError as e:
        raise LoractlError(f"cannot use socket path {path}: {e}") from e
    finally:
        probe.close()
    raise SocketInUse(f"another daemon is already listening on {path}")
