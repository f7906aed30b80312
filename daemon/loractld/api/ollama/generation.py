"""``POST /api/chat`` and ``POST /api/generate``: Ollama's requests, answered by the OpenAI door.

Nothing here generates: a request is translated (``translate``) into an OpenAI chat or
completion request and handed to the OpenAI door's ``chat_dict`` / ``completion_dict`` (vLLM's
own serving classes over loractl's engine), whose answer is translated back. So every answer
is the one ``/v1/chat/completions`` gives for the same request, token for token.

Invariants:
- Everything that can refuse a request (the model, the fields, the options, ``keep_alive``'s
  permission, the OpenAI door's own checks) is answered before the status line, in Ollama's
  error shape; a failure once a stream has begun is its last line, ``{"error": ...}``.
- A client that goes away closes the OpenAI door's stream, which aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loractl.names import MAX_NAME_LEN
from loractld.api.http.errors import HttpError
from loractld.api.ollama.errors import line
from loractld.api.ollama.names import Target, listed_name, resolve
from loractld.api.ollama.options import KeepAlive, in_ollamas_words, parse_keep_alive, refusal
from loractld.api.ollama.residency import KeepAliveEffect
from loractld.api.ollama.translate import Clock, Stream, answer, chat_body, empty, generate_body

if TYPE_CHECKING:
    from loractld.api.ollama.dicts import DictDoor
    from loractld.core import Core
    from loractld.core.policy import Caller

NDJSON = "application/x-ndjson"


class Generation:
    def __init__(self, core: Core, openai: DictDoor,
                 caller_of: Callable[[Request], Awaitable[Caller]]) -> None:
        self.core, self.openai, self.caller_of = core, openai, caller_of

    async def chat(self, request: Request, req: dict) -> Response:
        clock = Clock()
        name, target = await self.target(req)
        body = chat_body(req, target.adapter or self.core.served_model_name, self._context())
        effect = await self._effect(request, req, target, nothing_to_do=not req.get("messages"))
        if not req.get("messages"):
            return JSONResponse(empty("chat", name, await effect.load_only()))
        return await self._run("chat", name, "chat_dict", body, effect, clock, request)

    async def generate(self, request: Request, req: dict) -> Response:
        clock = Clock()
        name, target = await self.target(req)
        route, body = generate_body(req, target.adapter or self.core.served_model_name, self._context())
        effect = await self._effect(request, req, target, nothing_to_do=not req.get("prompt"))
        if not req.get("prompt"):
            return JSONResponse(empty("generate", name, await effect.load_only()))
        if route == "completion":
            return await self._run("completion", name, "completion_dict", body, effect, clock, request)
        return await self._run("generate", name, "chat_dict", body, effect, clock, request)

    async def target(self, req: dict) -> tuple[str, Target]:
        """The model a request names; 404 in Ollama's words when none."""
        name = checked_name(self.core, req.get("model"))   # before the store is asked (a 300-character name)
        catalog = self.core.catalog
        if catalog is None:
            raise HttpError(503, "the daemon is starting", "Retry in a moment (loractl status --wait waits).",
                            code="engine_unavailable")
        # A profile is a model as an adapter is (the OpenAI door applies it).
        target = resolve(name, self.core.base_model_names(),
                         lambda n: catalog.store.has(n) or self.core.profile_of(n) is not None)
        if target is None:
            raise await not_found(self.core, name)
        return name, target

    def _context(self) -> int | None:
        engine = self.core.engine
        return engine.max_model_len if engine is not None else None

    async def _effect(self, request: Request, req: dict, target: Target, *, nothing_to_do: bool) -> KeepAliveEffect:
        keep: KeepAlive = parse_keep_alive(req.get("keep_alive"))
        caller = await self.caller_of(request) if keep.action is not None or nothing_to_do else None
        return KeepAliveEffect(self.core, target.adapter, keep, caller)

    async def _run(self, kind: str, name: str, method: str, body: dict, effect: KeepAliveEffect, clock: Clock,
                   request: Request) -> Response:
        await effect.before()
        try:
            reply = await getattr(self.openai, method)(body, request)
        except HttpError as e:
            raise in_ollamas_words(e) from None
        result = reply.result
        if isinstance(result, dict):
            clock.first = reply.scope.first_token_ns if reply.scope else None   # a whole answer: when its first token came
            out = answer(kind, name, result, clock)
            await effect.after()
            if body.get("stream"):
                return StreamingResponse(_one(out), media_type=NDJSON)
            return JSONResponse(out)
        return StreamingResponse(_lines(Stream(kind, name, clock), result, effect), media_type=NDJSON)


async def _one(out: dict) -> AsyncIterator[bytes]:
    yield _dumps(out)


async def _lines(stream: Stream, chunks: AsyncIterator[dict], effect: KeepAliveEffect) -> AsyncIterator[bytes]:
    try:
        closing = contextlib.aclosing(chunks) if hasattr(chunks, "aclose") else contextlib.nullcontext(chunks)
        async with closing:
            async for chunk in chunks:
                for part in stream.feed(chunk):
                    yield _dumps(part)
        last = stream.finish()
        await effect.after()
    except Exception as e:  # noqa: BLE001 - the status line is sent: the error is the last line
        yield _dumps(line(e))
        return
    for part in last:
        yield _dumps(part)


def _dumps(obj: Any) -> bytes:
    return json.dumps(obj, ensure_ascii=False).encode() + b"\n"


# The longest model name a request may give: a store name's longest (loractl.names.MAX_NAME_LEN)
# written as Ollama's Hub integration writes it (https://huggingface.co/ORG/REPO:REVISION).
MAX_MODEL_NAME = MAX_NAME_LEN + 96


def checked_name(core: Core, name: object, param: str = "model") -> str:
    """``name`` if it may name a model, else a 400 that says why, before any store is asked."""
    if not isinstance(name, str) or not name.strip():
        raise refusal(f"{param} is required", "Name a model: GET /api/tags lists them.", param=param)
    if name in core.base_model_names():
        return name
    if len(name) > MAX_MODEL_NAME or not name.isprintable():
        what = f"{len(name)} characters long" if len(name) > MAX_MODEL_NAME else "not printable text"
        raise refusal(f"{param} {name[:40]!r}... is {what}: no model has such a name" if len(name) > 40 else
                      f"{param} {name!r} is {what}: no model has such a name",
                      f"Name a model GET /api/tags lists (e.g. sql-expert:v1): names are at most {MAX_NAME_LEN} "
                      "lowercase letters, digits, '.', '_' and '-', with at most one '/'.", param=param)
    return name


async def not_found(core: Core, name: str) -> HttpError:
    """Ollama's 404 for a model it does not have, with loractl's close matches as listed."""
    close = await asyncio.to_thread(core.close_matches, name.replace(":", "/", 1).lower())
    stored = {c for c in close if c not in core.base_model_names()}
    shown = [listed_name(c, stored) if c in stored else c for c in close]
    message = f"model {name!r} not found"
    if shown:
        message += f"; close matches: {', '.join(shown)}"
    return HttpError(404, message, "GET /api/tags lists the models; pull an adapter with POST /api/pull "
                     "(hf.co/ORG/REPO) or loractl pull REF --name NAME.", param="model", code="model_not_found")
