"""``loractl merge NEW SRC[=WEIGHT]...``: a new adapter whose delta is the weighted sum of stored
adapters' deltas, made and stored by the daemon (``loractld/core/merges.py``)."""

from __future__ import annotations

import math
from typing import Annotated

import typer

from loractl.cli._common import HomeOpt, JsonOpt, SocketOpt, fail, print_json, short_revision, stdout, with_client
from loractl.cli._complete import adapter_names
from loractl.cli._output import working
from loractl.errors import InvalidRequest


def weighted(term: str) -> tuple[str, float]:
    """``NAME=WEIGHT`` (or ``NAME``: weight 1) as ``(name, weight)``; names never hold ``=``."""
    name, sep, value = term.rpartition("=")
    if not sep:
        return term, 1.0
    try:
        weight = float(value)
    except ValueError:
        weight = math.nan
    if not name or not math.isfinite(weight):
        raise fail(InvalidRequest(f"{term!r} is not NAME=WEIGHT", "Write e.g. sql-expert/v1=0.7 (a number)."))
    return name, weight


def merge(
    name: Annotated[str, typer.Argument(help="The new adapter's name, e.g. sql-chat/v1.")],
    sources: Annotated[list[str], typer.Argument(help="Stored adapters to merge, each NAME or NAME=WEIGHT "
                                                 "(weight 1 when left out).", autocompletion=adapter_names)],
    svd_rank: Annotated[int | None, typer.Option("--svd-rank", min=1, help="Approximate: truncate the summed delta "
                                                 "to this rank (PEFT's svd); show reports the error.")] = None,
    force: Annotated[bool, typer.Option("--force", help="Replace an adapter of this name made otherwise.")] = False,
    socket: SocketOpt = None,
    home: HomeOpt = None,
    json_output: JsonOpt = False,
) -> None:
    """Merge adapters into a new one whose delta is the weighted sum of theirs.

    Exact: the ranks are concatenated (PEFT's add_weighted_adapter, "cat"), so the new rank is
    their sum, which must fit the daemon's --max-lora-rank. Other base models, DoRA, trained
    biases and the like are refused by name. The same sources and weights give the same
    content; show lists the sources, their digests and weights. A name that holds another
    adapter is refused unless --force (a merge of the same sources and weights updates it), a
    profile's always.

    Examples:

        loractl merge sql-chat/v1 sql-expert/v1=0.7 chat/v1=0.3

        loractl merge three/v1 a/v1 b/v1=0.5 c/v1=-0.25

        loractl merge small/v1 a/v1 b/v1 --svd-rank 8
    """
    pairs = [weighted(term) for term in sources]
    method = f"svd, rank {svd_rank}" if svd_rank else "cat"
    with working(f"merging {len(pairs)} adapters into {name} ({method})"):
        reply = with_client(socket, home, lambda client: client.merge(name, pairs, svd_rank=svd_rank, force=force))
    if json_output:
        print_json(reply)
        return
    merged = reply.get("merge") or {}
    terms = " + ".join(f"{s['weight']:g} × {s['name']}" for s in merged.get("sources", []))
    error = f", relative error {merged['relative_error']:.2e}" if merged.get("method") == "svd" else ""
    stdout.print(f"merged {reply['name']} = {terms} ({merged.get('method', 'cat')}, rank {reply['rank']}{error}, "
                 f"{short_revision(reply['revision'])})", markup=False)


def register(app: typer.Typer) -> None:
    app.command("merge")(merge)
