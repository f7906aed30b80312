"""The disk tier: ``loractl pull``, ``ls``, ``show``, ``rm``."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Annotated, Any

import typer

from loractl.cli._common import (HomeOpt, JsonOpt, SocketOpt, human_bytes, print_json, short_revision, stderr,
                                 stdout, with_client)
from loractl.cli._complete import adapter_names
from loractl.cli._reads import adapter_report
from loractl.cli.listing import ago, list_adapters
if TYPE_CHECKING:
    from loractl.client import Client

NameArg = Annotated[str, typer.Argument(help="Adapter name, e.g. sql-expert/v1 (see loractl ls).",
                                        autocompletion=adapter_names)]


def pull(
    ref: Annotated[str, typer.Argument(help="org/repo, hf://org/repo\\[@rev]\\[/subfolder], or a local folder.")],
    name: Annotated[str | None, typer.Option("--name", help="Store name (default: derived from REF).")] = None,
    revision: Annotated[str | None, typer.Option("--revision", "-r", help="Branch, tag or commit (Hub).")] = None,
    force: Annotated[bool, typer.Option("--force", help="Install even if it names another base model.")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Download an adapter into the store, verify it and install it atomically.

    Honours HF_ENDPOINT and HF_TOKEN. Pulling a name again at the same revision is a no-op;
    a new revision replaces the old one atomically.

    Examples:

        loractl pull org/sql-lora --name sql-expert/v1

        loractl pull hf://org/adapters@v2/sql --name sql-expert/v2

        loractl pull ./my-adapter --name mine/v1
    """

    from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                               TransferSpeedColumn)

    async def body(client: Client) -> dict[str, Any]:
        final: dict[str, Any] = {}
        tasks: dict[str, Any] = {}
        with Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(), TransferSpeedColumn(),
                      TimeRemainingColumn(), console=stderr, transient=False, disable=json_output) as bars:
            async for event in client.pull(ref, name=name, revision=revision, force=force):
                stage = event["stage"]
                if stage == "downloading":
                    file = event["file"]
                    if file not in tasks:
                        tasks[file] = bars.add_task(file, total=int(event["total_bytes"]) or None)
                    bars.update(tasks[file], completed=int(event["done_bytes"]))
                elif stage in ("done", "up_to_date"):
                    final = event
                elif not json_output:
                    bars.console.print(event["message"])
        return final

    final = with_client(socket, home, body)
    if json_output:
        print_json(final)
    else:
        adapter = final.get("adapter", {})
        verb = "up to date" if final.get("stage") == "up_to_date" else "success"
        stdout.print(f"{verb}: {adapter.get('name')} ({short_revision(adapter.get('revision', ''))}, "
                     f"{human_bytes(int(adapter.get('size_bytes', 0)))}, rank {adapter.get('rank')})")


def ls(socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """List the adapters in the store and where each one is: device, host RAM or disk.

    TIER is what the engine really holds; PIN is host, device or -; USED is the last request.
    loractl show NAME gives the source, base model and files.

    Examples:

        loractl ls

        loractl ls --json | jq -r '.[].name'
    """
    list_adapters(socket, home, json_output)


def show(name: NameArg, socket: SocketOpt = None, home: HomeOpt = None, json_output: JsonOpt = False) -> None:
    """Show one adapter: source, revision, base model, rank, files and checksums.

    Also where it is now (device slot, host RAM or disk), whether it is pinned, and its use.

    Examples:

        loractl show sql-expert/v1

        loractl show sql-expert/v1 --json
    """
    adapter_report(name, socket, home, json_output)

def rm(
    name: NameArg,
    force: Annotated[bool, typer.Option("--force", help="Remove even if pinned.")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Delete an adapter from disk (unloading it from the engine first).

    A pinned adapter is refused unless --force; one serving requests is refused until they end.

    Examples:

        loractl rm sql-expert/v1
    """
    reply = with_client(socket, home, lambda client: client.remove(name, force=force))
    if json_output:
        print_json(reply)
    else:
        stdout.print(f"deleted {reply['adapter']['name']}" + (" (unloaded from the engine)" if reply["unloaded"] else ""))


def register(app: typer.Typer) -> None:
    app.command("pull")(pull)
    app.command("ls")(ls)
    app.command("show")(show)
    app.command("rm")(rm)
