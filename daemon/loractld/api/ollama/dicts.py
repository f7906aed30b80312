"""The OpenAI door's answers as dicts: ``chat_dict`` / ``completion_dict`` over its
``Serving.answer`` (the door's checks in front, then vLLM's serving classes).

An answer is vLLM's JSON body, or its server-sent events decoded one ``data:`` line at a time
into chunk dicts (``[DONE]`` ends them); a refusal (a status of 400 or more, or an error event
in a stream) is raised as :class:`HttpError`. What the request holds (its concurrency slot,
the adapter's lease) is released once the answer is read or the iteration is closed.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from starlette.requests import Request

from loractld.api.http.errors import HttpError

_HINT = "Fix the request: the message says what vLLM's checks refused."


@dataclass
class DictReply:
    """An answer as dicts: the JSON body, or the stream's chunks; ``scope``: the request's
    (``engine.openai_serving.RequestScope``: when its first token came)."""

    result: dict | AsyncIterator[dict]
    scope: Any = None


class DictDoor:
    def __init__(self, serving) -> None:
        self.serving = serving

    async def chat_dict(self, body: dict, request: Request) -> DictReply:
        return await self._answer("chat", body, request)

    async def completion_dict(self, body: dict, request: Request) -> DictReply:
        return await self._answer("completion", body, request)

    async def _answer(self, route: str, body: dict, request: Request) -> DictReply:
        answer, held = await self.serving.answer(route, request, body)
        if answer.stream is None:
            held.release()
            if answer.status >= 400:
                raise refusal(answer.status, answer.body or {})
            return DictReply(answer.body, answer.scope)
        return DictReply(_chunks(answer.stream, held), answer.scope)


def refusal(status: int, body: dict) -> HttpError:
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    hint = "See the daemon's log." if status >= 500 else _HINT
    return HttpError(status, str(error.get("message") or f"the request failed ({status})"), hint,
                     param=error.get("param"), code=str(error.get("type") or "") or None)


async def _chunks(events: AsyncIterator[str], held) -> AsyncIterator[dict]:
    try:
        async for event in events:
            for line in event.splitlines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    return
                chunk = json.loads(data)
                if isinstance(chunk.get("error"), dict):
                    code = chunk["error"].get("code")
                    raise refusal(code if isinstance(code, int) and 400 <= code < 600 else 500, chunk)
                yield chunk
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()   # vLLM's generator: aborts the request in the engine if it still runs
        held.release()
