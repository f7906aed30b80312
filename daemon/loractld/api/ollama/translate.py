"""Ollama's ``/api/chat`` and ``/api/generate`` as OpenAI requests, and the OpenAI door's answers
as Ollama's: pure functions, no I/O.

Generation is the OpenAI door's (``chat_dict`` / ``completion_dict``): this module only
translates. ``/api/chat`` and ``/api/generate`` become chat completions (the model's own chat
template, ``system`` as a system message); ``/api/generate`` with ``raw: true`` becomes a plain
completion of the prompt as sent. What Ollama's request asks that loractl cannot honour is
refused by name (see :data:`REFUSED`), never dropped.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from loractld.api.ollama.options import map_format, map_options, refusal

CHAT_FIELDS = {"model", "messages", "tools", "format", "options", "stream", "keep_alive", "think", "logprobs",
               "top_logprobs", "truncate", "shift"}
GENERATE_FIELDS = {"model", "prompt", "suffix", "system", "template", "context", "raw", "images", "format", "options",
                   "stream", "keep_alive", "think", "logprobs", "top_logprobs", "truncate", "shift", "width",
                   "height", "steps"}
# Fields loractl refuses when they ask for something (an empty or false value asks for nothing).
REFUSED = {
    "images": "image inputs are not served: loractl's engine serves text models",
    "think": "thinking is not served: the daemon runs no reasoning parser",
    "template": "Go templates are Ollama's; loractl renders the model's own chat template (send raw: true with a "
                "prompt of your own instead)",
    "context": "context token lists are not kept between requests (send the conversation to /api/chat instead)",
    "suffix": "fill-in-the-middle is not served: the models here have no suffix template",
    "truncate": "a prompt is never cut to fit: one longer than the context is refused",
    "shift": "the context is never shifted: an answer stops at the end of the context (done_reason \"length\")",
    "width": "image generation is not served", "height": "image generation is not served",
    "steps": "image generation is not served",
}
ROLES = {"system", "user", "assistant", "tool"}


def _unknown_and_refused(request: dict, known: set[str]) -> None:
    for name, value in request.items():
        if name not in known:
            raise refusal(f"unknown field {name!r}", "See Ollama's API reference for this endpoint's fields.",
                          param=name)
        if name in REFUSED and value not in (None, False, "", [], {}):
            raise refusal(f"{name} is not supported: {REFUSED[name]}", "Leave it out.", param=name)


def _common(request: dict, model: str, context: int | None) -> dict:
    body: dict[str, Any] = {"model": model, **map_options(request.get("options"), context),
                            **map_format(request.get("format"))}
    if request.get("stream", True):
        body["stream"] = True
        body["stream_options"] = {"include_usage": True}
    else:
        body["stream"] = False
    if request.get("logprobs"):
        body["logprobs"] = True
        if request.get("top_logprobs"):
            body["top_logprobs"] = request["top_logprobs"]
    return body


def chat_body(request: dict, model: str, context: int | None) -> dict:
    """The OpenAI chat completion request for an Ollama ``/api/chat`` request."""
    _unknown_and_refused(request, CHAT_FIELDS)
    body = _common(request, model, context)
    body["messages"] = openai_messages(request.get("messages") or [])
    if request.get("tools"):
        body["tools"] = request["tools"]
    return body


def generate_body(request: dict, model: str, context: int | None) -> tuple[str, dict]:
    """``("chat", body)`` or, for ``raw: true``, ``("completion", body)``."""
    _unknown_and_refused(request, GENERATE_FIELDS)
    prompt, system = request.get("prompt") or "", request.get("system") or ""
    if not isinstance(prompt, str) or not isinstance(system, str):
        raise refusal("prompt and system must be strings", "Send text.")
    body = _common(request, model, context)
    if request.get("raw"):
        if system:
            raise refusal("system is not used with raw: true (the prompt is sent as is)",
                          "Put the system text into the prompt, or leave raw out.", param="system")
        if body.pop("logprobs", False):   # the completions API: logprobs is the number of top ones
            body["logprobs"] = body.pop("top_logprobs", 0)
        return "completion", {**body, "prompt": prompt}
    messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": prompt}]
    return "chat", {**body, "messages": messages}


def openai_messages(messages: Any) -> list[dict]:
    """Ollama's messages in OpenAI's shape: tool calls get ids (Ollama has none) and each tool
    answer names the call it answers (by ``tool_name``, else the oldest one unanswered)."""
    if not isinstance(messages, list):
        raise refusal("messages must be a list", "Send [{\"role\": \"user\", \"content\": \"...\"}].",
                      param="messages")
    out, unanswered, count = [], [], 0
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise refusal(f"messages[{i}]: the role must be one of {', '.join(sorted(ROLES))}", "Fix the message.",
                          param=f"messages.{i}.role")
        for name in ("images", "thinking"):
            if m.get(name):
                reason = REFUSED["images"] if name == "images" else "earlier thinking cannot be sent back: " \
                                                                    "the daemon runs no reasoning parser"
                raise refusal(f"messages[{i}].{name} is not supported: {reason}", "Leave it out.",
                              param=f"messages.{i}.{name}")
        content = m.get("content") or ""
        if not isinstance(content, str):
            raise refusal(f"messages[{i}].content must be a string", "Send text.", param=f"messages.{i}.content")
        message: dict[str, Any] = {"role": m["role"], "content": content}
        if m["role"] == "assistant" and m.get("tool_calls"):
            message["tool_calls"] = []
            for call in m["tool_calls"]:
                function = (call or {}).get("function") or {}
                arguments = function.get("arguments", {})
                call_id = f"call_{count}"
                count += 1
                message["tool_calls"].append({"id": call_id, "type": "function", "function": {
                    "name": function.get("name", ""),
                    "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments)}})
                unanswered.append((call_id, function.get("name", "")))
        if m["role"] == "tool":
            wanted = m.get("tool_name") or m.get("name")
            match = next((c for c in unanswered if c[1] == wanted), unanswered[0] if unanswered else None)
            if match is not None:
                unanswered.remove(match)
                message["tool_call_id"] = match[0]
            else:
                message["tool_call_id"] = f"call_{count}"
                count += 1
        out.append(message)
    return out


# -- answers ---------------------------------------------------------------------------------
def now_rfc3339() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def done_reason(finish_reason: str | None) -> str:
    return {None: "stop", "tool_calls": "stop", "function_call": "stop"}.get(finish_reason, finish_reason)


@dataclass
class Clock:
    """The durations Ollama reports, in nanoseconds: from the request's arrival to its first
    token (``prompt_eval_duration``: queueing, prefill), then to its end (``eval_duration``)."""

    start: int = field(default_factory=time.perf_counter_ns)
    first: int | None = None
    load_ns: int = 0

    def token(self) -> None:
        if self.first is None:
            self.first = time.perf_counter_ns()

    def fields(self, usage: dict | None) -> dict:
        end = time.perf_counter_ns()
        first = self.first if self.first is not None else end
        usage = usage or {}
        return {"total_duration": end - self.start, "load_duration": self.load_ns,
                "prompt_eval_count": usage.get("prompt_tokens", 0), "prompt_eval_duration": first - self.start,
                "eval_count": usage.get("completion_tokens", 0), "eval_duration": end - first}


def ollama_tool_calls(calls: list[dict] | None) -> list[dict]:
    """OpenAI's tool calls (arguments as JSON text) as Ollama's (arguments as an object)."""
    out = []
    for call in calls or []:
        function = call.get("function") or {}
        text = function.get("arguments") or "{}"
        try:
            arguments = json.loads(text) if isinstance(text, str) else text
        except ValueError:
            arguments = None
        if not isinstance(arguments, dict):
            raise refusal(f"the model called {function.get('name')!r} with arguments that are not a JSON object: "
                          f"{text[:200]!r}", "Retry, or ask for the call with tool_choice in the OpenAI API "
                          "(/v1/chat/completions), which forces valid arguments.", status=502)
        out.append({"function": {"name": function.get("name", ""), "arguments": arguments}})
    return out


def ollama_logprobs(logprobs: dict | None) -> list[dict] | None:
    """OpenAI's per-token log probabilities (chat: ``content``; completions: ``tokens``...) as Ollama's."""
    if not logprobs:
        return None
    if "content" in logprobs:
        return [{"token": t["token"], "logprob": t["logprob"],
                 **({"top_logprobs": [{"token": x["token"], "logprob": x["logprob"]} for x in t["top_logprobs"]]}
                    if t.get("top_logprobs") else {})} for t in logprobs.get("content") or []]
    tokens, values = logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []
    tops = logprobs.get("top_logprobs") or [None] * len(tokens)
    return [{"token": t, "logprob": v, **({"top_logprobs": [{"token": k, "logprob": p} for k, p in top.items()]}
                                          if top else {})} for t, v, top in zip(tokens, values, tops)]


def answer(kind: str, name: str, response: dict, clock: Clock) -> dict:
    """A whole OpenAI answer (``stream: false``) as Ollama's one object. ``kind``: chat | generate
    (a chat answer rendered as /api/generate's) | completion (raw /api/generate)."""
    choice = (response.get("choices") or [{}])[0]
    clock.token()
    if kind == "completion":
        text, calls = choice.get("text") or "", None
    else:
        message = choice.get("message") or {}
        text, calls = message.get("content") or "", message.get("tool_calls")
    out = _part(kind, name, text, ollama_tool_calls(calls) if kind == "chat" else None)
    logprobs = ollama_logprobs(choice.get("logprobs"))
    if logprobs is not None:
        out["logprobs"] = logprobs
    return {**out, "done": True, "done_reason": done_reason(choice.get("finish_reason")),
            **clock.fields(response.get("usage"))}


def _part(kind: str, name: str, text: str, tool_calls: list[dict] | None = None) -> dict:
    if kind == "chat":
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if tool_calls:
            message["tool_calls"] = tool_calls
        return {"model": name, "created_at": now_rfc3339(), "message": message}
    return {"model": name, "created_at": now_rfc3339(), "response": text}


class Stream:
    """OpenAI chunks in, Ollama's NDJSON objects out: a part per piece of text, the tool calls
    whole once their arguments are complete (Ollama sends them as objects), and a last object
    with ``done: true``, the reason, the token counts and the durations."""

    def __init__(self, kind: str, name: str, clock: Clock) -> None:
        self.kind, self.name, self.clock = kind, name, clock
        self.finish_reason: str | None = None
        self.usage: dict | None = None
        self._calls: dict[int, dict] = {}

    def feed(self, chunk: dict) -> list[dict]:
        if chunk.get("usage"):
            self.usage = chunk["usage"]
        out = []
        for choice in chunk.get("choices") or []:
            if self.kind == "completion":
                text = choice.get("text") or ""
            else:
                delta = choice.get("delta") or {}
                text = delta.get("content") or ""
                for call in delta.get("tool_calls") or []:
                    self._add_call(call)
            logprobs = ollama_logprobs(choice.get("logprobs"))
            if text or logprobs:
                self.clock.token()
                part = {**_part(self.kind, self.name, text), "done": False}
                if logprobs:
                    part["logprobs"] = logprobs
                out.append(part)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def _add_call(self, delta: dict) -> None:
        self.clock.token()
        call = self._calls.setdefault(delta.get("index", len(self._calls)), {"function": {"name": "", "arguments": ""}})
        function = delta.get("function") or {}
        call["function"]["name"] += function.get("name") or ""
        call["function"]["arguments"] += function.get("arguments") or ""

    def finish(self) -> list[dict]:
        """The objects that end the stream: the tool calls, if any, then the ``done`` one."""
        out = []
        if self._calls:
            calls = ollama_tool_calls([self._calls[i] for i in sorted(self._calls)])
            out.append({**_part(self.kind, self.name, "", calls), "done": False})
        last = {**_part(self.kind, self.name, ""), "done": True, "done_reason": done_reason(self.finish_reason),
                **self.clock.fields(self.usage)}
        return out + [last]


def empty(kind: str, name: str, reason: str) -> dict:
    """The answer to a request with nothing to generate: Ollama loads (or, with keep_alive 0,
    unloads) the model and says so in ``done_reason``."""
    return {**_part(kind, name, ""), "done": True, "done_reason": reason}
