"""``loractl run``: one prompt, one streamed answer."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from loractl.cli import _sampling as opts
from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, print_json, with_client
from loractl.cli._complete import adapter_names
from loractl.cli._output import cli_errors, waiting_notice
from loractl.errors import InvalidRequest

# How long run and chat wait for a daemon whose engine is still starting (a cold start of a
# large model can take minutes); they say so on stderr while they wait.
ENGINE_START_TIMEOUT_S = 600.0

if TYPE_CHECKING:
    from loractl.client import Client

LoraOpt = Annotated[
    str | None,
    typer.Option("--lora", "-l", help="Adapter or profile to answer with: a store name (loractl ls) or a PEFT folder. "
                 "Default: the base model.",
                 autocompletion=adapter_names),
]


def run(
    prompt: Annotated[str, typer.Argument(help="The prompt; '-' reads it from stdin.")],
    lora: LoraOpt = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", "-n", min=1, help="Most tokens to generate (default: 512, fewer where the context ends first).",
    )] = None,
    temperature: opts.TemperatureOpt = None,
    top_p: opts.TopPOpt = None,
    top_k: opts.TopKOpt = None,
    stop: opts.StopOpt = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed, for repeatable samples.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    json_schema: opts.JsonSchemaOpt = None,
    json_object: opts.JsonObjectOpt = False,
    regex: opts.RegexOpt = None,
    choice: opts.ChoiceOpt = None,
    grammar: opts.GrammarOpt = None,
    min_p: opts.MinPOpt = None,
    presence_penalty: opts.PresencePenaltyOpt = None,
    frequency_penalty: opts.FrequencyPenaltyOpt = None,
    repetition_penalty: opts.RepetitionPenaltyOpt = None,
    logit_bias: opts.LogitBiasOpt = None,
    stop_token_ids: opts.StopTokenIdsOpt = None,
    ignore_eos: opts.IgnoreEosOpt = False,
    logprobs: opts.LogprobsOpt = None,
    json_output: JsonOpt = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
) -> None:
    """Answer PROMPT, streaming tokens to stdout as they arrive.

    The prompt goes through the model's chat template as one user message, unless --raw.
    The sampling options are vLLM's, with its names and ranges; at most one of --json-schema,
    --json-object, --regex, --choice and --grammar constrains the answer. --json prints the
    whole answer as one JSON object at the end (text, token ids, finish reason, usage, and with
    --logprobs each token's logprob).

    Examples:

        loractl run "Write a query that counts users"

        loractl run --lora ./adapters/sql-expert --temperature 0 "List all tables"

        echo "Summarise this" | loractl run -

        loractl run --json-schema person.schema.json "Invent a person"

        loractl run --choice yes,no "Is SQL declarative?"

        loractl run --regex '[0-9]{4}-[0-9]{2}-[0-9]{2}' "When did Apollo 11 land?"

        loractl run -t 0 --json --logprobs 3 "Count to three"
    """
    with cli_errors():
        if logprobs is not None and not json_output:
            raise InvalidRequest("--logprobs shows logprobs in the --json output only", "Add --json.")
        kwargs = dict(lora=lora, max_tokens=max_tokens, temperature=temperature, seed=seed, logprobs=logprobs,
                      **opts.structured_kwargs(json_schema, json_object, regex, choice, grammar),
                      **opts.sampling_kwargs(min_p, presence_penalty, frequency_penalty, repetition_penalty,
                                             logit_bias, stop_token_ids, ignore_eos,
                                             top_p=top_p, top_k=top_k, stop=stop))
    if prompt == "-":
        prompt = sys.stdin.read()

    async def stream(client: Client) -> None:
        # With several daemons, the one holding this adapter (chosen at the first call).
        client.prefer_adapter = lora
        # A daemon still starting its engine would hold the request silently for as long.
        info = await client.wait_ready(ENGINE_START_TIMEOUT_S, on_wait=waiting_notice())
        chunks = (client.generate(prompt, **kwargs) if raw
                  else client.generate(messages=[{"role": "user", "content": prompt}], **kwargs))
        from loractl.cli._progress import woken

        chunks = woken(info, chunks)   # a notice while the request wakes a sleeping engine (--keep-alive)
        if json_output:
            print_json(await answer(chunks, with_logprobs=logprobs is not None))
            return
        printed = False
        async for chunk in chunks:
            if chunk.text:
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
                printed = True
        sys.stdout.write("\n")
        sys.stdout.flush()
        if not printed:  # an empty line and exit 0 would read as a hang-up or a bug
            print("loractl: the model answered with no text (it ended its answer at once)", file=sys.stderr)

    with_client(socket, home, stream)


async def answer(chunks, with_logprobs: bool) -> dict:
    """A streamed answer, whole, as ``run --json`` prints it."""
    result = {"text": "", "token_ids": [], "finish_reason": "", "adapter": "", "prompt_tokens": 0,
              "completion_tokens": 0}
    logprobs = []
    async for chunk in chunks:
        result["text"] += chunk.text
        result["token_ids"] += chunk.token_ids
        logprobs += chunk.logprobs
        for name in ("finish_reason", "adapter", "prompt_tokens", "completion_tokens"):
            result[name] = getattr(chunk, name) or result[name]
    if with_logprobs:
        result["logprobs"] = opts.logprob_dicts(logprobs)
    return result


def register(app: typer.Typer) -> None:
    app.command("run")(run)
