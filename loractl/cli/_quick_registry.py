"""The daemon ``loractl.Client`` would pick from the service registry, found without importing
``loractl.registry`` (its asyncio and threading imports cost as much as a whole ``loractl ls``).

Only the plain case is answered: no ``--instance`` / ``$LORACTL_INSTANCE``, exactly one ready
instance, a registry folder and entry owned by this user and writable by nobody else. Anything
else (no daemon, several, a folder someone else could write into) returns None and the command
goes the full way (``Client._discover`` and its checks), which reports it exactly as always.

Liveness is read as ``loractl.registry`` reads it: the instance's lock held (a shared, non-blocking
probe) and its heartbeat younger than ``STALE_AFTER_S``; a dead entry is skipped, not deleted.
"""

from __future__ import annotations

import fcntl
import json
import os
import time

STALE_AFTER_S = 10.0   # ServiceDiscovery's default
_FOLDER = ("registry", "loractl", "loractld")


def discovered_socket(home: str | None) -> str | None:
    """The socket of the only ready daemon in the registry, or None: see the module."""
    if os.environ.get("LORACTL_INSTANCE"):
        return None
    folder = os.path.join(_runtime_dir(home), *_FOLDER)
    try:
        names = os.listdir(folder)
    except OSError:
        return None
    if not _own_and_closed(folder):
        return None
    ready = []
    for name in names:
        stem = name[:-len(".json")]
        if name.startswith(".") or not name.endswith(".json") or not _locked(os.path.join(folder, stem + ".lock")):
            continue
        entry = os.path.join(folder, name)
        if not _own_and_closed(entry):
            return None
        try:
            with open(entry, "rb") as f:
                doc = json.loads(f.read())
            fresh = time.time() - float(doc["heartbeat"]) < STALE_AFTER_S
        except (OSError, ValueError, KeyError, TypeError):
            continue
        if doc.get("instance_id") == stem and doc.get("status") == "ready" and fresh:
            ready.append(doc)
    if len(ready) != 1:
        return None
    socket = (ready[0].get("metadata") or {}).get("socket")
    return socket if isinstance(socket, str) and socket else None


def _runtime_dir(home: str | None) -> str:
    """``paths.layout(home).runtime_dir``; with a home, without importing ``loractl.paths``
    (pathlib, dataclasses: a tenth of a fast command)."""
    home = home or os.environ.get("LORACTL_HOME")
    if home:  # Path(home).expanduser().absolute(): ".." left to the kernel, as explicit_socket does
        home = os.path.expanduser(home)
        return home if os.path.isabs(home) else os.path.join(os.getcwd(), home)
    from loractl import paths

    return str(paths.layout().runtime_dir)


def _own_and_closed(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return st.st_uid == os.getuid() and not st.st_mode & 0o022


def _locked(lock: str) -> bool:
    """Whether the registering daemon still holds its lock (the kernel drops it when it dies)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
