"""A file-based service registry: who is serving what, on this machine.

Layout: ``<root>/<namespace>/<component>/<instance_id>.json`` plus a sibling ``.lock``.

Invariants:

* **Atomic writes.** Every write of an instance file goes to a dot-prefixed temp file in the
  same folder, is flushed and fsynced, then ``os.replace``-d over the real name, and the folder
  is fsynced. Readers therefore see the old or the new document, never a torn one; dot-files and
  anything unparsable are ignored all the same.
* **Liveness = held lock + fresh heartbeat.** The registering process holds an exclusive
  ``flock`` on the ``.lock`` file for the handle's whole life, and a daemon thread rewrites the
  ``heartbeat`` every ``heartbeat_s``. An instance is listed only while its lock is held *and*
  its heartbeat is younger than ``stale_after_s`` (a hung-but-alive process drops out).
* **No cleanup needed.** A SIGKILLed process's flock is released by the kernel, so its entry
  reads as gone at once, with nobody removing anything. Readers may delete the files of an
  instance whose lock they can take themselves; a merely stale heartbeat is never deleted.

flock is only trustworthy on a local filesystem: keep ``root`` off NFS. A child forked
*without* exec shares the lock's open file, so it keeps the lock held after the parent dies;
the heartbeat (which lives in a thread of the parent) still goes stale, which is why both exist.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import re
import secrets
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from loractl import paths

log = logging.getLogger(__name__)

_NAME = re.compile(r"[a-z0-9][a-z0-9._-]{0,127}\Z")
_STATUSES = ("ready", "not_ready")
# The entries' layout; an entry without "format" is format 1. A newer one is skipped by readers.
REGISTRY_FORMAT = 1
# How long register_instance retries a busy lock: a reader's probe holds it for microseconds.
_ACQUIRE_TIMEOUT_S = 0.5


def _check_name(kind: str, value: str) -> str:
    # Names become path components: this is what keeps "..", "/" and the like out of root.
    if not isinstance(value, str) or not _NAME.match(value):
        raise ValueError(f"invalid {kind} {value!r}: must match [a-z0-9][a-z0-9._-]* (at most 128 chars)")
    return value


def _default_root(home: str | None) -> Path:
    """``$LORACTL_REGISTRY``, else the layout's: daemons with homes of their own (one daemon per
    home, one per GPU) share a registry by naming the same folder here."""
    shared = os.environ.get("LORACTL_REGISTRY")
    if shared:
        return Path(shared).expanduser().absolute()
    return paths.layout(home).runtime_dir / "registry"


def _default_instance_id() -> str:
    host = re.sub(r"[^a-z0-9._-]", "-", socket.gethostname().lower()).lstrip("._-")[:64] or "host"
    return f"{host}-{os.getpid()}-{secrets.token_hex(3)}"


def _fsync_dir(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_atomic(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_dir(path.parent)


def _same_file(fd: int, path: Path) -> bool:
    # A lock on an inode that is no longer at `path` protects nothing (someone unlinked it).
    try:
        st, cur = os.fstat(fd), os.stat(path)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == (cur.st_dev, cur.st_ino)


@dataclass(frozen=True)
class Instance:
    """One live registered instance, as read from its file."""

    namespace: str
    component: str
    instance_id: str
    status: str
    heartbeat: float
    pid: int
    host: str
    path: Path
    started: float = 0.0
    # Kept as JSON text so the dataclass stays hashable and callers can't mutate shared state.
    metadata_json: str = field(default="{}", repr=False)

    def metadata(self) -> dict:
        """The metadata dict as last written (a fresh copy each call)."""
        return json.loads(self.metadata_json)


@dataclass(frozen=True)
class WatchEvent:
    kind: str  # "added" | "removed"
    instance: Instance


class InstanceHandle:
    """The registering side of one instance; holds its lock until :meth:`close`."""

    def __init__(self, folder: Path, namespace: str, component: str, instance_id: str,
                 lock_fd: int, heartbeat_s: float, metadata: dict) -> None:
        self._json = folder / f"{instance_id}.json"
        self._lock_path = folder / f"{instance_id}.lock"
        self._lock_fd: int | None = lock_fd
        self._doc = {"format": REGISTRY_FORMAT, "namespace": namespace, "component": component, "instance_id": instance_id,
                     "pid": os.getpid(), "host": socket.gethostname(), "status": "not_ready",
                     "heartbeat": time.time(), "started": time.time(), "metadata": metadata}
        # The heartbeat thread and set_* both write the file; one writer at a time.
        self._mu = threading.Lock()
        self._stop = threading.Event()
        self._write()
        self._thread = threading.Thread(target=self._beat, args=(heartbeat_s,),
                                        name=f"registry-heartbeat-{instance_id}", daemon=True)
        self._thread.start()

    def instance_id(self) -> str:
        return self._doc["instance_id"]

    def set_metadata(self, metadata: dict) -> None:
        """Replace the metadata (must be JSON-serialisable); also refreshes the heartbeat."""
        copy = json.loads(json.dumps(metadata))  # fails here, not in the heartbeat thread
        if not isinstance(copy, dict):
            raise TypeError("metadata must be a dict")
        self._write(metadata=copy)

    def set_ready(self, status: bool | str) -> None:
        """``True``/``"ready"`` or ``False``/``"not_ready"``; also refreshes the heartbeat."""
        if isinstance(status, bool):
            status = "ready" if status else "not_ready"
        if status not in _STATUSES:
            raise ValueError(f"status must be one of {_STATUSES}, not {status!r}")
        self._write(status=status)

    def close(self) -> None:
        """Stop the heartbeat, delete the json, then delete and release the lock. Idempotent."""
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join()
        with self._mu:
            if self._lock_fd is None:
                return
            if os.getpid() != self._doc["pid"]:  # a forked child: the files are the parent's
                os.close(self._lock_fd)
                self._lock_fd = None
                return
            # json before lock, and both while still holding it: a reader that later takes the
            # lock can never mistake a half-closed instance for a live one.
            self._json.unlink(missing_ok=True)
            self._lock_path.unlink(missing_ok=True)
            os.close(self._lock_fd)  # releases the flock
            self._lock_fd = None

    def __enter__(self) -> InstanceHandle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _write(self, **changes: object) -> None:
        with self._mu:
            if self._lock_fd is None:
                return  # closed: a late heartbeat must not resurrect the file
            self._doc.update(changes, heartbeat=time.time())
            _write_atomic(self._json, json.dumps(self._doc, sort_keys=True).encode())

    def _beat(self, every: float) -> None:
        while not self._stop.wait(every):
            try:
                self._write()
            except OSError as e:  # a full disk now must not kill the thread for good
                log.warning("registry heartbeat for %s failed: %s", self._json, e)


class ServiceRegistry:
    def __init__(self, root: Path | None = None, *, home: str | None = None,
                 heartbeat_s: float = 2.0, stale_after_s: float = 10.0) -> None:
        self.root = Path(root) if root is not None else _default_root(home)
        self.heartbeat_s = heartbeat_s
        self.stale_after_s = stale_after_s  # informational: discovery applies its own

    def register_instance(self, namespace: str, component: str, *, instance_id: str | None = None,
                          metadata: dict | None = None) -> InstanceHandle:
        """Create the instance's file, take its lock, start its heartbeat (status "not_ready").

        Raises FileExistsError if a live process already holds ``instance_id``.
        """
        _check_name("namespace", namespace)
        _check_name("component", component)
        if instance_id is None:
            instance_id = _default_instance_id()
        _check_name("instance id", instance_id)
        meta = json.loads(json.dumps(metadata or {}))
        folder = self.root / namespace / component
        folder.mkdir(parents=True, exist_ok=True)
        fd = _acquire(folder / f"{instance_id}.lock")
        try:
            return InstanceHandle(folder, namespace, component, instance_id, fd, self.heartbeat_s, meta)
        except BaseException:
            os.close(fd)
            raise


def _acquire(lock_path: Path) -> int:
    deadline = time.monotonic() + _ACQUIRE_TIMEOUT_S
    while True:
        fd = os.open(lock_path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            # Held by a live twin, or briefly by a reader's probe: retry a little.
            os.close(fd)
            if time.monotonic() > deadline:
                raise FileExistsError(f"{lock_path.stem!r} is registered by a live process") from None
            time.sleep(0.01)
            continue
        if _same_file(fd, lock_path):
            return fd
        os.close(fd)  # a reader deleted the file we opened: lock the new one


class ServiceDiscovery:
    def __init__(self, root: Path | None = None, *, home: str | None = None,
                 stale_after_s: float = 10.0) -> None:
        self.root = Path(root) if root is not None else _default_root(home)
        self.stale_after_s = stale_after_s

    def list_instances(self, namespace: str, component: str) -> list[Instance]:
        """The live instances (lock held, heartbeat fresh), oldest first.

        Files of dead instances (lock free) are deleted on the way, if permissions allow.
        """
        folder = self.root / _check_name("namespace", namespace) / _check_name("component", component)
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            return []
        now, live = time.time(), []
        stems = {n.rsplit(".", 1)[0] for n in names if n.endswith((".json", ".lock")) and not n.startswith(".")}
        for stem in sorted(stems):
            if not _NAME.match(stem):
                continue
            lock = folder / f"{stem}.lock"
            if not _lock_held(lock):
                _remove_dead(folder, stem)
                continue
            inst = _read(folder / f"{stem}.json", namespace, component, stem)
            if inst is not None and now - inst.heartbeat < self.stale_after_s:
                live.append(inst)
        return sorted(live, key=lambda i: (i.started, i.instance_id))

    def distrust(self, instance: Instance) -> str | None:
        """Why ``instance``'s entry must not be believed, or None when it may be.

        An entry names a socket that clients connect to and send their HF_TOKEN through: it is
        believed only when its file and every folder from it up to this registry's root are
        owned by this user or root and writable by no one else (an attacker who can write
        there could point a client at a socket of theirs)."""
        trusted_owners = (0, os.getuid())
        path = instance.path
        while True:
            try:
                st = os.lstat(path)
            except OSError as e:
                return f"cannot check {path}: {e.strerror or e}"
            if st.st_uid not in trusted_owners:
                return f"{path} is owned by uid {st.st_uid}"
            if st.st_mode & 0o022:
                return f"{path} is writable by others (mode {st.st_mode & 0o7777:04o})"
            if path == self.root or path.parent == path:
                return None
            path = path.parent

    def watch(self, namespace: str, component: str, *, poll_s: float = 0.2,
              stop: threading.Event | None = None) -> Iterator[WatchEvent]:
        """Yield "added"/"removed" as the live set changes, the initial set first as "added".

        Polls every ``poll_s``; runs until the consumer stops iterating or ``stop`` is set.
        """
        known: dict[str, Instance] = {}
        stop = stop or threading.Event()
        while not stop.is_set():
            events, known = self._diff(namespace, component, known)
            yield from events
            stop.wait(poll_s)

    def _diff(self, namespace: str, component: str,
              known: dict[str, Instance]) -> tuple[list[WatchEvent], dict[str, Instance]]:
        # Membership only: a metadata or status change of a live instance is not an event.
        now = {i.instance_id: i for i in self.list_instances(namespace, component)}
        events = [WatchEvent("removed", i) for k, i in known.items() if k not in now]
        events += [WatchEvent("added", i) for k, i in now.items() if k not in known]
        return events, now


def _lock_held(lock: Path) -> bool:
    # A shared probe: concurrent readers don't collide with each other, only with a holder.
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return False  # holders create the lock before the json, and delete it after
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)  # also releases the probe's lock
    return False


def _remove_dead(folder: Path, stem: str) -> None:
    lock = folder / f"{stem}.lock"
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return  # json without lock: leave it, a new holder may be creating the lock right now
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return  # revived, or another reader is probing: not ours to delete
        if not _same_file(fd, lock):
            return
        # json (and a crashed writer's temp files) first, the lock last, all while holding it:
        # a new holder of this id can only write its json after it locks the *new* lock file.
        for p in [folder / f"{stem}.json", *folder.glob(f".{stem}.json.*.tmp"), lock]:
            with contextlib.suppress(OSError):  # a read-only reader just leaves them
                p.unlink()
    finally:
        os.close(fd)


def _read(path: Path, namespace: str, component: str, instance_id: str) -> Instance | None:
    try:
        doc = json.loads(path.read_bytes())
        if doc["instance_id"] != instance_id or not isinstance(doc["metadata"], dict):
            return None
        if int(doc.get("format", 1)) > REGISTRY_FORMAT:
            return None  # a newer release's entry: not misread, not deleted (its writer is alive)
        return Instance(namespace=namespace, component=component, instance_id=instance_id,
                        status=str(doc["status"]), heartbeat=float(doc["heartbeat"]), pid=int(doc["pid"]),
                        host=str(doc["host"]), path=path, started=float(doc.get("started", 0.0)),
                        metadata_json=json.dumps(doc["metadata"], sort_keys=True))
    except (OSError, ValueError, KeyError, TypeError):
        return None  # missing, half-written by a non-atomic writer, or not ours: not an instance
