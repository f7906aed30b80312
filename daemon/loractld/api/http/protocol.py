"""Request bodies: reading them (:func:`read_body`, bounded in size and time), JSON parsing for
every route, and the strict models of loractl's own routes (vLLM's adapter routes). The
generation routes' bodies are vLLM's request models (``loractld.api.http.serving``); unknown
fields are refused by name there as here.

- A field of the wrong type is refused, never coerced, as are NaN and infinities.
- An unknown field is refused by name, with the closest known one: a typo would otherwise be
  dropped silently and the request would run with the defaults.
"""

from __future__ import annotations

import asyncio
import json
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, ValidationError

from loractld.api.http.errors import HttpError, from_validation

if TYPE_CHECKING:
    from starlette.requests import Request

PEER_UID = "loractl.peer_uid"   # the scope key the guard leaves the caller's uid under


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str | None = None
    load_inplace: bool = False   # a new content under a known name always replaces it here


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    lora_name: str
    lora_int_id: int | None = None


def json_body(body: bytes) -> Any:
    """The parsed JSON of a raw body, or an :class:`HttpError` saying what is wrong."""
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the request body is not valid JSON: {e}", "Send a JSON object "
                        "(with curl: -H 'Content-Type: application/json' -d '{...}').", code="invalid_json") from e
    except RecursionError as e:  # arrays or objects nested about a thousand deep: Python's parser gives up
        raise HttpError(400, "the request body is nested too deeply to parse",
                        "Send a JSON object of the endpoint's fields; none of them nests more than a few levels.",
                        code="invalid_json") from e


def parse(body: bytes, model: type[_Strict]) -> Any:
    """A request of type ``model`` from a raw body, or an :class:`HttpError` saying what is wrong."""
    try:
        return model.model_validate(json_body(body))
    except ValidationError as e:
        raise from_validation(e, set(model.model_fields)) from e


async def read_body(request: Request, limit: int, timeout_s: float = 30.0) -> bytes:
    """The whole body, refused past ``limit`` bytes (before reading, when it says its length)
    or when it takes longer than ``timeout_s`` to arrive (408: a trickled body holds nothing)."""
    if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
        raise HttpError(415, "the request body must be JSON, sent with Content-Type: application/json",
                        "With curl: -H 'Content-Type: application/json'.", code="unsupported_media_type")
    too_large = HttpError(413, f"the request body is larger than {limit} bytes",
                          "Send less, or raise loractld --http-max-body.", code="body_too_large")
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > limit:
        raise too_large
    chunks, size = [], 0
    try:
        async with asyncio.timeout(timeout_s):
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
    except TimeoutError as e:
        raise HttpError(408, f"the request body did not arrive within {timeout_s:g} s",
                        "Send the body at once, or raise loractld --http-body-timeout.", code="body_timeout",
                        headers={"Connection": "close"}) from e
    return b"".join(chunks)
