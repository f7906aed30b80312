"""Ollama's routes on the HTTP door's FastAPI app (see the package's docstring for the list).

Each route is a thin translation: the listings read the core's views (``catalog``), pull and
delete are the core's pull and rm behind the one policy (``core.policy``: allowed or refused,
one audit line each), chat and generate go through the OpenAI door (``generation``).
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING

from fastapi import FastAPI
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from loractl import __version__
from loractld.api.http.protocol import PEER_UID, json_body, read_body
from loractld.api.ollama.catalog import Catalog
from loractld.api.ollama.create import CREATE_FIELDS, CreateDoor
from loractld.api.ollama.dicts import DictDoor
from loractld.api.ollama.errors import line
from loractld.api.ollama.generation import NDJSON, Generation, checked_name, not_found
from loractld.api.ollama.names import candidates, resolve
from loractld.api.ollama.options import refusal
from loractld.api.ollama.pulls import progress_line, pull_ref
from loractld.api.ollama.residency import caller_of
from loractld.api.ollama.translate import CHAT_FIELDS, GENERATE_FIELDS
from loractld.core import policy

if TYPE_CHECKING:
    from loractld.api.http.settings import HttpSettings
    from loractld.core import Core

_OWNER_HINT = ("Send the daemon's API key (--api-key-file), or call as root, the daemon's user or a member of its "
               "socket group (as loractl pull/rm would).")


def add_routes(app: FastAPI, core: Core, settings: HttpSettings, openai) -> None:
    catalog = Catalog(core)
    key_required = settings.api_key is not None
    async def caller(request: Request) -> policy.Caller:
        return await caller_of(request, key_required, PEER_UID)

    generation = Generation(core, DictDoor(openai), caller)   # the door's Serving, its answers read as dicts
    creating = CreateDoor(core, settings.body_timeout_s)

    async def body(request: Request, fields: set[str]) -> dict:
        req = json_body(await read_body(request, settings.max_body_bytes, settings.body_timeout_s) or b"{}")
        if not isinstance(req, dict):
            raise refusal("the request body must be a JSON object", "Send a JSON object.")
        for name in req:
            if name not in fields:
                raise refusal(f"unknown field {name!r}", "See Ollama's API reference for this endpoint's fields.",
                              param=name)
        return req

    def model_of(req: dict) -> str:
        return checked_name(core, req.get("model") or req.get("name"))   # older clients say name

    async def stored_target(name: str):
        adapters = await core.list_adapters()
        target = resolve(name, core.base_model_names(), {a.name for a in adapters}.__contains__)
        if target is None:
            raise await not_found(core, name)
        return target, next((a for a in adapters if a.name == target.adapter), None)

    for path, (methods, reason) in NOT_SERVED.items():
        app.add_api_route(path, _not_served(reason), methods=methods, include_in_schema=False)

    @app.get("/")
    @app.head("/")
    async def root() -> Response:
        return PlainTextResponse("Ollama is running")

    @app.get("/api/version")
    @app.head("/api/version")
    async def version() -> JSONResponse:
        return JSONResponse({"version": __version__})

    @app.get("/api/tags")
    @app.head("/api/tags")
    async def tags() -> JSONResponse:
        return JSONResponse(await catalog.tags())

    @app.get("/api/ps")
    async def ps() -> JSONResponse:
        return JSONResponse(await catalog.ps())

    @app.post("/api/show")
    async def show(request: Request) -> JSONResponse:
        req = await body(request, {"model", "name", "verbose"})
        name = model_of(req)
        profile = core.profile_of(next((c for c in candidates(name.strip().lower()) if core.profile_of(c)), ""))
        if profile is not None:
            view = await core.show_profile(profile.name)
            runs = await core.show(profile.adapter) if profile.adapter else None
            return JSONResponse(await catalog.show_profile(view, runs))
        _, adapter = await stored_target(name)
        return JSONResponse(await catalog.show(adapter))

    @app.post("/api/chat")
    async def chat(request: Request) -> Response:
        return await generation.chat(request, await body(request, CHAT_FIELDS))

    @app.post("/api/generate")
    async def generate(request: Request) -> Response:
        return await generation.generate(request, await body(request, GENERATE_FIELDS))

    @app.post("/api/pull")
    async def pull(request: Request) -> Response:
        req = await body(request, {"model", "name", "insecure", "stream", "username", "password"})
        if req.get("insecure") or req.get("username") or req.get("password"):
            raise refusal("insecure, username and password are for Ollama's registries; loractl pulls from the "
                          "Hugging Face Hub over HTTPS", "Leave them out; set HF_TOKEN in the daemon's "
                          "environment for private repositories.")
        ref, revision, name = await pull_ref(core, model_of(req))
        who = await caller(request)
        return await _respond(_pull_lines(core, who, ref, revision, name), req.get("stream", True),
                              lambda first: first.get("status") == "pulling manifest")

    @app.post("/api/create")
    async def create(request: Request) -> Response:
        req = await body(request, CREATE_FIELDS)
        lines = await creating.create(await caller(request), req)
        # Up to the first line: a refused caller is a 403, not a 200 with an error line.
        return await _respond(lines, req.get("stream", True), lambda first: False)

    @app.post("/api/copy")
    async def copy(request: Request) -> Response:
        return await creating.copy(await caller(request), await body(request, {"source", "destination"}))

    @app.head("/api/blobs/{digest}")
    async def has_blob(digest: str) -> Response:
        return await creating.has_blob(digest)

    @app.post("/api/blobs/{digest}")
    async def upload_blob(request: Request, digest: str) -> Response:
        return await creating.upload(request, await caller(request), digest)

    @app.delete("/api/delete")
    async def delete(request: Request) -> Response:
        name = model_of(await body(request, {"model", "name"}))
        # A profile /api/tags lists is deleted as loractl rm deletes it (with its own merge).
        profile = core.profile_of(next((c for c in candidates(name.strip().lower()) if core.profile_of(c)), ""))
        if profile is not None:
            removed = profile.name
        else:
            target, _ = await stored_target(name)
            if target.adapter is None:
                raise refusal(f"{name!r} is the base model: it cannot be deleted", "Delete an adapter or a profile "
                              "(GET /api/tags).", param="model")
            removed = target.adapter
        async with policy.authorized(await caller(request), core.socket_gid, "rm", removed,
                                     refusal="delete adapters over HTTP", hint=_OWNER_HINT):
            await core.remove(removed)
        return Response(status_code=200)


# Ollama's routes that loractl does not serve, and why (a 501 that says so, not a bare 404).
NOT_SERVED = {
    "/api/embed": (["POST"], "embeddings are not served: the engine runs the model for generation"),
    "/api/embeddings": (["POST"], "embeddings are not served: the engine runs the model for generation"),
    "/api/push": (["POST"], "models are not pushed: loractl pulls from the Hugging Face Hub"),
}


def _not_served(reason: str):
    async def endpoint() -> Response:
        raise refusal(f"not served by loractl: {reason}", "See man loractld, section OLLAMA API.", status=501)
    return endpoint


async def _pull_lines(core: Core, caller: policy.Caller, ref: str, revision: str, name: str) -> AsyncIterator[dict]:
    async with policy.authorized(caller, core.socket_gid, "pull", f"{ref} as {name or '(default name)'}",
                                 refusal="pull adapters over HTTP", hint=_OWNER_HINT):
        async with contextlib.aclosing(core.pull(ref, name=name, revision=revision)) as events:
            async for event in events:
                status = progress_line(event.stage, event.file, event.done, event.total)
                if status is not None:
                    yield status


async def _respond(lines: AsyncIterator[dict], stream: bool, more) -> Response:
    """Status lines as Ollama answers them: a stream of lines, or (``stream`` false) one
    ``success`` once they are all done. The lines up to the first for which ``more`` is false
    are read before answering: what fails there is an HTTP error, not a 200 with an error line."""
    first = []
    try:
        while not first or more(first[-1]):
            first.append(await anext(lines))
    except StopAsyncIteration:
        pass
    except BaseException:
        await lines.aclose()
        raise
    if stream:
        return StreamingResponse(_ndjson(first, lines), media_type=NDJSON)
    async with contextlib.aclosing(lines):
        async for _ in lines:
            pass
    return JSONResponse({"status": "success"})


async def _ndjson(first: list[dict], rest: AsyncIterator[dict]) -> AsyncIterator[bytes]:
    for item in first:
        yield json.dumps(item).encode() + b"\n"
    try:
        async with contextlib.aclosing(rest):
            async for item in rest:
                yield json.dumps(item).encode() + b"\n"
    except Exception as e:  # noqa: BLE001 - the status line is sent: the error is the last line
        yield json.dumps(line(e)).encode() + b"\n"
