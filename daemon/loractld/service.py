"""The gRPC servicer: thin. It maps RPCs to the engine and domain errors to status codes.

Invariants:
- Every domain error leaves as a gRPC status whose message carries kind, message and hint
  (``loractl.errors.to_wire``); anything else is logged with its traceback and leaves as
  INTERNAL with a one-line message, never as a bare traceback.
- While draining (shutdown), new generations are refused; generations still running when
  the grace period ends are cancelled with a CANCELLED status, never left hanging.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import time
from typing import TYPE_CHECKING

from grpclib.exceptions import GRPCError

from loractl import __version__
from loractl.errors import AdapterNotFound, Cancelled, EngineUnavailable, InvalidRequest, LoractlError, to_wire
from loractl.v1 import loractl_pb2 as pb
from loractl.v1.loractl_grpc import LoractlBase

if TYPE_CHECKING:
    from loractld.adapters import AdapterRef, AdapterResolver
    from loractld.engine import Engine

_log = logging.getLogger("loractld.service")
ROLES = ("system", "user", "assistant")


def domain_errors(handler):
    """Turn domain errors raised by a handler into gRPC statuses the client can rebuild."""

    @functools.wraps(handler)
    async def wrapper(self, stream):
        try:
            await handler(self, stream)
        except LoractlError as e:
            raise GRPCError(e.grpc_status, to_wire(e)) from e
        except (GRPCError, asyncio.CancelledError):
            raise
        except Exception as e:
            _log.exception("unexpected error in %s", handler.__name__)
            error = LoractlError(f"internal error in {handler.__name__}: {type(e).__name__}: {e}")
            raise GRPCError(error.grpc_status, to_wire(error)) from e

    return wrapper


class LoractlService(LoractlBase):
    def __init__(self, *, socket_path: str, home: str, resolver: AdapterResolver) -> None:
        self.socket_path = socket_path
        self.home = home
        self.resolver = resolver
        self.engine: Engine | None = None
        self.engine_ready = asyncio.Event()
        self.engine_failed: LoractlError | None = None
        self.started = time.monotonic()
        self.draining = False
        self._inflight: set[asyncio.Task] = set()

    # -- lifecycle, driven by loractld.server ------------------------------------------
    def set_engine(self, engine: Engine) -> None:
        self.engine = engine
        self.engine_ready.set()

    def set_engine_failed(self, error: LoractlError) -> None:
        self.engine_failed = error
        self.engine_ready.set()

    async def drain(self, grace_seconds: float) -> int:
        """Refuse new generations, wait up to ``grace_seconds``, cancel the rest; return how many."""
        self.draining = True
        if self._inflight:
            await asyncio.wait(set(self._inflight), timeout=grace_seconds)
        leftover = [t for t in self._inflight if not t.done()]
        for task in leftover:
            task.cancel()
        if leftover:
            await asyncio.wait(leftover, timeout=5)
        return len(leftover)

    async def _wait_engine(self) -> Engine:
        if self.draining:
            raise EngineUnavailable("the daemon is shutting down", "Start it again, then retry.")
        await self.engine_ready.wait()
        if self.engine_failed is not None:
            raise self.engine_failed
        assert self.engine is not None
        return self.engine

    def _resolve_adapter(self, lora: str) -> AdapterRef | None:
        if not lora:
            return None
        if os.path.isabs(lora):
            return self.resolver.resolve_path(lora)
        raise AdapterNotFound(
            f"unknown adapter {lora!r}",
            "Pass an adapter folder's path (named adapters arrive with `loractl pull`).",
        )

    # -- RPCs --------------------------------------------------------------------------
    @domain_errors
    async def Status(self, stream) -> None:
        await stream.recv_message()
        engine = self.engine
        config = pb.EngineConfig()
        if engine is not None:
            s = engine.settings
            config = pb.EngineConfig(
                model=s.model, device=engine.device, dtype=engine.dtype, max_loras=s.max_loras,
                max_cpu_loras=s.max_cpu_loras, max_lora_rank=s.max_lora_rank, max_model_len=s.max_model_len,
                vllm_version=engine.vllm_version,
            )
        await stream.send_message(pb.StatusReply(
            version=__version__,
            pid=os.getpid(),
            socket=self.socket_path,
            home=self.home,
            ready=engine is not None and not self.draining and not engine.errored,
            uptime_s=time.monotonic() - self.started,
            engine_start_s=engine.start_seconds if engine else 0.0,
            engine=config,
            requests_in_flight=len(self._inflight),
        ))

    @domain_errors
    async def Generate(self, stream) -> None:
        request: pb.GenerateRequest = await stream.recv_message()
        task = asyncio.current_task()
        assert task is not None
        engine = await self._wait_engine()
        self._inflight.add(task)
        try:
            await self._generate(engine, request, stream)
        except asyncio.CancelledError:
            if not self.draining:
                raise  # the client went away: vLLM aborts the request as the generator closes
            error = Cancelled("the daemon is shutting down; the generation was stopped",
                              "Start the daemon again and rerun the request.")
            await stream.send_trailing_metadata(status=error.grpc_status, status_message=to_wire(error))
        finally:
            self._inflight.discard(task)

    async def _generate(self, engine: Engine, request: pb.GenerateRequest, stream) -> None:
        from loractld.engine import Sampling

        if bool(request.prompt) == bool(request.messages):
            raise InvalidRequest("send exactly one of prompt or messages")
        for m in request.messages:
            if m.role not in ROLES:
                raise InvalidRequest(f"unknown chat role {m.role!r}", f"Use one of: {', '.join(ROLES)}.")
        adapter = self._resolve_adapter(request.lora)
        sampling = _sampling_from(request.sampling, Sampling())
        if request.messages:
            prompt_ids = engine.render_chat([{"role": m.role, "content": m.content} for m in request.messages])
        else:
            prompt_ids = engine.encode(request.prompt)
        produced = 0
        async for delta in engine.generate(prompt_ids, sampling, adapter):
            produced += len(delta.token_ids)
            reply = pb.GenerateReply(text=delta.text, token_ids=delta.token_ids)
            if delta.prompt_token_ids is not None:
                reply.prompt_token_ids.extend(delta.prompt_token_ids)
                reply.adapter = adapter.engine_name if adapter else ""
            if delta.finish_reason:
                reply.finish_reason = delta.finish_reason
                reply.usage.prompt_tokens = len(prompt_ids)
                reply.usage.completion_tokens = produced
            await stream.send_message(reply)


def _sampling_from(params: pb.SamplingParams, defaults):
    """Proto sampling params over defaults; unset optional fields keep the default."""
    for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "seed"):
        if params.HasField(name):
            setattr(defaults, name, getattr(params, name))
    defaults.stop = list(params.stop)
    if defaults.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {defaults.max_tokens}")
    if defaults.min_tokens < 0 or defaults.min_tokens > defaults.max_tokens:
        raise InvalidRequest(f"min_tokens must be between 0 and max_tokens, got {defaults.min_tokens}")
    if defaults.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {defaults.temperature}")
    if not 0 < defaults.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {defaults.top_p}")
    return defaults
