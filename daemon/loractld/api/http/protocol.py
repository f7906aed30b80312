"""The request bodies the HTTP API accepts: OpenAI's, checked strictly.

- A field of the wrong type is refused, never coerced: ``"temperature": "0.5"`` is an error,
  as are NaN and infinities.
- An unknown field is refused by name, with the closest known one: a typo (``max_token``)
  would otherwise be dropped silently and the request would run with the defaults.
- OpenAI fields loractl does not implement (penalties, logprobs, tools, ...) are accepted at
  their neutral value only: client libraries that always send ``presence_penalty: 0`` work,
  and a request that asks for a penalty is told it gets none, instead of silently not.
- ``top_k`` and ``min_tokens`` are vLLM's extensions (the ``openai`` package sends them through
  ``extra_body``), kept so that scripts written for ``vllm serve`` keep working.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from loractld.api.http.errors import HttpError, from_validation

MAX_N = 16
_INT64 = 1 << 63

# OpenAI fields without an implementation here, and the values that ask for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0), "logprobs": (False, None), "top_logprobs": (0, None),
    "logit_bias": (None, {}), "tools": (None, []), "tool_choice": (None, "none"), "functions": (None, []),
    "function_call": (None, "none"), "response_format": (None, {"type": "text"}), "modalities": (None, ["text"]),
    "parallel_tool_calls": (None, True, False), "store": (None, False), "metadata": (None, {}),
    "service_tier": (None, "auto", "default"), "echo": (False, None), "suffix": (None, ""), "best_of": (None, 1),
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class Message(_Strict):
    role: str
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_core(self) -> dict[str, str]:
        """Text parts joined by newlines (as vLLM does for text-only templates); OpenAI's
        ``developer`` role is the ``system`` role of chat templates."""
        content = self.content if isinstance(self.content, str) else "\n".join(p.text for p in self.content or [])
        return {"role": "system" if self.role == "developer" else self.role, "content": content}


class StreamOptions(_Strict):
    include_usage: bool = False


class _Generation(_Strict):
    model: str
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=-_INT64, lt=_INT64)
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None     # accepted and ignored: the daemon has no accounts

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def stop_list(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class ChatCompletionRequest(_Generation):
    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)

    @property
    def token_limit(self) -> int | None:
        """None: whatever the context leaves after the prompt (OpenAI's and vLLM's default)."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Generation):
    prompt: str | list[int] | list[str] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)    # OpenAI's default for completions, as vLLM's

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    def prompts(self) -> list[str | list[int]]:
        """One entry per prompt: text, or token ids; none of them empty."""
        if isinstance(self.prompt, str):
            prompts = [self.prompt]
        elif self.prompt and all(isinstance(p, int) for p in self.prompt):
            prompts = [list(self.prompt)]
        else:
            prompts = list(self.prompt)
        if not prompts or not all(prompts):
            raise HttpError(400, "prompt is empty", "Send a prompt.", param="prompt", code="invalid_value")
        return prompts


class LoadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/load_lora_adapter`` body."""

    lora_name: str
    lora_path: str | None = None
    load_inplace: bool = False   # a new content under a known name always replaces it here


class UnloadLoraAdapterRequest(_Strict):
    """vLLM's ``/v1/unload_lora_adapter`` body."""

    lora_name: str
    lora_int_id: int | None = None


def parse(body: bytes, model: type[_Strict]) -> Any:
    """A request of type ``model`` from a raw body, or an :class:`HttpError` saying what is wrong."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise HttpError(400, f"the request body is not valid JSON: {e}", "Send a JSON object "
                        "(with curl: -H 'Content-Type: application/json' -d '{...}').", code="invalid_json") from e
    except RecursionError as e:  # arrays or objects nested about a thousand deep: Python's parser gives up
        raise HttpError(400, "the request body is nested too deeply to parse",
                        "Send a JSON object of the endpoint's fields; none of them nests more than a few levels.",
                        code="invalid_json") from e
    if isinstance(raw, dict):
        for name in set(raw) & set(_NEUTRAL) - set(model.model_fields):
            value = raw.pop(name)
            if not any(value == neutral and type(value) is type(neutral) or value is neutral
                       for neutral in _NEUTRAL[name]):
                raise HttpError(400, f"{name} is not supported by loractl", f"Leave {name} out of the request.",
                                param=name, code="unsupported_parameter")
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        raise from_validation(e, set(model.model_fields) | set(_NEUTRAL)) from e
