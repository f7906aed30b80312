"""Profiles: ``loractl create`` (from a Modelfile and/or flags) and ``loractl cp``.

The CLI sends the Modelfile's text and the flags, and the daemon reads both
(``loractld/store/modelfile.py``), refusing a line it cannot honour by its number. The one thing
the CLI changes first is an ``ADAPTER`` that names a folder by a relative path: the daemon
cannot know the caller's folders, so ``./x``, ``../x``, ``~/x`` (and an existing folder that is
no stored adapter's name) become absolute, against the Modelfile's folder (as Ollama resolves
them) or, for ``--adapter``, the working folder (as ``loractl pull`` does). Each line keeps its
number, so the daemon's refusals still name the line the user wrote.
"""

from __future__ import annotations

import math
import os
import re
import sys
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, print_json, stdout, with_client
from loractl.cli._complete import adapter_names
from loractl.errors import AdapterNotFound, InvalidRequest
from loractl.cli._output import fail
from loractl.cli.listing import describe


def create(
    name: Annotated[str, typer.Argument(help="The profile's name, e.g. sql-assistant (a model name, as adapters have).")],
    file: Annotated[str | None, typer.Option("--file", "-f", help="A Modelfile (Ollama's syntax; - reads stdin).")] = None,
    base: Annotated[str | None, typer.Option("--from", help="FROM: the base model, a stored adapter or a profile.",
                                             autocompletion=adapter_names)] = None,
    adapter: Annotated[list[str] | None, typer.Option("--adapter", help="ADAPTER NAME[=WEIGHT]: a stored adapter, a folder or a Hub ref "
                                                      "(pulled as <name>-adapter); repeat to merge several.",
                                                      autocompletion=adapter_names)] = None,
    system: Annotated[str | None, typer.Option("--system", help="SYSTEM: the system prompt.")] = None,
    template: Annotated[str | None, typer.Option("--template", help="TEMPLATE: a file with a Jinja chat template.")] = None,
    param: Annotated[list[str] | None, typer.Option("--param", help="PARAMETER NAME=VALUE (Ollama's names; "
                                                    "stop repeats), e.g. temperature=0.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace a profile of this name made from another "
                                        "Modelfile.")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Make a profile: a named model of an adapter (or the base model) with its own defaults.

    A profile adds a system prompt, default parameters, few-shot messages and a chat template
    (a Modelfile in Ollama's syntax). Every door serves it by name.

    Flags override the Modelfile's lines; a request's own values override the profile's.
    A profile of that name is updated by the same Modelfile, replaced by another only with
    --force; an adapter's name is refused (adapters and profiles share one name space).

    Examples:

        loractl create sql-assistant -f Modelfile

        loractl create sql-assistant --from sql-expert/v1 --system "Answer in SQL." --param temperature=0 --param stop=";"

        loractl create poet --from BASE --adapter ./poet-lora --adapter org/r=0.5

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
    modelfile_dir = Path(file).parent.absolute() if file not in (None, "-") else Path.cwd()

    async def body(client):
        async def stored(value: str) -> bool:
            try:
                await client.show(value)
                return True
            except (AdapterNotFound, InvalidRequest):
                return False
        sent = await absolute_adapters(text, modelfile_dir, stored)
        flags = [await _absolute(a, Path.cwd(), stored) for a in adapter or []]
        return await client.create(name, sent, base=base or "", adapters=flags, system=system,
                                   template=template_text, parameters=params, force=force)
    reply = with_client(socket, home, body)
    if json_output:
        print_json(reply)
    else:
        profile = reply.get("profile") or {}
        runs = profile.get("adapter") or "the base model"
        stdout.print(f"created {reply['name']}: runs {runs}" + (f" ({describe(profile)})" if describe(profile) else ""))


_ADAPTER_LINE = re.compile(r"^(\s*adapter\s+)(.*?)(\s*)$", re.IGNORECASE)


async def absolute_adapters(text: str, base: Path, stored: Callable[[str], Awaitable[bool]]) -> str:
    """``text`` with each ADAPTER line's relative folder made absolute against ``base``. Only a
    line that starts a statement is an instruction: the lines of a quoted argument that spans
    lines (triple or one quote) are text, read as the daemon's parser reads them
    (``loractld/store/modelfile.py``: ``_statements``); every line keeps its number."""
    out: list[str] = []
    lines = text.splitlines(keepends=True)
    i = 0
    while i < len(lines):
        raw = lines[i]
        body = raw.rstrip("\r\n")
        i += 1
        stripped = body.strip()
        if not stripped or stripped.startswith("#"):
            out.append(raw)
            continue
        instruction, rest = (re.split(r"\s+", stripped, maxsplit=1) + [""])[:2]
        after_word = instruction.upper() in ("PARAMETER", "MESSAGE")
        match = _ADAPTER_LINE.match(body)
        if match and not _open_quote(rest, after_word):
            body = match[1] + await _absolute(match[2], base, stored) + match[3]
        out.append(body + raw[len(raw.rstrip("\r\n")):])
        while _open_quote(rest, after_word) and i < len(lines):   # the statement's quoted text runs on
            rest += "\n" + lines[i].rstrip("\r\n")
            out.append(lines[i])
            i += 1
    return "".join(out)


def _open_quote(rest: str, after_word: bool) -> bool:
    """Whether a statement's quoted argument is still open at the end of ``rest`` (the daemon's rule)."""
    text = rest.strip()
    if after_word:   # PARAMETER and MESSAGE quote after a word
        text = (re.split(r"\s+", text, maxsplit=1) + [""])[1]
    if text.startswith('"""'):
        return len(text) < 6 or not text.rstrip().endswith('"""')
    if text.startswith('"'):
        return not re.search(r'(?<!\\)(?:\\\\)*"\s*$', text[1:])
    return False


async def _absolute(argument: str, base: Path, stored: Callable[[str], Awaitable[bool]]) -> str:
    """One ADAPTER argument (``VALUE[=WEIGHT]``, maybe "quoted") with a relative folder made
    absolute; a stored name, a Hub ref or an absolute path is left as it is (a stored name wins)."""
    from loractl.client import local_folder  # here, not at import: `loractl --help` needs no gRPC

    quoted = len(argument) >= 2 and argument[0] == argument[-1] == '"' and not argument.startswith('"""')
    value = re.sub(r'\\(["\\])', r"\1", argument[1:-1]) if quoted else argument
    path, sep, weight = value.rpartition("=")
    if not sep or not _is_number(weight):
        path, sep, weight = value, "", ""
    path, weight = path.strip(), weight.strip()   # ADAPTER ./x = 0.5: spaces around '=' are allowed
    # Joined and cleaned as Ollama's filepath.Join(dir of the Modelfile, path) does.
    if path.startswith(("./", "../")) or path in (".", ".."):
        folder = local_folder(os.path.normpath(os.path.join(base, path)))
    elif path.startswith("~"):
        folder = local_folder(path)
    elif path and not os.path.isabs(path) and os.path.isdir(base / path) and not await stored(path):
        folder = local_folder(os.path.normpath(os.path.join(base, path)))
    else:
        return argument
    new = f"{folder}{sep}{weight}"
    return '"' + new.replace("\\", "\\\\").replace('"', '\\"') + '"' if quoted else new


def _is_number(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


def cp(
    source: Annotated[str, typer.Argument(help="A profile or an adapter.", autocompletion=adapter_names)],
    destination: Annotated[str, typer.Argument(help="The new name.")],
    force: Annotated[bool, typer.Option("--force", help="Replace what the new name holds (of the same kind).")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Copy a profile or an adapter to a new name; either can then be removed alone.

    A taken name is refused unless --force (a profile replaces a profile, an adapter an adapter).

    Examples:

        loractl cp sql-assistant sql-assistant/v2

        loractl cp sql-expert/v1 sql-expert/stable
    """
    reply = with_client(socket, home, lambda client: client.copy(source, destination, force=force))
    if json_output:
        print_json(reply)
    else:
        stdout.print(f"copied {source} to {reply['name']}")


def register(app: typer.Typer) -> None:
    app.command("create")(create)
    app.command("cp")(cp)
