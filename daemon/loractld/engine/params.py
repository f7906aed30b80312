"""vLLM's refusals of a request's sampling fields as :class:`InvalidRequest`, and vLLM's sample
logprobs as :class:`TokenLogprob` (``Sampling`` becomes ``SamplingParams`` in
``loractld.engine.vllm_requests``, through vLLM's own request models).

Invariants:
- A value vLLM refuses, when its request model validates it, when it makes the
  ``SamplingParams`` or when the engine takes the request (structured-output grammars are
  compiled there), is an ``InvalidRequest`` that names the field.
- vllm is imported from its modules inside the functions: importing this module costs nothing.
"""

from __future__ import annotations

from typing import Any

from loractl.errors import InvalidRequest
from loractld.engine.sampling import Sampling, TokenLogprob

# Sampling's fields and vLLM's: only ``structured`` (vLLM: structured_outputs) and ``top_k``
# (0 here means off, vLLM's -1 accepted too) differ.
_PLAIN = ("min_tokens", "temperature", "top_p", "seed", "min_p", "presence_penalty", "frequency_penalty",
          "repetition_penalty", "ignore_eos", "logprobs")
_STRUCTURED = ("json_schema", "json_object", "regex", "choice", "grammar")


def _text(error: Exception) -> str:
    """vLLM's whole message (InvalidRequest folds it onto one line): a grammar compiler's
    reason comes on the lines after its first."""
    return str(error).strip() or type(error).__name__


def client_errors() -> tuple[type[Exception], ...]:
    """What vLLM raises for a request it refuses: VLLMClientError (0.32), ValueError before."""
    try:
        from vllm.exceptions import VLLMClientError
    except ImportError:
        return (ValueError,)
    return (ValueError, VLLMClientError)


def refused_field(error: Exception, sampling: Sampling) -> str | None:
    """The field vLLM's ``error`` is about: the one it names, else the structured-output
    constraint when the request has one and the error is about structured outputs."""
    parameter = getattr(error, "parameter", None)
    if parameter:
        return str(parameter)
    text = str(error)
    kinds = sampling.structured.kinds() if sampling.structured is not None else []
    if kinds and any(word in text.lower() for word in ("structured", "grammar", "regex", "json", "choice", "schema")):
        return kinds[0]
    names = [name for name in (*_PLAIN, "top_k", "stop_token_ids", "logit_bias", "stop", "max_tokens") if name in text]
    # The first named (vLLM's messages start with the field), the longest where two start there.
    return min(names, key=lambda name: (text.index(name), -len(name))) if names else None


def refusal(error: Exception, sampling: Sampling, what: str = "the engine refused the request") -> InvalidRequest:
    """vLLM's refusal of ``sampling`` as one line that names the field, with a hint."""
    name = refused_field(error, sampling)
    message = _text(error)
    if name is None:
        return InvalidRequest(f"{what}: {message}", "Check the prompt's tokens and the sampling parameters.")
    hint = (f"Fix the {name} constraint, or leave it out." if name in _STRUCTURED
            else f"Give {name} a value vLLM accepts (the message says which).")
    return InvalidRequest(f"invalid {name}: {message}", hint)


def token_logprobs(logprobs: Any, token_ids: Any, top: int) -> list[TokenLogprob]:
    """One :class:`TokenLogprob` per token of ``token_ids`` from vLLM's sample logprobs of the
    same tokens (a ``FlatLogprobs``, or a list of {token id: Logprob}): the sampled token's
    logprob and text, and the ``top`` most likely tokens, most likely first.

    A position lists the sampled token first, then the top ranks; where vLLM merged two
    outputs of a stream (``RequestOutput.add``: a slow reader) a flat position went through a
    dict, which keeps a token once. So the top tokens are taken by rank, not by place."""
    if logprobs is None:
        return []
    out: list[TokenLogprob] = []
    starts = getattr(logprobs, "start_indices", None)
    if starts is not None:  # FlatLogprobs: lists, no objects per token
        ids, values, ranks, texts = logprobs.token_ids, logprobs.logprobs, logprobs.ranks, logprobs.decoded_tokens
        for position, token_id in enumerate(token_ids):
            start, end = starts[position], logprobs.end_indices[position]
            best = {ids[i]: (ranks[i], values[i], texts[i]) for i in range(start, end)
                    if ranks[i] is not None and ranks[i] <= top}
            out.append(TokenLogprob(token_id=token_id, logprob=values[start], text=texts[start] or "",
                                    top=_ranked(best)))
        return out
    for token_id, position in zip(token_ids, logprobs):
        sampled = position[token_id]
        best = {i: (p.rank, p.logprob, p.decoded_token) for i, p in position.items()
                if p.rank is not None and p.rank <= top}
        out.append(TokenLogprob(token_id=token_id, logprob=sampled.logprob, text=sampled.decoded_token or "",
                                top=_ranked(best)))
    return out


def _ranked(best: dict[int, tuple[int, float, str | None]]) -> list[tuple[int, float, str]]:
    return [(i, logprob, text or "") for i, (_, logprob, text) in sorted(best.items(), key=lambda item: item[1][0])]
