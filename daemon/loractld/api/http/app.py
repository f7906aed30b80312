"""The OpenAI-compatible HTTP app: routes, the guard in front of them, one error schema.

Routes: vLLM's own ``POST /v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages`` (Anthropic), ``/tokenize`` and ``/detokenize`` (``serving``), ``GET /v1/models[/{id}]``,
vLLM's ``POST /v1/load_lora_adapter`` and ``POST /v1/unload_lora_adapter``, ``GET /health``,
``GET /metrics`` (the same Prometheus text as ``loractl metrics``), ``GET /load``, ``GET /version``, and
FastAPI's ``/docs``.

Invariants:
- Every answer that is not a success is in the OpenAI error schema (``errors``), 404s and
  405s of unknown routes included; an unexpected exception is logged and answered 500.
- With an API key, every route but ``/health`` wants ``Authorization: Bearer KEY``, compared in
  constant time. Without one (loopback only, see ``settings``), requests must name a loopback
  host in ``Host``: a web page cannot reach the API through DNS rebinding.
- HTTP never grants more than the socket would: without a key, a call that changes state
  (anything but reads and generation, see :func:`changes_state`) is served only to a loopback
  peer whose uid the socket's rule allows (``peers``); refusals are 403s, audited. Generation
  never names a folder over HTTP (the core refuses ``allow_folders=False``).
- A body is read only up to ``max_body_bytes`` (413 past it) and must be declared JSON: a
  browser cannot send that cross-origin without a CORS preflight, which this app never grants.
  Ollama's blob uploads (raw bytes, bounded by the blobs' own limits) refuse the types a browser
  sends without a preflight (``api.ollama.create``).
"""

from __future__ import annotations

import asyncio
import hmac
import ipaddress
import logging
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from loractl import __version__
from loractl.errors import LoractlError, of_os_error
from loractld.api import ollama
from loractld.trust import audit
from loractld.api.http import models
from loractld.api.http.errors import HttpError, error_response, from_domain
from loractld.api.http.protocol import (PEER_UID, LoadLoraAdapterRequest, UnloadLoraAdapterRequest, json_body, parse,
                                        read_body)
from loractld.api.http.serving import ROUTES, Limiter, Serving
from loractld.trust.peers import may_change_state, tcp_peer_uid

if TYPE_CHECKING:
    from loractld.api.http.settings import HttpSettings
    from loractld.core import Core

_log = logging.getLogger("loractld.http")
_OPEN_PATHS = {"/health"}
GENERATION_PATHS = set(ROUTES) | ollama.ONLY_READ_OR_GENERATE   # no state changes
_OPERATIONS = {"/v1/load_lora_adapter": "load", "/v1/unload_lora_adapter": "evict", **ollama.OPERATIONS}
def build_app(core: Core, settings: HttpSettings, *, socket_gid: int | None = None):
    """The ASGI app: the FastAPI routes behind :class:`Guard`."""
    app = FastAPI(title="loractld", version=__version__, redoc_url=None,
                  description="OpenAI-compatible API of a loractl daemon: the base model and its LoRA adapters.")
    serving = Serving(core, Limiter(settings.max_concurrency), max_choices=settings.max_choices,
                      key_required=settings.api_key is not None)

    async def body_of(request: Request, model):
        return parse(await read_body(request, settings.max_body_bytes, settings.body_timeout_s), model)

    def generation_route(route: str):
        async def endpoint(request: Request) -> Response:
            body = json_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s))
            return await serving.handle(route, request, body)
        return endpoint

    for path, route in ROUTES.items():
        app.add_api_route(path, generation_route(route), methods=["POST"], name=route)

    @app.get("/v1/models")
    async def list_models() -> JSONResponse:
        return JSONResponse(await models.list_models(core))

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str) -> JSONResponse:
        return JSONResponse(await models.retrieve_model(core, model))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> Response:
        body = await body_of(request, LoadLoraAdapterRequest)
        return await models.load_adapter(core, body, principal(request))

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> Response:
        body = await body_of(request, UnloadLoraAdapterRequest)
        return await models.unload_adapter(core, body, principal(request))

    @app.get("/health")
    async def health() -> Response:
        if core.ready:
            return JSONResponse({"status": "ok"})
        if core.startup_error is not None:
            raise from_domain(core.startup_error)
        if core.draining or core.engine_died or (core.engine is not None and core.started_up):
            return error_response(503, "the daemon is shutting down or its engine died", "See the daemon's log.",
                                  code="engine_unavailable")
        return error_response(503, "the engine is starting", "Retry in a moment (loractl status --wait waits).",
                              code="engine_unavailable")

    @app.get("/load")
    async def load() -> JSONResponse:
        """vLLM's load probe (requests in the daemon), with what the engine itself holds;
        cheap: no engine round trip, unlike /metrics."""
        engine = core.engine
        return JSONResponse({"server_load": core.requests_in_flight,
                             "engine_requests": engine.unfinished_requests() if engine is not None else 0})

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(await core.metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/version")
    async def version() -> JSONResponse:
        engine = core.engine
        return JSONResponse({"version": __version__, "vllm_version": engine.vllm_version if engine else None})

    @app.exception_handler(HttpError)
    async def http_error(_: Request, e: HttpError) -> Response:
        return e.response()

    @app.exception_handler(LoractlError)
    async def domain_error(_: Request, e: LoractlError) -> Response:
        return from_domain(e).response()

    @app.exception_handler(StarletteHTTPException)
    async def routing_error(request: Request, e: StarletteHTTPException) -> Response:
        if e.status_code == 404:
            return error_response(404, f"no route {request.url.path}", "The API lives under /v1; see /docs.",
                                  code="not_found")
        return error_response(e.status_code, f"{request.method} {request.url.path}: {e.detail}",
                              "See /docs for the methods each route takes.", code="http_error",
                              headers=getattr(e, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> Response:
        if isinstance(known := of_os_error(e), LoractlError):   # a full disk: the user's to fix, not ours
            return await domain_error(request, known)
        _log.error("unexpected error in %s %s", request.method, request.url.path, exc_info=e)
        return error_response(500, f"internal error: {type(e).__name__}: {e}", "See the daemon's log.",
                              code="internal")

    ollama.register(app, core, settings, openai=serving)   # Ollama's API beside OpenAI's, as Ollama serves both
    return ollama.wrap(Guard(app, api_key=settings.api_key, socket_gid=socket_gid))


def principal(request: Request) -> str:
    """Who made a call, for the audit log (the socket's lines say uid and pid)."""
    return principal_of(request.scope)


def principal_of(scope) -> str:
    """``uid=N http=HOST:PORT``; the uid when the guard found it (loopback peers)."""
    client = scope.get("client")
    uid = scope.get(PEER_UID)
    where = f"http={client[0]}:{client[1]}" if client else "http=-"
    return f"uid={uid} {where}" if uid is not None else where


def changes_state(scope) -> bool:
    """Everything but reads and generation from stored adapters: load, unload, and any route
    added later, until it is listed here as harmless."""
    return scope["method"] not in ("GET", "HEAD") and scope["path"] not in GENERATION_PATHS


class Guard:
    """Authentication (API key) or, without a key, loopback-only Host names, and the socket's
    rule for calls that change state; see the module."""

    def __init__(self, app, *, api_key: bytes | None, socket_gid: int | None = None) -> None:
        self.app = app
        self.api_key = api_key
        self.socket_gid = socket_gid

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            refusal = self._refusal(scope)
            if refusal is None and changes_state(scope):
                refusal = await self._state_change_refusal(scope)
            if refusal is not None:
                await refusal(scope, receive, send)
                return
        await self.app(scope, receive, send)

    def _refusal(self, scope) -> Response | None:
        headers = dict(scope["headers"])
        if self.api_key is None:
            host = _host_name(headers.get(b"host", b"").decode("latin-1"))
            if host and not _is_loopback_name(host):
                return error_response(403, f"this API answers only requests for localhost, not {host!r}",
                                      "Use http://127.0.0.1:PORT, or give the daemon an --api-key-file.",
                                      code="forbidden_host")
            return None
        if scope["path"] in _OPEN_PATHS:
            return None
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key):
            return None
        return error_response(401, "missing or wrong API key", "Send the header: Authorization: Bearer KEY.",
                              code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})

    async def _state_change_refusal(self, scope) -> Response | None:
        """With a key, its holder may change state. Without one, HTTP grants what the socket
        would: the loopback peer's uid (from the kernel) must be root, the daemon's user or in
        its socket group; an unknown uid is refused."""
        client, server = scope.get("client"), scope.get("server")
        uid = await asyncio.to_thread(tcp_peer_uid, tuple(client), tuple(server)) if client and server else None
        scope[PEER_UID] = uid
        if self.api_key is not None or (uid is not None and may_change_state(uid, None, self.socket_gid)):
            return None
        operation = _OPERATIONS.get(scope["path"]) or ollama.operation_of(scope["path"])
        audit.record(principal_of(scope), operation, "(request not read)", "denied")
        who = f"uid {uid}" if uid is not None else "a caller whose uid is unknown"
        return error_response(403, f"{who} may not {operation} over HTTP without an API key: only root, the "
                                   "daemon's user and its socket group may change adapters",
                              "Start loractld with --api-key-file FILE and send 'Authorization: Bearer KEY', "
                              "or use the socket as a user who may (loractl pull/load/evict).",
                              code="permission_denied")


def _host_name(value: str) -> str:
    """The host part of a Host header: ``[::1]:8000`` -> ``::1``, ``localhost:8000`` -> ``localhost``."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1:value.find("]")] if "]" in value else value
    return value.rsplit(":", 1)[0]


def _is_loopback_name(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
