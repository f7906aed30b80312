"""One way into the engine for every door: a generation becomes vLLM's own OpenAI request.

The HTTP and Ollama doors hand vLLM's serving classes a JSON body; the gRPC door (``loractl
run/chat``, ``loractl.Client``, ``GenerateMany``) and the Dynamo door hand the core a
:class:`~loractld.generation.GenerationRequest`. Both end in the same steps, taken by the same
code, which is vLLM's where vLLM has it:

1. the request is vLLM's ``ChatCompletionRequest`` (messages) or ``CompletionRequest`` (a prompt,
   or prompt token ids), validated by vLLM's own model (:func:`openai_request`) from the fields
   of :func:`request_fields`, the one map of loractl's sampling fields to vLLM's;
2. vLLM's serving class renders it (``render_chat_request``: the chat template, the server's
   ``--default-chat-template-kwargs`` and content format; ``render_completion_request``: the
   tokenizer's special tokens), exactly as it renders an HTTP request (:func:`plan`);
3. max_tokens is fitted to what the context leaves (``sampling.fitted``, then vLLM's
   ``get_max_tokens``), and vLLM's ``to_sampling_params`` maps every sampling field;
4. the engine request runs through :class:`~loractld.engine.openai_serving.AdmittedEngineClient`
   ``generate`` — the one place that admits, aborts on stop strings, checks the broken-adapter
   journal and counts tokens — and :func:`deltas` turns its outputs into loractl's
   :class:`~loractld.engine.sampling.Delta` (the HTTP doors' are shaped by vLLM's handlers instead).

Invariants:
- A gRPC request and the HTTP request with the same messages, prompt and sampling fields give
  the engine the same prompt token ids and the same ``SamplingParams`` (tests/test_one_path.py).
- ``vllm`` is imported inside functions only.
"""

from __future__ import annotations

import asyncio
import dataclasses
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from loractl.errors import EngineUnavailable, InvalidAdapter, InvalidRequest
from loractld.engine.params import client_errors, refusal, token_logprobs
from loractld.engine.sampling import Delta, Sampling, fitted


@dataclass
class Planned:
    """A rendered request, ready for the engine: vLLM's request object and engine input, and the
    ``SamplingParams`` made from ``sampling`` (rebuilt by :func:`sampling_params` for a copy whose
    sampling differs, e.g. a Dynamo choice with its own seed)."""

    request: Any                 # vLLM's ChatCompletionRequest / CompletionRequest
    engine_input: Any            # vLLM's EngineInput (token ids)
    prompt_ids: list[int]
    sampling: Sampling           # fitted: max_tokens set
    params: Any                  # vLLM's SamplingParams for ``sampling``


def request_fields(sampling: Sampling, chat: bool) -> dict[str, Any]:
    """``sampling`` as vLLM's OpenAI request fields: the one map from loractl's fields to vLLM's
    (vLLM's ``to_sampling_params`` makes the ``SamplingParams``, as for every HTTP request)."""
    fields: dict[str, Any] = {
        "max_tokens": sampling.max_tokens, "min_tokens": sampling.min_tokens, "temperature": sampling.temperature,
        "top_p": sampling.top_p, "top_k": sampling.top_k if sampling.top_k > 0 else -1, "seed": sampling.seed,
        "stop": list(sampling.stop), "min_p": sampling.min_p, "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty, "repetition_penalty": sampling.repetition_penalty,
        "stop_token_ids": list(sampling.stop_token_ids), "ignore_eos": sampling.ignore_eos, "stream": True,
    }
    if sampling.logit_bias:
        fields["logit_bias"] = {str(token): bias for token, bias in sampling.logit_bias.items()}
    if sampling.logprobs is not None:
        fields.update({"logprobs": True, "top_logprobs": sampling.logprobs} if chat else {"logprobs": sampling.logprobs})
    structured = sampling.structured
    if structured is not None and structured.kinds():
        kinds = structured.kinds()
        if len(kinds) > 1:
            raise InvalidRequest(f"more than one structured output constraint: {', '.join(kinds)}",
                                 "Give one of json_schema, json_object, regex, choice or grammar: vLLM applies one.")
        fields["structured_outputs"] = {key: value for key, value in (
            ("json", structured.json_schema), ("json_object", structured.json_object or None),
            ("regex", structured.regex), ("choice", structured.choice), ("grammar", structured.grammar))
            if value is not None}
    return fields


def openai_request(surface: Any, route: str, body: dict[str, Any], sampling: Sampling) -> Any:
    """vLLM's request model for ``route`` ("chat" or "completion") validated from ``body``; a
    value vLLM's model refuses is an :class:`InvalidRequest` naming the field."""
    from pydantic import ValidationError

    try:
        return surface.validator(route).validate_python(body)
    except ValidationError as e:
        first = e.errors(include_url=False)[0]
        where = next((str(p) for p in first["loc"] if isinstance(p, str) and p in body), None)
        raise InvalidRequest(f"invalid {where or 'request'}: {first['msg']}",
                             f"Give {where} a value vLLM accepts." if where else "Check the request's fields.") from e
    except client_errors() as e:
        raise refusal(e, sampling) from e


async def plan(surface: Any, *, model: str, messages: list[dict[str, str]] | None = None, prompt: str | None = None,
               prompt_token_ids: list[int] | None = None, sampling: Sampling,
               extra: dict[str, Any] | None = None) -> Planned:
    """Render one request as vLLM's serving classes render the HTTP door's, then fit its
    max_tokens to the context (``sampling.fitted``) and make its ``SamplingParams``. ``model`` is
    the name the serving classes know for the request (the base model's served name: the adapter
    goes to the engine in its own ``LoRARequest``); ``extra``: further request fields (a
    profile's ``chat_template``)."""
    chat = messages is not None
    fields = request_fields(dataclasses.replace(sampling, max_tokens=None), chat)
    fields.pop("max_tokens")
    if chat:
        body = {"model": model, "messages": messages, **fields}
    else:
        body = {"model": model, "prompt": prompt_token_ids if prompt_token_ids is not None else prompt, **fields}
    route = "chat" if chat else "completion"
    request = openai_request(surface, route, {**body, **(extra or {})}, sampling)
    rendered = await surface.render(route, request, template=(extra or {}).get("chat_template"))
    engine_input = rendered[0]
    prompt_ids = list(engine_input["prompt_token_ids"])
    if not prompt_ids:
        raise InvalidRequest("the prompt is empty", "Give a prompt with at least one token.")
    fitted_sampling = fitted(sampling, len(prompt_ids), surface.max_model_len)
    planned = Planned(request, engine_input, prompt_ids, fitted_sampling, None)
    planned.params = sampling_params(surface, planned, fitted_sampling)
    return planned


def sampling_params(surface: Any, planned: Planned, sampling: Sampling) -> Any:
    """vLLM's ``SamplingParams`` for ``planned`` with ``sampling`` (max_tokens fitted), made by
    vLLM's ``to_sampling_params`` with the model's own defaults, as vLLM's handlers make them."""
    from vllm.entrypoints.serve.utils.api_utils import get_max_tokens

    request = planned.request
    route = "chat" if "messages" in type(request).model_fields else "completion"
    if sampling is not planned.sampling:   # a copy with other values (a seed): its fields validated again
        body = {**request.model_dump(exclude_unset=True), **request_fields(sampling, route == "chat")}
        request = openai_request(surface, route, body, sampling)
    handler = surface.handler(route)
    max_tokens = get_max_tokens(surface.max_model_len, sampling.max_tokens, len(planned.prompt_ids),
                                handler.default_sampling_params, handler.override_max_tokens)
    try:
        return request.to_sampling_params(max_tokens, handler.default_sampling_params)
    except client_errors() as e:
        # vLLM's own checks of the values (an empty stop string, a penalty out of range, ...):
        # the request's fault, not an internal error.
        raise refusal(e, sampling, "invalid sampling parameters") from e


async def deltas(surface: Any, planned: Planned, params: Any, scope: Any) -> AsyncIterator[Delta]:
    """Stream ``planned`` (as ``scope``'s adapter) through the admitted engine client; cancelling
    or closing the iteration aborts it in the engine."""
    top = planned.sampling.logprobs
    first = True
    try:
        async for out in surface.client.generate(planned.engine_input, params, uuid.uuid4().hex,
                                                 lora_request=scope.lora_request, scope=scope):
            completion = out.outputs[0]
            delta = Delta(text=completion.text, token_ids=list(completion.token_ids),
                          finish_reason=completion.finish_reason if out.finished else None,
                          prompt_token_ids=list(out.prompt_token_ids or planned.prompt_ids) if first else None)
            if top is not None:
                delta.logprobs = token_logprobs(completion.logprobs, delta.token_ids, top)
            yield delta
            first = False
    except (InvalidRequest, InvalidAdapter, EngineUnavailable, asyncio.CancelledError):
        raise
    except Exception as e:
        if surface.engine_errored:
            raise EngineUnavailable(f"the engine died: {e}", "Restart the daemon; see its log for the cause.") from e
        if first and isinstance(e, client_errors()):
            # vLLM's own checks of the request when the engine takes it (a token id outside the
            # vocabulary, a regex its grammar compiler refuses, ...): the request's fault.
            raise refusal(e, planned.sampling) from e
        raise


async def generate(surface: Any, sampling: Sampling, adapter: Any = None, **prompt: Any) -> AsyncIterator[Delta]:
    """:func:`plan` and :func:`deltas` in one, for a caller that holds no lease (the self-check,
    benchmarks): ``prompt`` is one of ``messages``, ``prompt`` or ``prompt_token_ids``."""
    planned = await plan(surface, model=surface.served_name, sampling=sampling, **prompt)
    scope = surface.scope(adapter.label if adapter is not None else "", adapter, None)
    async for delta in deltas(surface, planned, planned.params, scope):
        yield delta
