"""Profiles: ``loractl create`` (from a Modelfile and/or flags) and ``loractl cp``.

The CLI parses nothing of a Modelfile: it sends the file's text and the flags, and the daemon
reads both (``loractld/store/modelfile.py``), refusing a line it cannot honour by its number.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, print_json, stdout, with_client
from loractl.cli._complete import adapter_names
from loractl.errors import InvalidRequest
from loractl.cli._output import fail
from loractl.cli.listing import describe


def create(
    name: Annotated[str, typer.Argument(help="The profile's name, e.g. sql-assistant (a model name, as adapters have).")],
    file: Annotated[str | None, typer.Option("--file", "-f", help="A Modelfile (Ollama's syntax; - reads stdin).")] = None,
    base: Annotated[str | None, typer.Option("--from", help="FROM: the base model, a stored adapter or a profile.",
                                             autocompletion=adapter_names)] = None,
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="ADAPTER NAME[=WEIGHT]; repeat to merge several.",
                                                      autocompletion=adapter_names)] = None,
    system: Annotated[str | None, typer.Option("--system", help="SYSTEM: the system prompt.")] = None,
    template: Annotated[str | None, typer.Option("--template", help="TEMPLATE: a file with a Jinja chat template.")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", help="PARAMETER NAME=VALUE (Ollama's names; "
                                                    "stop repeats), e.g. temperature=0.")] = None,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Make a profile: a named model of an adapter (or the base model) with its own defaults.

    A profile adds a system prompt, default parameters, few-shot messages and a chat template
    (a Modelfile in Ollama's syntax). Every door serves it by name.

    Flags override the Modelfile's lines; a request's own values override the profile's.

    Examples:

        loractl create sql-assistant -f Modelfile

        loractl create sql-assistant --from sql-expert/v1 --system "Answer in SQL." --param temperature=0 --param stop=";"

        loractl run --lora sql-assistant "list the tables"
    """
    text = ""
    if file is not None:
        try:
            text = sys.stdin.read() if file == "-" else Path(file).read_text()
        except OSError as e:
            raise fail(InvalidRequest(f"cannot read {file}: {e.strerror}", "Give the Modelfile's path with -f.")) from e
    template_text = None
    if template is not None:
        try:
            template_text = Path(template).read_text()
        except OSError as e:
            raise fail(InvalidRequest(f"cannot read {template}: {e.strerror}",
                                      "Give a file holding a Jinja chat template.")) from e
    if not text and base is None:
        raise fail(InvalidRequest("nothing to create from", "Give a Modelfile (-f Modelfile) or --from BASE."))
    params: dict[str, list[str]] = {}
    for item in param or []:
        key, sep, value = item.partition("=")
        if not sep:
            raise fail(InvalidRequest(f"--param {item!r} is not NAME=VALUE", "Write e.g. --param temperature=0."))
        params.setdefault(key.strip(), []).append(value)
    reply = with_client(socket, home, lambda client: client.create(
        name, text, base=base or "", adapters=adapter or [], system=system, template=template_text,
        parameters=params))
    if json_output:
        print_json(reply)
    else:
        profile = reply.get("profile") or {}
        runs = profile.get("adapter") or "the base model"
        stdout.print(f"created {reply['name']}: runs {runs}" + (f" ({describe(profile)})" if describe(profile) else ""))


def cp(
    source: Annotated[str, typer.Argument(help="A profile or an adapter.", autocompletion=adapter_names)],
    destination: Annotated[str, typer.Argument(help="The new name.")],
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Copy a profile or an adapter to a new name; either can then be removed alone.

    Examples:

        loractl cp sql-assistant sql-assistant/v2

        loractl cp sql-expert/v1 sql-expert/stable
    """
    reply = with_client(socket, home, lambda client: client.copy(source, destination))
    if json_output:
        print_json(reply)
    else:
        stdout.print(f"copied {source} to {reply['name']}")


def register(app: typer.Typer) -> None:
    app.command("create")(create)
    app.command("cp")(cp)
