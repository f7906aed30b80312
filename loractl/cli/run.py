"""``loractl run``: one prompt, one streamed answer."""

from __future__ import annotations

import sys
from typing import TYPE_CHECKING, Annotated

import typer

from loractl.cli._common import HomeOpt, SocketOpt, with_client
from loractl.cli._complete import adapter_names
from loractl.cli._output import waiting_notice

# How long run and chat wait for a daemon whose engine is still starting (a cold start of a
# large model can take minutes); they say so on stderr while they wait.
ENGINE_START_TIMEOUT_S = 600.0

if TYPE_CHECKING:
    from loractl.client import Client

LoraOpt = Annotated[
    str | None,
    typer.Option("--lora", "-l", help="Adapter to answer with: a store name (loractl ls) or a PEFT folder. Default: the base model.",
                 autocompletion=adapter_names),
]


def run(
    prompt: Annotated[str, typer.Argument(help="The prompt; '-' reads it from stdin.")],
    lora: LoraOpt = None,
    max_tokens: Annotated[int | None, typer.Option(
        "--max-tokens", "-n", min=1, help="Most tokens to generate (default: 512, fewer where the context ends first).",
    )] = None,
    temperature: Annotated[float, typer.Option("--temperature", "-t", min=0.0,
                                               help="Sampling temperature; 0 is greedy.")] = 0.8,
    seed: Annotated[int | None, typer.Option("--seed", help="Sampling seed, for repeatable samples.")] = None,
    raw: Annotated[bool, typer.Option("--raw", help="Send the prompt as is, without the chat template.")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
) -> None:
    """Answer PROMPT, streaming tokens to stdout as they arrive.

    The prompt goes through the model's chat template as one user message, unless --raw.

    Examples:

        loractl run "Write a query that counts users"

        loractl run --lora ./adapters/sql-expert --temperature 0 "List all tables"

        echo "Summarise this" | loractl run -
    """
    if prompt == "-":
        prompt = sys.stdin.read()

    async def stream(client: Client) -> None:
        # With several daemons, the one holding this adapter (chosen at the first call).
        client.prefer_adapter = lora
        # A daemon still starting its engine would hold the request silently for as long.
        await client.wait_ready(ENGINE_START_TIMEOUT_S, on_wait=waiting_notice())
        kwargs = dict(lora=lora, max_tokens=max_tokens, temperature=temperature, seed=seed)
        chunks = (client.generate(prompt, **kwargs) if raw
                  else client.generate(messages=[{"role": "user", "content": prompt}], **kwargs))
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


def register(app: typer.Typer) -> None:
    app.command("run")(run)
