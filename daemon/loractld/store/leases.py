"""Leases: which installed adapter folders requests and installs still need, for the store's GC.

vLLM reloads an evicted adapter from its folder mid-request, and a missing folder kills the
engine core. So a folder a request resolved must outlive every ``rm`` and replacing pull until
the request ends, and a pull's freshly renamed object must outlive a GC until its name's link
is swapped. The store (``loractld.store.disk.Store``) owns both and its GC under one lock:

- a lease is taken where a request resolves its adapter, and released however it ends:
  explicitly, or when the last object holding it is dropped (a request prepared and never
  run);
- an install marks its object in flight from before its rename until after its link swap;
- GC, under the same lock, deletes only folders that no name, no lease and no install holds.
"""

from __future__ import annotations

import collections
import threading
import weakref
from collections.abc import Callable
from pathlib import Path

from loractl.errors import AdapterNotFound


class Lease:
    """One holder's claim on an adapter folder. ``release`` is idempotent; a lease dropped
    without it is released when garbage-collected, so no path can leak one for good."""

    def __init__(self, leases: Leases, path: str) -> None:
        self.path = path
        self._leases = leases
        self._finalizer = weakref.finalize(self, leases._drop, path)

    def share(self) -> Lease:
        """Another lease on the same folder, for another holder. Raises AdapterNotFound if the
        folder went meanwhile (this lease was released, and a GC deleted the folder)."""
        lease = self._leases.take(self.path)
        if not self._finalizer.alive and not Path(self.path).is_dir():
            lease.release()
            raise AdapterNotFound(f"the adapter at {self.path} was removed meanwhile", "Retry the request.")
        return lease

    def release(self) -> None:
        self._finalizer()

    @property
    def held(self) -> bool:
        return self._finalizer.alive


class Leases:
    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._counts: collections.Counter[str] = collections.Counter()
        self.installing: set[str] = set()
        # Called (outside the lock) with a folder whose last lease just went; the store uses it
        # to delete a folder no name holds any more.
        self.on_idle: Callable[[str], None] | None = None

    def take(self, path: str | Path) -> Lease:
        with self._lock:
            self._counts[str(path)] += 1
            return Lease(self, str(path))

    def _drop(self, path: str) -> None:
        with self._lock:
            self._counts[path] -= 1
            idle = self._counts[path] <= 0
            if idle:
                del self._counts[path]
        if idle and self.on_idle is not None:
            self.on_idle(path)

    def held(self, path: str | Path) -> int:
        """How many leases hold ``path`` now."""
        with self._lock:
            return self._counts.get(str(path), 0)

    def kept(self) -> set[str]:
        """Every folder a lease or an install in flight holds; call under the store's lock."""
        return {p for p, n in self._counts.items() if n > 0} | self.installing
