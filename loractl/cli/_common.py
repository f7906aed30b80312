"""What every command shares: Typer option aliases, plus the output helpers of ``_output``."""

from __future__ import annotations

from typing import Annotated

import typer

from loractl.cli._output import (fail, human_bytes, print_json, short_revision, stderr, stdout,  # noqa: F401
                                 with_client)

SocketOpt = Annotated[
    str | None,
    typer.Option("--socket", envvar="LORACTL_SOCKET", show_envvar=True,
                 help="Daemon socket (default: under LORACTL_HOME or the user runtime dir)."),
]
HomeOpt = Annotated[
    str | None,
    typer.Option("--home", envvar="LORACTL_HOME", show_envvar=True, help="loractl's home folder."),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Machine-readable JSON output.")]
