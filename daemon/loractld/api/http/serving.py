"""The generation routes — ``/v1/chat/completions``, ``/v1/completions``, ``/v1/responses``,
``/v1/messages``, ``/tokenize``, ``/detokenize`` — answered by vLLM's own serving classes
(``loractld.engine.openai_serving``) behind what loractl adds in front of them.

In front, in this order, before vLLM's code sees the request:
1. unknown fields are refused by name in one 400 (vLLM accepts them with a log line, so a
   field it dropped, like ``guided_json``, would turn into free text);
2. one request asks for at most ``max_choices`` generations (prompts x ``n``);
3. a concurrency slot (429 past ``--http-max-concurrency``);
4. the model named is resolved through the store (``Core.resolve_model``): a stored name, never
   a folder; auto-pull only for a key holder; the engine's own loader has accepted its content.
   A profile's name resolves to its adapter (or the base model), and its defaults fill the body
   under the request's own values (``Core.profile_body``).
   The resolve's lease holds the adapter's folder until the response ends, however it ends.

Then vLLM's handler answers, its engine requests passing loractl's admission gate
(``serving.admitted.Admission``, handed down by the core). Every error is in the OpenAI error schema with a hint (the Anthropic
route in Anthropic's); a client that goes away cancels the handler, which aborts in the engine.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse

from loractl.errors import AdapterNotFound, InvalidRequest
from loractld.api.http.errors import HttpError, error_body, error_response, from_domain, unknown_model
from loractld.core import Core, UnknownModel
from loractld.core.policy import Caller

_log = logging.getLogger("loractld.http")

ROUTES = {"/v1/chat/completions": "chat", "/v1/completions": "completion", "/v1/responses": "responses",
          "/v1/messages": "messages", "/tokenize": "tokenize", "/detokenize": "detokenize"}
_HINTS = {400: "Fix the request: the message says what vLLM's checks refused.",
          404: "GET /v1/models lists the base model and every stored adapter.",
          500: "See the daemon's log."}


class ClientGone(Exception):
    """The client closed the connection before the answer was ready."""


class Limiter:
    """At most ``limit`` generation requests at once; the next one is told to come back (429)."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.active = 0

    def acquire(self) -> None:
        if self.active >= self.limit:
            raise HttpError(429, f"too many requests at once ({self.limit} are running)",
                            "Retry in a moment, or raise loractld --http-max-concurrency.",
                            code="too_many_requests", headers={"Retry-After": "1"})
        self.active += 1

    def release(self) -> None:
        self.active -= 1


class Held:
    """What one request holds until its response ends (its concurrency slot, the adapter's
    lease): released exactly once, however the response ends."""

    def __init__(self, *releases: Callable[[], None]) -> None:
        self._releases = list(releases)

    def add(self, release: Callable[[], None]) -> None:
        self._releases.append(release)

    def release(self) -> None:
        releases, self._releases = self._releases, []
        for release in releases:
            release()


class EventStream(StreamingResponse):
    """Server-sent events that release what their request holds however the response ends:
    finished, failed, or cut short by a client that went away (Starlette cancels the body)."""

    def __init__(self, body: AsyncIterator[str], held: Held) -> None:
        super().__init__(body, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._held = held

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                await aclose()   # a body never started still closes vLLM's generator
            self._held.release()


async def until_disconnected(request: Request, work: Awaitable) -> Any:
    """``work``'s result; if the client goes away first, ``work`` is cancelled and ClientGone raised."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


def generations(route: str, body: dict) -> tuple[int, int]:
    """How many prompts and how many choices (``n``) each a request asks for (a value of the
    wrong type counts as 1 here: vLLM's validation refuses it)."""
    n = body.get("n")
    n = n if isinstance(n, int) and not isinstance(n, bool) and n > 1 else 1
    prompt = body.get("prompt") if route == "completion" else None
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return len(prompt), n
    return 1, n


class Serving:
    def __init__(self, core: Core, limiter: Limiter, *, max_choices: int = 128, key_required: bool = False) -> None:
        self.core = core
        self.limiter = limiter
        self.max_choices = max_choices
        # Behind the guard every generation request of a keyed API carries the key: its holder is
        # the caller the core judges (core.policy). Keyless callers stay unidentified: they never
        # make the daemon download.
        self.caller = Caller("http", key_holder=True) if key_required else None

    async def handle(self, route: str, request: Request, body: Any) -> Response:
        try:
            answer, held = await self.answer(route, request, body)
        except HttpError as e:
            if route != "messages":
                raise
            return self.refusal(route, e.status, error_body(e.status, e.message, e.hint, param=e.param, code=e.code))
        except ClientGone:
            _log.debug("the client went away; its request was aborted")
            return Response(status_code=499)
        if answer.stream is not None:
            return EventStream(answer.stream, held)
        held.release()
        if answer.status >= 400:
            return self.refusal(route, answer.status, answer.body or {})
        return JSONResponse(answer.body)

    async def answer(self, route: str, request: Request, body: Any):
        """vLLM's answer (``engine.openai_serving.Answer``) and what the request holds until
        the answer is sent; raises :class:`HttpError` for what loractl refuses itself."""
        if not isinstance(body, dict):
            raise HttpError(400, "the request body must be a JSON object", "Send a JSON object.", code="invalid_body")
        prompts, n = generations(route, body)
        if prompts * n > self.max_choices:
            # One HTTP request counts once against --http-max-concurrency: this bounds what it holds.
            raise HttpError(400, f"{prompts} prompt(s) x n={n} asks for {prompts * n} generations, over this "
                                 f"daemon's limit of {self.max_choices} per request",
                            "Split the prompts over several requests, or raise loractld --http-max-choices.",
                            param="prompt" if prompts > 1 else "n", code="too_many_choices")
        model = body.get("model") or ""
        if not isinstance(model, str):
            raise HttpError(400, "model must be a string", "Name the base model or a stored adapter.", param="model",
                            code="invalid_value")
        surface = await self.core.openai_surface()
        known = surface.fields(route)
        unknown = sorted(set(body) - known)
        if unknown:
            close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
            raise HttpError(400, f"unknown field{'s' if len(unknown) > 1 else ''} "
                                 f"{', '.join(repr(u) for u in unknown)}",
                            f"Did you mean {close[0]!r}?" if close else
                            "See vLLM's OpenAI API reference for this endpoint's fields.",
                            param=unknown[0], code="unknown_field")
        profile = self.core.profile_of(model)
        target = model
        if profile is not None:
            # A profile's name: its defaults under the request's own values, its adapter (or the base).
            try:
                body = self.core.profile_body(profile, route, body)
                target = await self.core.profile_target(profile)
            except (AdapterNotFound, InvalidRequest) as e:
                raise from_domain(e, param="model") from e
        self.limiter.acquire()
        held = Held(self.limiter.release)
        try:
            adapter, name = await until_disconnected(request, self._resolve(target, held))
            scope = surface.scope(model, adapter, name, template=profile.template if profile is not None else None)
            answer = await until_disconnected(request, surface.answer(route, body, request, scope))
        except BaseException:
            held.release()
            raise
        return answer, held

    async def _resolve(self, model: str, held: Held):
        if not model or model in self.core.base_model_names():
            return None, None
        try:
            adapter, name, lease = await self.core.resolve_model(model, self.caller)
        except UnknownModel as e:
            raise unknown_model(model, e.close_matches) from e
        except AdapterNotFound as e:
            raise from_domain(e, param="model") from e
        if lease is not None:
            held.add(lease.release)
        return adapter, name

    @staticmethod
    def refusal(route: str, status: int, body: dict) -> Response:
        """vLLM's refusal, with a hint, in the route's error schema."""
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        message = str(error.get("message") or f"the request failed ({status})")
        if route == "messages":
            return JSONResponse({"type": "error", "error": {"type": error.get("type") or "invalid_request_error",
                                                            "message": message}}, status_code=status)
        return error_response(status, message, _HINTS.get(status, _HINTS[500] if status >= 500 else _HINTS[400]),
                              param=error.get("param"), code=str(error.get("type") or "") or None)
