"""Assembles the ``loractl`` CLI from its command modules."""

from __future__ import annotations

import os

import typer

from loractl import __version__
from loractl.cli import adapters, chat, daemon_cmd, instances, merges, profiles, run, status, tiers, top


def _flags_take_no_value() -> None:
    """Typer 0.29 prints a type beside every option, '<bool>' beside a flag that takes no value
    (``--raw <bool>`` reads as if it wanted one). A flag gets no type column."""
    from typer.core import TyperOption

    shown = TyperOption.display_type_rich

    def display_type_rich(self, ctx):
        return None if self.is_flag and self.metavar is None else shown(self, ctx)

    TyperOption.display_type_rich = display_type_rich


_flags_take_no_value()

app = typer.Typer(
    name="loractl",
    help="Manage LoRA adapters on a local vLLM engine (the loractld daemon).\n\n"
         "Start the daemon with `loractld --model demo`, then: loractl status, loractl run PROMPT.",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},
)

for module in (adapters, merges, profiles, tiers, run, chat, status, top, instances, daemon_cmd):
    module.register(app)


def _version(value: bool) -> None:
    if value:
        print(f"loractl {__version__}")
        raise typer.Exit()


@app.command("version")
def version() -> None:
    """Show loractl's version (as --version and -V do).

    Examples:

        loractl version
    """
    print(f"loractl {__version__}")


@app.command("help")
def help_(command: list[str] = typer.Argument(None, help="The command, e.g. pull, or registry ls.",
                                              show_default=False)) -> None:
    """Show the help of loractl or of a command (as --help does).

    Examples:

        loractl help

        loractl help pull
    """
    app(args=[*(command or []), "--help"], prog_name="loractl")


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", "-V", callback=_version, is_eager=True,
                                 help="Show the version."),
    instance: str = typer.Option(None, "--instance", envvar="LORACTL_INSTANCE", show_envvar=True,
                                 help="Which daemon, when several run (see loractl instances)."),
) -> None:
    if instance:
        os.environ["LORACTL_INSTANCE"] = instance  # read by every Client this process makes


def main() -> None:
    app()
