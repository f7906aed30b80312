"""The sampling options ``run`` and ``chat`` share, with vLLM's names and ranges, and the
structured-output options of ``run``; ``sampling_kwargs`` and ``structured_kwargs`` turn them
into :meth:`loractl.Client.generate`'s keyword arguments.

Invariant: a value the CLI cannot read (an unreadable or non-JSON schema file, a token id that
is not a number) is an ``InvalidRequest`` naming the option, raised before any request; the
values only the engine can judge (a regex, a grammar, a schema's keywords, a range) go to the
daemon, which refuses them by name.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Annotated, Any

import typer

from loractl.errors import InvalidRequest

# No default of the CLI's own: the daemon's (0.8) applies, or a profile's (loractl create
# --param temperature=0) — a value sent always would override the profile's.
TemperatureOpt = Annotated[float | None, typer.Option(
    "--temperature", "-t", min=0.0, help="Sampling temperature; 0 is greedy (default: 0.8, or the profile's).")]
TopPOpt = Annotated[float | None, typer.Option(
    "--top-p", min=0.0, max=1.0,
    help="Sample from the most likely tokens that together reach this probability (above 0, at most 1).")]
TopKOpt = Annotated[int | None, typer.Option(
    "--top-k", min=-1, help="Sample from this many most likely tokens; 0 or -1 is all of them.")]
StopOpt = Annotated[list[str] | None, typer.Option(
    "--stop", metavar="TEXT", help="End the answer before TEXT (not printed); repeatable, e.g. --stop ';'.")]
MinPOpt = Annotated[float | None, typer.Option(
    "--min-p", min=0.0, max=1.0, help="Drop tokens less likely than this fraction of the most likely one (0 to 1).")]
PresencePenaltyOpt = Annotated[float | None, typer.Option(
    "--presence-penalty", min=-2.0, max=2.0, help="Penalise tokens already generated, once each (-2 to 2).")]
FrequencyPenaltyOpt = Annotated[float | None, typer.Option(
    "--frequency-penalty", min=-2.0, max=2.0, help="Penalise tokens by how often they were generated (-2 to 2).")]
RepetitionPenaltyOpt = Annotated[float | None, typer.Option(
    "--repetition-penalty", help="Above 1 discourages repeating prompt and output tokens; 1 is off.")]
LogitBiasOpt = Annotated[list[str] | None, typer.Option(
    "--logit-bias", metavar="ID=BIAS", help="Add BIAS (-100 to 100) to token ID's logit; repeatable, e.g. --logit-bias 65=100.")]
StopTokenIdsOpt = Annotated[str | None, typer.Option(
    "--stop-token-ids", metavar="ID,ID", help="Stop at any of these token ids, e.g. --stop-token-ids 2,13.")]
IgnoreEosOpt = Annotated[bool, typer.Option(
    "--ignore-eos", help="Go on past the end-of-sequence token, up to --max-tokens.")]

JsonSchemaOpt = Annotated[Path | None, typer.Option(
    "--json-schema", metavar="FILE", help="Answer with JSON valid against the JSON schema in FILE.")]
JsonObjectOpt = Annotated[bool, typer.Option("--json-object", help="Answer with a JSON object.")]
RegexOpt = Annotated[str | None, typer.Option(
    "--regex", metavar="PATTERN", help="Answer with text that matches PATTERN, e.g. --regex '[0-9]{3}'.")]
ChoiceOpt = Annotated[str | None, typer.Option(
    "--choice", metavar="A,B", help="Answer with exactly one of these strings, e.g. --choice yes,no.")]
GrammarOpt = Annotated[Path | None, typer.Option(
    "--grammar", metavar="FILE", help="Answer with text the EBNF (GBNF) or Lark grammar in FILE accepts.")]
LogprobsOpt = Annotated[int | None, typer.Option(
    "--logprobs", metavar="N", min=0,
    help="With --json: each token's logprob and the N most likely tokens at its place.")]


def sampling_kwargs(min_p: float | None = None, presence_penalty: float | None = None,
                    frequency_penalty: float | None = None, repetition_penalty: float | None = None,
                    logit_bias: list[str] | None = None, stop_token_ids: str | None = None,
                    ignore_eos: bool = False, *, top_p: float | None = None, top_k: int | None = None,
                    stop: list[str] | None = None) -> dict[str, Any]:
    """The options as :meth:`Client.generate` takes them; only those given (an unset one leaves
    the daemon's default, or a profile's, in force)."""
    kwargs: dict[str, Any] = {name: value for name, value in (
        ("min_p", min_p), ("presence_penalty", presence_penalty), ("frequency_penalty", frequency_penalty),
        ("repetition_penalty", repetition_penalty), ("top_p", top_p), ("top_k", top_k)) if value is not None}
    if stop:
        if not all(stop):
            raise InvalidRequest("--stop '' is empty: it would end every answer at once",
                                 "Give the text that ends an answer, e.g. --stop ';'.")
        kwargs["stop"] = list(stop)
    if logit_bias:
        kwargs["logit_bias"] = dict(_bias(item) for item in logit_bias)
    if stop_token_ids:
        kwargs["stop_token_ids"] = [_token_id(item, "--stop-token-ids", "--stop-token-ids 2,13")
                                    for item in stop_token_ids.split(",")]
    if ignore_eos:
        kwargs["ignore_eos"] = True
    return kwargs


def structured_kwargs(json_schema: Path | None = None, json_object: bool = False, regex: str | None = None,
                      choice: str | None = None, grammar: Path | None = None) -> dict[str, Any]:
    """The structured-output options as :meth:`Client.generate` takes them (the daemon refuses
    more than one, naming them)."""
    kwargs: dict[str, Any] = {}
    if json_schema is not None:
        text = _read(json_schema, "--json-schema", "a JSON schema")
        try:
            schema = json.loads(text)
        except json.JSONDecodeError as e:
            raise InvalidRequest(f"--json-schema {json_schema}: not JSON: {e}",
                                 "Give a file holding one JSON schema, e.g. {\"type\": \"object\"}.") from None
        if not isinstance(schema, (dict, bool)):
            raise InvalidRequest(f"--json-schema {json_schema}: a JSON schema is an object, not {type(schema).__name__}",
                                 "Give a file holding one JSON schema, e.g. {\"type\": \"object\"}.")
        kwargs["json_schema"] = text
    if json_object:
        kwargs["json_object"] = True
    if regex is not None:
        kwargs["regex"] = regex
    if choice is not None:
        choices = [item.strip() for item in choice.split(",")]
        if not all(choices):
            raise InvalidRequest(f"--choice {choice!r} holds an empty choice",
                                 "Give the strings separated by commas, e.g. --choice yes,no.")
        kwargs["choice"] = choices
    if grammar is not None:
        kwargs["grammar"] = _read(grammar, "--grammar", "a grammar")
    return kwargs


def logprob_dicts(logprobs) -> list[dict[str, Any]]:
    """``Chunk.logprobs`` as JSON-ready dicts."""
    return [{"token_id": t.token_id, "logprob": t.logprob, "text": t.text,
             "top": [{"token_id": i, "logprob": p, "text": text} for i, p, text in t.top]} for t in logprobs]


def _read(path: Path, option: str, what: str) -> str:
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        reason = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
        raise InvalidRequest(f"{option} {path}: cannot read it: {reason}",
                             f"Give a readable UTF-8 file holding {what}.") from None
    if not text.strip():
        raise InvalidRequest(f"{option} {path}: the file is empty", f"Give a file holding {what}.")
    return text


def _token_id(text: str, option: str, example: str) -> int:
    try:
        return int(text.strip())
    except ValueError:
        raise InvalidRequest(f"{option}: {text.strip()!r} is not a token id",
                             f"Give whole numbers (token ids), e.g. {example}.") from None


def _bias(item: str) -> tuple[int, float]:
    token, sep, bias = item.partition("=")
    if not sep:
        raise InvalidRequest(f"--logit-bias {item!r}: not ID=BIAS", "Give a token id and a bias, e.g. --logit-bias 65=100.")
    token_id = _token_id(token, "--logit-bias", "--logit-bias 65=100")
    try:
        value = float(bias)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):
        raise InvalidRequest(f"--logit-bias {item!r}: {bias.strip()!r} is not a number",
                             "Give a token id and a bias, e.g. --logit-bias 65=-100.")
    return token_id, value
