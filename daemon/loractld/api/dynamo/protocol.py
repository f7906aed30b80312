"""Dynamo's wire shapes, translated: a tokenized request (the frontend's ``PreprocessedRequest``)
into a :class:`GenerationRequest`, the core's deltas into Dynamo's output chunks, domain errors
into Dynamo's conventions.

Conventions followed (Dynamo's own vLLM worker): each chunk carries only the new ``token_ids``;
the last one adds ``finish_reason`` and ``completion_usage``; a request the client stopped ends
with ``finish_reason: "cancelled"``; a failure after output began ends with
``finish_reason: "error: MESSAGE"``; stop strings are left to the frontend, which detokenizes.
A failure before any output is raised as one of Dynamo's exceptions (see :func:`raised`).
"""

from __future__ import annotations

from typing import Any

from loractl.errors import EngineUnavailable, InvalidRequest, LoractlError, one_line
from loractld.core import Delta, GenerationRequest, Sampling
from loractld.core.policy import Caller

FLEET = Caller("dynamo", fleet=True, peer="dynamo=frontend")  # a fleet placement: see loractld.store.ondemand


def lora_name(request: dict[str, Any], base_names: set[str]) -> str:
    """The adapter a request is for ("" for the base model): the frontend names it in
    ``routing.lora_name`` (and the model in ``model``)."""
    routing = request.get("routing") or {}
    name = routing.get("lora_name") or ""
    if not name:
        model = request.get("model") or ""
        name = "" if not model or model in base_names else model
    if not isinstance(name, str):
        raise InvalidRequest(f"routing.lora_name must be a string, got {type(name).__name__}")
    return name


def generation_request(request: dict[str, Any], lora: str, defaults: dict) -> GenerationRequest:
    """The core's request for one Dynamo request; refuses what loractl cannot do exactly."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
        raise InvalidRequest("a Dynamo request must carry token_ids (a non-empty list of integers)",
                             "Register the model with ModelInput.Tokens: the frontend tokenizes.")
    stop = request.get("stop_conditions") or {}
    options = request.get("sampling_options") or {}
    if (options.get("n") or 1) != 1:
        raise InvalidRequest(f"n={options['n']} is not supported by loractl's Dynamo worker", "Send n=1.")
    if stop.get("ignore_eos"):
        raise InvalidRequest("ignore_eos is not supported by loractl", "Drop ignore_eos from the request.")

    def pick(key: str, default: Any) -> Any:
        value = options.get(key)
        return value if value is not None else defaults.get(key, default)

    top_k = pick("top_k", 0)
    sampling = Sampling(max_tokens=stop.get("max_tokens"), min_tokens=stop.get("min_tokens") or 0,
                        temperature=pick("temperature", 1.0), top_p=pick("top_p", 1.0),
                        top_k=max(0, top_k if top_k is not None else 0), seed=options.get("seed"))
    # allow_folders False: a fleet's clients name stored adapters, never this host's folders.
    # fleet: a fleet's placement may send an adapter this worker never had (loractld --auto-pull).
    return GenerationRequest(prompt_token_ids=token_ids, lora=lora, sampling=sampling, allow_folders=False,
                             caller=FLEET)


def chunk(delta: Delta, prompt_tokens: int, produced: int) -> dict[str, Any]:
    """One output chunk; ``produced`` counts the completion's tokens so far, this delta's included."""
    out: dict[str, Any] = {"token_ids": list(delta.token_ids)}
    if delta.finish_reason:
        out["finish_reason"] = delta.finish_reason
        out["completion_usage"] = usage(prompt_tokens, produced)
    return out


def usage(prompt_tokens: int, produced: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": produced, "total_tokens": prompt_tokens + produced}


def cancelled(prompt_tokens: int, produced: int) -> dict[str, Any]:
    return {"token_ids": [], "finish_reason": "cancelled", "completion_usage": usage(prompt_tokens, produced)}


def failed(error: LoractlError) -> dict[str, Any]:
    return {"token_ids": [], "finish_reason": f"error: {described(error)}"}


def described(error: LoractlError) -> str:
    """The message and its hint on one line: what a fleet's client sees of a failure."""
    return one_line(f"{error.message} ({error.hint})" if error.hint else error.message)


def raised(error: LoractlError, exceptions) -> Exception:
    """The Dynamo exception (from ``dynamo.llm.exceptions``) for a failure before any output.

    Seen with Dynamo 1.6.1's frontend: ``InvalidArgument`` is answered 400 with our message (an
    ``HttpError`` keeps its status but loses the message); ``EngineShutdown`` is answered 503 and
    takes this worker out of routing, which is right only while the engine is draining or dead.
    """
    if isinstance(error, EngineUnavailable):
        return exceptions.EngineShutdown(described(error))
    return exceptions.InvalidArgument(described(error))
