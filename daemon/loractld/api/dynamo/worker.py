"""The Dynamo worker: registration, the cards kept in step with the store, the request handler.

Invariants:
- The frontend sees a LoRA card for exactly the adapters in the store, and the profiles whose
  prompt it renders as every other door does (``_unrendered_parts``), while the worker is up:
  the cards are published from the store's listing at start, then follow the core's events
  (DOWNLOADED_TO_DISK publishes, DELETED_FROM_DISK withdraws), subscribed before the listing
  so that no pull or rm in between is missed. Card changes are serialized by one lock.
- Every request passes through ``Core.prepare`` and ``Core.run``: the same checks, admission
  gate and engine as the gRPC and HTTP doors, so the same tokens come out.
- A request the frontend stops (client gone, stop_generating) is aborted in the engine at once,
  even while it waits in the admission gate, and ends with ``finish_reason: "cancelled"``.
- A request for ``n`` > 1 choices is prepared once and run as ``n`` generations (each through
  the gate, choice i seeded seed + i as vLLM does), their chunks told apart by ``index``; one
  choice's failure or the request's stop closes them all.
- On shutdown the cards and the base model's registration are withdrawn before running work is
  drained, so the frontend stops routing here first; the runtime is shut down last.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from loractl.errors import LoractlError
from loractld.api.dynamo import protocol
from loractld.api.dynamo.loras import LoraManagement
from loractld.api.dynamo.settings import DynamoSettings
from loractld.events import Event

if TYPE_CHECKING:
    from loractld.core import Core, Delta, Prepared

_log = logging.getLogger("loractld.dynamo")


class RuntimeMissing(LoractlError):
    kind = "invalid_request"
    default_hint = "Install the extra: pip install 'loractl[dynamo]' (the ai-dynamo-runtime wheel)."


async def join(core: Core, settings: DynamoSettings) -> DynamoWorker | None:
    """Join the fleet when ``--dynamo`` is on (the engine must be ready); None otherwise."""
    if not settings.enabled:
        return None
    worker = DynamoWorker(core, settings)
    await worker.start()
    return worker


class DynamoWorker:
    def __init__(self, core: Core, settings: DynamoSettings) -> None:
        self.core = core
        self.settings = settings
        self.loras = LoraManagement(self)
        self._cards: set[str] = set()
        self._cards_lock = asyncio.Lock()
        self._serving: list[asyncio.Future] = []
        self._follower: asyncio.Task | None = None
        self._registered_base = False

    async def start(self) -> None:
        try:
            from dynamo import llm
            from dynamo.llm import exceptions
            from dynamo.runtime import DistributedRuntime
        except ImportError as e:
            raise RuntimeMissing(f"--dynamo needs the Dynamo runtime, which is not installed ({e})") from e
        self._llm, self._exceptions = llm, exceptions
        status = await self.core.status()
        self.model_path, self.max_loras = status.engine.model, status.engine.max_loras
        self._limits = (status.engine.max_model_len, status.engine.max_num_seqs)
        os.environ["DYN_SYSTEM_HOST"] = self.settings.system_host  # read by the runtime as it starts
        try:
            self.runtime = DistributedRuntime(asyncio.get_running_loop(), self.settings.discovery, "tcp")
        except Exception as e:  # the runtime's own errors (etcd unreachable, no DYN_FILE_KV) are plain Exceptions
            raise LoractlError(f"cannot join Dynamo through {self.settings.discovery} discovery: {e}",
                               "Check ETCD_ENDPOINTS (etcd), DYN_FILE_KV (file) or the pod's service account "
                               "(kubernetes), and the DYN_* variables it names.") from e
        self.endpoint = self.runtime.endpoint(self.settings.generate_path)
        self._types = llm.ModelType.Chat | llm.ModelType.Completions
        events = self.core.events.subscribe()
        try:
            await llm.register_model(llm.ModelInput.Tokens, self._types, self.endpoint, self.model_path,
                                     self.core.served_model_name, worker_type=llm.WorkerType.Aggregated,
                                     runtime_config=self._runtime_config())
            self._registered_base = True
            for name in sorted(await self.stored_names()):
                await self.publish(name)
        except BaseException:
            self.core.events.unsubscribe(events)
            raise
        self._follower = asyncio.create_task(self._follow(events))
        for endpoint, handler in ((self.endpoint, self.generate), ("load_lora", self.loras.load),
                                  ("list_loras", self.loras.list), ("unload_lora", self.loras.unload)):
            if isinstance(endpoint, str):
                endpoint = self.runtime.endpoint(self.settings.path(endpoint))
            self._serving.append(asyncio.ensure_future(endpoint.serve_endpoint(handler, graceful_shutdown=True)))
        self.runtime.set_health_status(True)  # the system port's /health: ready
        _log.info("joined Dynamo (%s discovery) as %s instance %d: base model %s, %d LoRA card(s)",
                  self.settings.discovery, self.settings.generate_path, self.endpoint.connection_id(),
                  self.core.served_model_name, len(self._cards))

    # -- cards ----------------------------------------------------------------------------
    def _runtime_config(self):
        """The engine's limits in force (the context may be lowered to fit the KV cache), so the
        frontend reports and checks those, not the model config's."""
        config = self._llm.ModelRuntimeConfig()
        config.context_length, config.max_num_seqs = self._limits
        return config

    async def stored_names(self) -> set[str]:
        """The store's adapters and profiles: each a model the frontend may route to."""
        return {a.name for a in await self.core.list_adapters()} | {p.name for p in await self.core.list_profiles()}

    def _unrendered_parts(self, name: str) -> list[str]:
        """What of profile ``name`` the frontend's prompt would lack: Dynamo's frontend renders a
        LoRA card's requests with the base model's template (1.6.1 takes no card's own template,
        tried with ``custom_template_path``), so a profile's SYSTEM, MESSAGE and TEMPLATE lines
        cannot reach it. Empty for an adapter, or a profile of an adapter and parameters."""
        profile = self.core.profile_of(name)
        if profile is None:
            return []
        return [line for line, present in (("SYSTEM", profile.system is not None), ("MESSAGE", bool(profile.messages)),
                                           ("TEMPLATE", profile.template is not None)) if present]

    def lora_id(self, name: str) -> int:
        return self._llm.lora_name_to_id(name)

    async def publish(self, name: str) -> None:
        llm = self._llm
        async with self._cards_lock:
            unrendered = self._unrendered_parts(name)
            if unrendered:
                # Never a card that answers without the profile's prompt: withdrawn if it had one
                # (made again with a system prompt). Requests naming it with their own prompt ids
                # (routing.lora_name) are still served, with its adapter and parameters.
                if name in self._cards:
                    await llm.unregister_model(self.endpoint, lora_name=name)
                    self._cards.discard(name)
                _log.warning("dynamo: profile %s gets no card: Dynamo's frontend renders a LoRA model's prompt with "
                             "the base model's template, without the profile's %s; a profile of an adapter and "
                             "parameters only is published", name, ", ".join(unrendered))
                return
            if name in self._cards:
                return
            # As Dynamo's own vLLM worker registers a card: no model_name (with one, 1.6.1 refused
            # cards published after serve_endpoint started: "a different model 'BASE' is already
            # registered there"), the adapter marked in user_data.
            await llm.register_model(llm.ModelInput.Tokens, self._types, self.endpoint, self.model_path,
                                     worker_type=llm.WorkerType.Aggregated, lora_name=name,
                                     base_model_path=self.model_path, max_gpu_lora_count=self.max_loras,
                                     user_data={"lora_adapter": True, "lora_id": self.lora_id(name)},
                                     runtime_config=self._runtime_config())
            self._cards.add(name)
            _log.info("dynamo: published the LoRA card of %s", name)

    async def withdraw(self, name: str) -> None:
        async with self._cards_lock:
            if name not in self._cards:
                return
            await self._llm.unregister_model(self.endpoint, lora_name=name)
            self._cards.discard(name)
            _log.info("dynamo: withdrew the LoRA card of %s", name)

    async def _follow(self, events: asyncio.Queue) -> None:
        try:
            while True:
                event: Event = await events.get()
                try:
                    if event.kind == "DOWNLOADED_TO_DISK":
                        await self.publish(event.adapter)
                    elif event.kind == "DELETED_FROM_DISK":
                        await self.withdraw(event.adapter)
                except Exception:  # noqa: BLE001 - one card's failure must not stop the following
                    _log.exception("dynamo: could not update the card of %s", event.adapter)
        finally:
            self.core.events.unsubscribe(events)

    # -- requests -------------------------------------------------------------------------
    async def generate(self, request: dict[str, Any], context) -> AsyncIterator[dict[str, Any]]:
        try:
            lora = protocol.lora_name(request, self.core.base_model_names())
            n = protocol.choices(request)
            defaults = await self.core.sampling_defaults()
            prepared = await self.core.prepare(protocol.generation_request(request, lora, defaults))
        except LoractlError as e:
            raise protocol.raised(e, self._exceptions) from e
        choices = protocol.copies(prepared, n)
        prompt_tokens, produced, running = len(prepared.prompt_ids), 0, set(range(n))
        try:
            async for index, delta in _until_stopped(_merged(self.core, choices), context):
                produced += len(delta.token_ids)
                if delta.finish_reason:
                    running.discard(index)
                yield protocol.chunk(delta, prompt_tokens, produced, index)
        except _Stopped:
            for index in sorted(running):
                yield protocol.cancelled(prompt_tokens, produced, index)
        except LoractlError as e:
            if produced == 0:
                raise protocol.raised(e, self._exceptions) from e
            for index in sorted(running):
                yield protocol.failed(e, index)

    # -- leaving --------------------------------------------------------------------------
    async def leave(self) -> None:
        """Withdraw every card and the base model: the frontend stops routing here."""
        with contextlib.suppress(Exception):
            self.runtime.set_health_status(False)
        if self._follower is not None:
            self._follower.cancel()
            await asyncio.gather(self._follower, return_exceptions=True)
            self._follower = None
        for name in sorted(self._cards):
            with contextlib.suppress(Exception):
                await self.withdraw(name)
        if self._registered_base:
            self._registered_base = False
            try:
                await self._llm.unregister_model(self.endpoint)
            except Exception as e:  # noqa: BLE001 - leaving anyway: the lease or TTL ends it
                _log.warning("dynamo: could not unregister the base model: %s", e)
        _log.info("left Dynamo")

    async def close(self) -> None:
        await self.leave()
        self.runtime.shutdown()
        if self._serving:
            await asyncio.wait(self._serving, timeout=5)
            for served in self._serving:
                if served.done() and not served.cancelled() and served.exception() is not None:
                    _log.debug("dynamo: endpoint ended with %r", served.exception())


class _Stopped(Exception):
    """The frontend stopped the request (its client went away, or stop_generating)."""


async def _merged(core: Core, choices: list[Prepared]) -> AsyncIterator[tuple[int, Delta]]:
    """``(index, delta)`` of every choice as they come, until each has ended; the first failure
    is raised. Closing it closes every choice (an abort in the engine)."""
    if len(choices) == 1:
        async with contextlib.aclosing(core.run(choices[0])) as deltas:
            async for delta in deltas:
                yield 0, delta
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, prepared: Prepared) -> None:
        try:
            async with contextlib.aclosing(core.run(prepared)) as deltas:
                async for delta in deltas:
                    queue.put_nowait((index, delta))
            queue.put_nowait((index, None))
        except Exception as e:  # noqa: BLE001 - raised to the request by the reader below
            queue.put_nowait((index, e))

    tasks = [asyncio.create_task(pump(i, p)) for i, p in enumerate(choices)]
    try:
        for _ in range(len(choices)):
            while True:
                index, item = await queue.get()
                if item is None:
                    break
                if isinstance(item, Exception):
                    raise item
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def _until_stopped(deltas: AsyncIterator, context) -> AsyncIterator:
    """``deltas`` until they end or ``context`` is stopped or killed; then the generation is
    closed (an abort in the engine, a place freed in the gate) and :class:`_Stopped` raised."""
    stopped = asyncio.ensure_future(context.async_killed_or_stopped())
    try:
        while True:
            step = asyncio.ensure_future(anext(deltas))
            await asyncio.wait({step, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not step.done():
                step.cancel()
                await asyncio.gather(step, return_exceptions=True)
                raise _Stopped()
            try:
                delta = step.result()
            except StopAsyncIteration:
                return
            yield delta
    finally:
        stopped.cancel()
        await deltas.aclose()
