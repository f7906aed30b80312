"""Every HTTP failure in the OpenAI error schema, with loractl's hint beside it.

``{"error": {"message", "type", "param", "code", "hint"}}``: ``message``, ``type``, ``param``
and ``code`` are what OpenAI client libraries read (the ``openai`` package raises the matching
``APIStatusError`` subclass from the status code); ``hint`` says what to do next, as the CLI's
``hint:`` line does.
"""

from __future__ import annotations

import difflib
import re

from pydantic import ValidationError
from starlette.responses import JSONResponse

from loractl.errors import LoractlError, one_line

# Domain error kind -> HTTP status.
STATUS = {
    "invalid_request": 400, "invalid_adapter": 400, "adapter_not_found": 404, "permission_denied": 403,
    "engine_unavailable": 503, "daemon_not_running": 503, "cancelled": 503, "source_unavailable": 502,
    "disk_full": 507, "internal": 500,
}
_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "invalid_request_error", 405: "invalid_request_error", 408: "invalid_request_error",
          413: "invalid_request_error", 431: "invalid_request_error",
          415: "invalid_request_error",
          429: "rate_limit_error"}


class HttpError(Exception):
    """A failure the HTTP layer itself detects (body, auth, limits, schema)."""

    def __init__(self, status: int, message: str, hint: str, *, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.hint = status, message, hint
        self.param, self.code, self.headers = param, code, headers

    def response(self) -> JSONResponse:
        return error_response(self.status, self.message, self.hint, param=self.param, code=self.code,
                              headers=self.headers)


def error_response(status: int, message: str, hint: str, *, param: str | None = None, code: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    return JSONResponse(error_body(status, message, hint, param=param, code=code), status_code=status, headers=headers)


def error_body(status: int, message: str, hint: str, *, param: str | None = None, code: str | None = None) -> dict:
    """Message, hint and param on one line each, clipped: they may echo what the client sent (a
    model name or a field name of 100 kB, found by tests/test_fuzz_http.py)."""
    return {"error": {"message": one_line(message), "type": _TYPES.get(status, "server_error"),
                      "param": None if param is None else one_line(param), "code": code, "hint": one_line(hint)}}


def from_domain(error: LoractlError, *, param: str | None = None) -> HttpError:
    return HttpError(STATUS.get(error.kind, 500), error.message, error.hint, param=param, code=error.kind)


def unknown_model(name: str, close_matches: list[str]) -> HttpError:
    message = f"The model {name!r} does not exist."
    if close_matches:
        message += f" Close matches: {', '.join(close_matches)}."
    return HttpError(404, message, "GET /v1/models lists the base model and every stored adapter; "
                     "pull an adapter first with: loractl pull REF --name NAME", param="model", code="model_not_found")


# Labels pydantic puts in an error's location for the branch of a union it tried ("str",
# "list[int]", "TextPart", ...): not fields, so not part of the parameter's name.
_FIELD = re.compile(r"[a-z_][a-z0-9_]*\Z")
_NOT_FIELDS = {"str", "int", "float", "bool", "list", "dict", "none"}


def from_validation(error: ValidationError, known_fields: set[str]) -> HttpError:
    """The first problem of a request body, as one line naming the parameter."""
    first = error.errors(include_url=False)[0]
    path = [str(p) if isinstance(p, int) else p for p in first["loc"]
            if isinstance(p, int) or (_FIELD.match(p) and p not in _NOT_FIELDS)]
    param = ".".join(str(p) for p in path) or None
    kind = first["type"]
    if kind == "extra_forbidden":
        name = str(path[-1]) if path else "?"
        close = difflib.get_close_matches(name, sorted(known_fields), n=1)
        hint = f"Did you mean {close[0]!r}?" if close else "See the OpenAI API reference for this endpoint's fields."
        return HttpError(400, f"unknown field {param!r}", hint, param=param, code="unknown_field")
    if kind == "missing":
        return HttpError(400, f"{param} is required", "Add it to the request body.", param=param, code="missing_field")
    if kind == "model_type" and not path:
        return HttpError(400, "the request body must be a JSON object", "Send a JSON object.", code="invalid_body")
    return HttpError(400, f"invalid {param}: {first['msg']}", "Fix the value and send the request again.",
                     param=param, code="invalid_value")
