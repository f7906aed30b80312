"""Preflight: the engine's own loader has the final word on an adapter, before any step sees it.

loractl's validation (``store.validate``) gives the fast, friendly reasons from headers and
config; but only vLLM's loader knows everything it will refuse for this engine's exact model
and LoRA config (expected modules, weights mapper, rank limit, vocabulary, buffer shapes), and
a refusal inside a step ends the engine for every client. So each adapter content is loaded
once by the worker's own loader and discarded (``Engine.preflight``): at ``pull`` before the
install is reported done, and at the first use of a folder or hand-placed adapter, or of a
pulled one that arrived while the engine was starting.

Invariants:
- Keyed by content digest: one preflight per content for the engine's life, whatever its
  names or paths; concurrent first uses of one content share one run.
- A refusal is remembered (``refusal``) and repeated without asking the engine again; so is
  a failure of the engine to load the content inside a step (``Engine.broken``), which the
  worker survives (see worker_ext._guarded_load).
- With no engine attached yet, or the engine asleep (``--keep-alive``), ``check`` passes without
  recording anything: the first use after the engine is up checks.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loractl.errors import AdapterNotFound, InvalidAdapter
from loractld.engine.broken import broken_adapter

if TYPE_CHECKING:
    from loractld.engine.client import Engine

_log = logging.getLogger("loractld.preflight")
_ID_MASK = (1 << 31) - 1


class Preflight:
    def __init__(self) -> None:
        self.engine: Engine | None = None
        self._passed: set[str] = set()
        self._refused: dict[str, InvalidAdapter] = {}
        self._running: dict[str, asyncio.Future] = {}

    @property
    def running(self) -> int:
        """Preflights in flight now (the engine must not fall asleep under them: keep_alive)."""
        return len(self._running)

    def attach(self, engine: Engine) -> None:
        self.engine = engine

    def refusal(self, digest: str, engine_id: int | None = None, label: str = "") -> InvalidAdapter | None:
        """Why the engine refused this content, if it did (at preflight, or in a step)."""
        if digest not in self._refused and self.engine is not None and engine_id in self.engine.broken:
            self._refused[digest] = broken_adapter(label or digest[:12], self.engine.broken[engine_id])
        return self._refused.get(digest)

    async def check(self, path: Path, digest: str, label: str, engine_id: int | None = None) -> None:
        """Raise :class:`InvalidAdapter` if the engine's loader refuses the adapter at ``path``,
        or failed to load it in a step (``engine_id``: its id in the engine)."""
        if self.refusal(digest, engine_id, label) is not None:
            raise self._refused[digest]
        if digest in self._passed:
            return
        if self.engine is None or getattr(self.engine, "asleep", False):
            return   # no engine yet, or asleep (--keep-alive): the first use once it is up checks
        running = self._running.get(digest)
        if running is None:
            running = asyncio.ensure_future(self._run(self.engine, path, digest, label))
            self._running[digest] = running
            running.add_done_callback(lambda _: self._running.pop(digest, None))
        await asyncio.shield(running)

    async def _run(self, engine: Engine, path: Path, digest: str, label: str) -> None:
        began = time.perf_counter()
        reason = await engine.preflight(f"preflight:{label}@{digest[:16]}", int(digest[:8], 16) & _ID_MASK or 1,
                                        str(path))
        elapsed_ms = (time.perf_counter() - began) * 1000
        _log.info("preflight %s (%s): %s in %.1f ms", label, digest[:12], "refused" if reason else "ok", elapsed_ms)
        if reason is None:
            self._passed.add(digest)
            return
        if not Path(path, "adapter_config.json").exists():
            # The folder went (an rm, a new revision) while the engine looked: that says nothing
            # of the content, so nothing is remembered against its digest.
            raise AdapterNotFound(f"adapter {label!r} left the store while it was being checked",
                                  "It was removed or replaced meanwhile: loractl ls shows what is there now.")
        error = InvalidAdapter(
            f"vLLM {engine.vllm_version} cannot load this adapter for {Path(engine.settings.model).name}: {reason}",
            "The engine's own loader refused it (loractl's checks passed): fix the adapter or use one made "
            "for this model; loractld(8), ADAPTERS, lists what is served and refused.")
        self._refused[digest] = error
        raise error
