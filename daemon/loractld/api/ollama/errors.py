"""Ollama's error shape, ``{"error": "..."}``, for every failure on Ollama's routes.

The HTTP door answers failures in OpenAI's schema (``api/http/errors``), from many places: the
guard (401, 403), the body reader (413, 415, 408), the router (404, 405), the domain errors.
:class:`OllamaErrors` wraps the whole door and rewrites those answers on Ollama's routes
(``/api/...`` and ``/``) into Ollama's shape, keeping the status code and loractl's hint
beside the message: ``{"error": MESSAGE, "hint": HINT}``. Ollama's clients read ``error``
(the official Python client raises ``ResponseError`` with it and the status code).
A failure after a stream has begun cannot change the status: it is a last NDJSON line
``{"error": ...}``, as Ollama sends it (:func:`line`).
"""

from __future__ import annotations

import json

from loractl.errors import LoractlError, of_os_error, one_line
from loractld.api.http.errors import HttpError, from_domain


def is_ollama_path(path: str) -> bool:
    return path == "/" or path.startswith("/api/")


def shaped(status_body: dict) -> dict:
    """An OpenAI-schema error body in Ollama's shape (other bodies unchanged)."""
    error = status_body.get("error")
    if not isinstance(error, dict):
        return status_body
    out = {"error": error.get("message") or "error"}
    if error.get("hint"):
        out["hint"] = error["hint"]
    return out


def line(error: BaseException) -> dict:
    """An exception as the last line of an NDJSON stream."""
    error = of_os_error(error)
    if isinstance(error, LoractlError):
        error = from_domain(error)
    if isinstance(error, HttpError):
        return {"error": one_line(error.message), "hint": one_line(error.hint)}
    return {"error": one_line(f"internal error: {type(error).__name__}: {error}"), "hint": "See the daemon's log."}


class OllamaErrors:
    """ASGI middleware: error answers on Ollama's routes in Ollama's shape (see the module)."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or not is_ollama_path(scope["path"]):
            await self.app(scope, receive, send)
            return
        held: dict | None = None
        body: list[bytes] = []

        async def rewrite(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400 and _is_json(message):
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.append(message.get("body", b""))
            if message.get("more_body"):
                return
            raw = b"".join(body)
            try:
                raw = json.dumps(shaped(json.loads(raw))).encode()
            except ValueError:
                pass
            headers = [(k, v) for k, v in held["headers"] if k.lower() != b"content-length"]
            await send({**held, "headers": headers + [(b"content-length", str(len(raw)).encode())]})
            await send({"type": "http.response.body", "body": raw})

        await self.app(scope, receive, rewrite)


def _is_json(start: dict) -> bool:
    return any(k.lower() == b"content-type" and v.startswith(b"application/json") for k, v in start["headers"])
