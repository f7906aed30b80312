"""Dynamo's wire shapes, translated: a tokenized request (the frontend's ``PreprocessedRequest``)
into a :class:`GenerationRequest`, the core's deltas into Dynamo's output chunks, domain errors
into Dynamo's conventions.

Every option the frontend sends is taken the way Dynamo's own vLLM worker takes it (ai-dynamo
1.6.1, ``dynamo/vllm/handlers.py``: ``build_sampling_params``, ``generate_tokens``), left to the
frontend where the frontend does that part itself (stop strings, detokenizing), or refused by
name with an :class:`InvalidRequest`: nothing is dropped. A key this module does not know, in
``sampling_options``, ``stop_conditions``, ``output_options`` or ``guided_decoding``, passes only
at a neutral value (None, false, 0, empty): a field a later frontend adds is refused, not ignored.

Conventions followed (Dynamo's own vLLM worker): each chunk carries only the new ``token_ids``
and its choice's ``index``; with logprobs, ``log_probs`` (one per token) and ``top_logprobs``;
a choice's last chunk adds ``finish_reason`` and ``completion_usage`` (the completion tokens of
every choice so far); a request the client stopped ends with ``finish_reason: "cancelled"``; a
failure after output began ends with ``finish_reason: "error: MESSAGE"``. A failure before any
output is raised as one of Dynamo's exceptions (see :func:`raised`).
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any

from loractl.errors import EngineUnavailable, InvalidRequest, LoractlError, one_line
from loractld.core import Delta, GenerationRequest, Prepared, Sampling, Structured, TokenLogprob
from loractld.core.policy import Caller

FLEET = Caller("dynamo", fleet=True, peer="dynamo=frontend")  # a fleet placement: see loractld.core.ondemand

MAX_CHOICES = 128               # n per request (the HTTP door's default --http-max-choices)
FULL_VOCABULARY = 2 ** 32 - 1   # Dynamo's logprobs value for "every token of the vocabulary"
MIN_FINITE_LOGPROB = -1e30      # what Dynamo's worker sends for -inf (JSON has no infinity)

# Options the frontend applies itself (it detokenizes and matches stop strings): the worker has
# nothing to do, as Dynamo's vLLM worker has not (it never sets them on vLLM).
FRONTEND_SAMPLING = {"include_stop_str_in_output"}
FRONTEND_STOP = {"stop"}
FRONTEND_OUTPUT = {"skip_special_tokens", "formatted_prompt", "return_tokens_as_token_ids", "no_stop_trim"}
# Sampling fields Dynamo's worker sets on vLLM's SamplingParams as given, over the model's defaults.
PLAIN_SAMPLING = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")
VLLM_DEFAULTS = {"temperature": 1.0, "top_p": 1.0, "top_k": 0, "min_p": 0.0, "presence_penalty": 0.0,
                 "frequency_penalty": 0.0, "repetition_penalty": 1.0}
# Structured-output backends: vLLM 0.32 picks one per engine, not per request.
CHOSEN_BACKEND = {None, "", "auto"}
# Prompt parts loractl does not take: it serves token prompts of a text model.
PROMPT_PARTS = ("prompt_embeds", "multi_modal_data", "mm_processor_kwargs")


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


def refused(field: str, why: str, hint: str) -> InvalidRequest:
    return InvalidRequest(f"{field} is not supported by loractl's Dynamo worker: {why}", hint)


def neutral(value: Any) -> bool:
    """None, false, 0 or empty: a value that asks for nothing."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, (str, list, dict)) and not value


def unknown(options: dict[str, Any], known: set[str], where: str) -> None:
    """Refuse, by name, a key this worker does not know set to anything but a neutral value."""
    for key, value in options.items():
        if key not in known and not neutral(value):
            raise refused(f"{where}.{key}", f"unknown option (value {one_line(json.dumps(value))[:60]})",
                          "Leave it out, or use a loractl that maps it (this frontend is newer than the worker).")


def _section(request: dict[str, Any], key: str) -> dict[str, Any]:
    value = request.get(key) or {}
    if not isinstance(value, dict):
        raise InvalidRequest(f"{key} must be an object, got {type(value).__name__}")
    return value


def sampling_options(request: dict[str, Any]) -> dict[str, Any]:
    """``sampling_options``, with ``extra_args.sampling_options`` over it (as Dynamo's worker)."""
    options = dict(_section(request, "sampling_options"))
    extra = request.get("extra_args") or {}
    if isinstance(extra, dict) and isinstance(extra.get("sampling_options"), dict):
        options.update(extra["sampling_options"])
    return options


def choices(request: dict[str, Any]) -> int:
    """How many completions the request asks for (``sampling_options.n``)."""
    n = sampling_options(request).get("n")
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= MAX_CHOICES:
        raise InvalidRequest(f"n must be an integer from 1 to {MAX_CHOICES}, got {n!r}",
                             "Ask for fewer choices per request, or send several requests.")
    return n


def generation_request(request: dict[str, Any], lora: str, defaults: dict) -> GenerationRequest:
    """The core's request for one Dynamo request (one choice of it: see :func:`copies`);
    refuses by name what loractl cannot do exactly."""
    token_ids = request.get("token_ids")
    if not isinstance(token_ids, list) or not token_ids or not all(isinstance(t, int) for t in token_ids):
        raise InvalidRequest("a Dynamo request must carry token_ids (a non-empty list of integers)",
                             "Register the model with ModelInput.Tokens: the frontend tokenizes.")
    for part in PROMPT_PARTS:
        if not neutral(request.get(part)):
            raise refused(part, "loractl serves text prompts as token ids",
                          "Send a text-only request (no images, audio or prompt embeddings).")
    extra = request.get("extra_args") or {}
    nvext = extra.get("nvext") if isinstance(extra, dict) else None
    if isinstance(nvext, dict) and not neutral(nvext.get("cache_salt")):
        raise refused("nvext.cache_salt", "loractl's engine shares its prefix cache between requests",
                      "Leave cache_salt out.")
    options, stop = sampling_options(request), _section(request, "stop_conditions")
    sampling = Sampling(**_from_sampling_options(options, defaults), **_from_stop_conditions(stop, defaults),
                        logprobs=_from_output_options(_section(request, "output_options")))
    # What the request set itself: a profile's parameters fill the rest (over the model's
    # defaults, which an unset field takes here and which a profile's value replaces).
    given = {key for key in (*PLAIN_SAMPLING, "top_k", "seed") if options.get(key) is not None} | \
        {key for key in ("max_tokens", "min_tokens") if stop.get(key) is not None}
    # allow_folders False: a fleet's clients name stored adapters, never this host's folders.
    # fleet: a fleet's placement may send an adapter this worker never had (loractld --auto-pull).
    return GenerationRequest(prompt_token_ids=token_ids, lora=lora, sampling=sampling, allow_folders=False,
                             caller=FLEET, given_sampling=frozenset(given))


def _from_sampling_options(options: dict[str, Any], defaults: dict) -> dict[str, Any]:
    unknown(options, {*PLAIN_SAMPLING, "top_k", "seed", "n", "best_of", "use_beam_search", "length_penalty",
                      "guided_decoding", *FRONTEND_SAMPLING}, "sampling_options")
    n = options.get("n") or 1
    if options.get("use_beam_search"):
        raise refused("use_beam_search", "vLLM 0.32 has no beam search", "Drop use_beam_search: sampling is used.")
    if options.get("best_of") not in (None, n):
        raise refused("best_of", f"best_of={options['best_of']} with n={n} (vLLM 0.32 has no best_of)",
                      "Ask for n choices and pick among them yourself.")
    if options.get("length_penalty") not in (None, 1, 1.0):
        raise refused("length_penalty", "it applies to beam search, which vLLM 0.32 does not have",
                      "Drop length_penalty.")

    def pick(key: str) -> Any:
        value = options.get(key)
        return value if value is not None else defaults.get(key, VLLM_DEFAULTS[key])

    fields = {key: pick(key) for key in PLAIN_SAMPLING}
    top_k = pick("top_k")
    if isinstance(top_k, int) and not isinstance(top_k, bool) and top_k < -1:
        raise InvalidRequest(f"invalid top_k: {top_k}", "Use -1 or 0 (every token) or a positive number.")
    fields["top_k"] = max(0, top_k) if isinstance(top_k, int) else top_k
    fields["seed"] = options.get("seed")
    fields["structured"] = _structured(options.get("guided_decoding"))
    return fields


def _structured(guided: Any) -> Structured | None:
    """``guided_decoding`` as vLLM's structured outputs (one constraint: the engine checks)."""
    if guided is None:
        return None
    if not isinstance(guided, dict):
        raise InvalidRequest(f"guided_decoding must be an object, got {type(guided).__name__}")
    unknown(guided, {"json", "regex", "choice", "grammar", "backend", "whitespace_pattern", "structural_tag"},
            "guided_decoding")
    if guided.get("backend") not in CHOSEN_BACKEND:
        raise refused("guided_decoding.backend", f"{guided['backend']!r}: the engine picks its structured-output "
                      "backend itself (vLLM's auto: xgrammar, else guidance)", "Leave guided_decoding_backend out.")
    for key in ("whitespace_pattern", "structural_tag"):
        if not neutral(guided.get(key)):
            raise refused(f"guided_decoding.{key}", "loractl's structured outputs take a JSON schema, a regex, "
                          "a choice or a grammar", f"Drop {key}.")
    schema = guided.get("json")
    if schema is not None and not isinstance(schema, str):
        schema = json.dumps(schema)  # Dynamo's worker hands vLLM the object; the core takes its JSON text
    structured = Structured(json_schema=schema, regex=guided.get("regex"), choice=guided.get("choice") or None,
                            grammar=guided.get("grammar"))
    return structured if structured.kinds() else None


def _from_stop_conditions(stop: dict[str, Any], defaults: dict) -> dict[str, Any]:
    unknown(stop, {"max_tokens", "min_tokens", "stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible",
                   "ignore_eos", "max_thinking_tokens", *FRONTEND_STOP}, "stop_conditions")
    if stop.get("max_thinking_tokens") is not None:
        raise refused("max_thinking_tokens", "loractl has no thinking budget", "Drop max_thinking_tokens.")
    # Dynamo's worker stops vLLM at stop_token_ids and the hidden ones (the model's EOS among
    # them); the visible ones too here, where vLLM keeps the stop token in the output's token ids
    # and the frontend shows or hides its text.
    stop_ids: list[int] = []
    for key in ("stop_token_ids", "stop_token_ids_hidden", "stop_token_ids_visible"):
        ids = stop.get(key) or []
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise InvalidRequest(f"stop_conditions.{key} must be a list of token ids")
        stop_ids += ids
    return {"max_tokens": stop.get("max_tokens"), "default_max_tokens": defaults.get("max_tokens"),
            "min_tokens": stop.get("min_tokens") or 0, "ignore_eos": bool(stop.get("ignore_eos")),
            "stop_token_ids": list(dict.fromkeys(stop_ids))}


def _from_output_options(output: dict[str, Any]) -> int | None:
    """``Sampling.logprobs``: None, or the sampled token's logprob and the N most likely."""
    unknown(output, {"logprobs", "prompt_logprobs", *FRONTEND_OUTPUT}, "output_options")
    if output.get("prompt_logprobs") is not None:
        raise refused("prompt_logprobs", "loractl returns the logprobs of generated tokens only",
                      "Drop echo (completions) or prompt_logprobs; ask for logprobs of the completion.")
    logprobs = output.get("logprobs")
    if logprobs is None:
        return None
    if logprobs == FULL_VOCABULARY:
        raise refused("logprobs", "logprobs of the whole vocabulary", "Ask for the N most likely tokens (N <= 20).")
    if not isinstance(logprobs, int) or isinstance(logprobs, bool) or logprobs < 0:
        raise InvalidRequest(f"invalid logprobs: {logprobs!r}", "Use a number of top tokens, 0 or more.")
    return logprobs


def copies(prepared: Prepared, n: int) -> list[Prepared]:
    """The ``n`` choices of a prepared request: with a seed, choice i samples with seed + i (as
    vLLM's own n > 1 does); they share the prepared request's lease (``Core.run``)."""
    if n == 1:
        return [prepared]
    seed = prepared.sampling.seed
    return [dataclasses.replace(prepared, sampling=dataclasses.replace(
        prepared.sampling, seed=None if seed is None else seed + i)) for i in range(n)]


def chunk(delta: Delta, prompt_tokens: int, produced: int, index: int = 0) -> dict[str, Any]:
    """One output chunk of choice ``index``; ``produced`` counts the completion tokens of every
    choice so far, this delta's included."""
    out: dict[str, Any] = {"index": index, "token_ids": list(delta.token_ids)}
    if delta.logprobs:
        out["log_probs"] = [_finite(t.logprob) for t in delta.logprobs]
        out["top_logprobs"] = [_top(t) for t in delta.logprobs]
    if delta.finish_reason:
        out["finish_reason"] = delta.finish_reason
        out["completion_usage"] = usage(prompt_tokens, produced)
    return out


def _finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else MIN_FINITE_LOGPROB


def _top(token: TokenLogprob) -> list[dict[str, Any]]:
    """One position's ``top_logprobs`` as Dynamo's vLLM worker sends vLLM's logprob dict: the
    sampled token first, then the most likely others, each with its rank (1 the most likely).
    A sampled token outside the top N gets rank N + 1: the core does not keep its exact rank."""
    ranked = [token_id for token_id, _, _ in token.top]
    rank = ranked.index(token.token_id) + 1 if token.token_id in ranked else len(ranked) + 1
    entries = [_entry(rank, token.token_id, token.logprob, token.text)]
    entries += [_entry(i, token_id, logprob, text) for i, (token_id, logprob, text) in enumerate(token.top, 1)
                if token_id != token.token_id]
    return entries


def _entry(rank: int, token_id: int, logprob: float, text: str) -> dict[str, Any]:
    # No text: the frontend decodes the token id itself.
    return {"rank": rank, "token_id": token_id, "token": text or None, "logprob": _finite(logprob),
            "bytes": list(text.encode()) if text else None}


def usage(prompt_tokens: int, produced: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": produced, "total_tokens": prompt_tokens + produced}


def cancelled(prompt_tokens: int, produced: int, index: int = 0) -> dict[str, Any]:
    return {"index": index, "token_ids": [], "finish_reason": "cancelled",
            "completion_usage": usage(prompt_tokens, produced)}


def failed(error: LoractlError, index: int = 0) -> dict[str, Any]:
    return {"index": index, "token_ids": [], "finish_reason": f"error: {described(error)}"}


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
