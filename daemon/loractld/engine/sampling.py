"""What a generation asks of the engine (:class:`Sampling`) and what it gets back
(:class:`Delta`), as every door hands them to the core: plain data, no vllm import.

Invariants:
- Every field maps to one of vLLM's OpenAI request fields (``request_fields`` in
  ``loractld.engine.vllm_requests``), and from there to ``SamplingParams`` by vLLM's own code; a door that cannot express a field leaves its neutral default,
  and a door that receives a value it cannot map refuses it by name — nothing is dropped.
- ``Structured`` holds at most one constraint, as vLLM's ``StructuredOutputsParams`` does.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from loractl.errors import InvalidRequest

DEFAULT_MAX_TOKENS = 512  # when a request sets none: this many, fewer where the context ends first


@dataclass
class Structured:
    """One output constraint (vLLM's structured outputs): a JSON schema (as JSON text), any
    JSON object, a regular expression, one of a list of strings, or an EBNF/Lark grammar."""

    json_schema: str | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None

    def kinds(self) -> list[str]:
        """The constraints set, by name (more than one is refused)."""
        return [name for name, value in (("json_schema", self.json_schema), ("json_object", self.json_object or None),
                                         ("regex", self.regex), ("choice", self.choice), ("grammar", self.grammar))
                if value is not None]   # an empty regex is a constraint vLLM accepts: never dropped


@dataclass
class Sampling:
    max_tokens: int | None = None   # None: default_max_tokens, capped by what the context has left
    # The limit an unset max_tokens means: None is the rest of the context (the OpenAI API's
    # meaning); the CLI's requests (gRPC) use DEFAULT_MAX_TOKENS.
    default_max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float = 0.8
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    # vLLM's further sampling fields, at their neutral values.
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    # None: no logprobs; N >= 0: the sampled token's logprob and the N most likely (vLLM's meaning).
    logprobs: int | None = None
    structured: Structured | None = None


@dataclass
class TokenLogprob:
    """One generated token's log-probability and, when asked, the most likely alternatives
    (token id, logprob, text), most likely first."""

    token_id: int
    logprob: float
    text: str = ""
    top: list[tuple[int, float, str]] = field(default_factory=list)


@dataclass
class Delta:
    """One step of a streamed completion."""

    text: str
    token_ids: list[int]
    finish_reason: str | None = None
    prompt_token_ids: list[int] | None = None
    logprobs: list[TokenLogprob] | None = None   # one per token of token_ids, when asked


def fitted(sampling: Sampling, prompt_tokens: int, max_model_len: int) -> Sampling:
    """``sampling`` checked, with max_tokens None filled with what the context leaves."""
    if sampling.max_tokens is None:
        room = max_model_len - prompt_tokens
        if room < 1:
            raise InvalidRequest(f"the prompt ({prompt_tokens} tokens) fills the context of "
                                 f"{max_model_len} tokens", "Shorten the prompt.")
        limit = room if sampling.default_max_tokens is None else min(sampling.default_max_tokens, room)
        sampling = dataclasses.replace(sampling, max_tokens=limit)
    elif sampling.max_tokens > max_model_len - prompt_tokens:
        # Refused, not shortened: a caller that named a length gets it or hears why.
        raise InvalidRequest(f"prompt ({prompt_tokens} tokens) + max_tokens ({sampling.max_tokens}) exceeds "
                             f"the context of {max_model_len} tokens", "Lower --max-tokens or shorten the prompt.")
    if sampling.max_tokens < 1:
        raise InvalidRequest(f"max_tokens must be at least 1, got {sampling.max_tokens}")
    if sampling.min_tokens < 0 or sampling.min_tokens > sampling.max_tokens:
        raise InvalidRequest(f"min_tokens must be between 0 and max_tokens, got {sampling.min_tokens}")
    if sampling.temperature < 0:
        raise InvalidRequest(f"temperature must be >= 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1:
        raise InvalidRequest(f"top_p must be in (0, 1], got {sampling.top_p}")
    return sampling
