"""``loractl daemon install``: run loractld as a systemd service."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from importlib import resources
from pathlib import Path
from typing import Annotated

import typer

from loractl.cli._common import fail, stderr, stdout
from loractl.errors import InvalidRequest

app = typer.Typer(
    help="Run loractld as a systemd service.\n\nExamples:\n\n    loractl daemon install --user --model demo",
    no_args_is_help=True,
)


def unit_text(name: str, loractld: str, config: Path | None = None) -> str:
    """A shipped unit with ExecStart pointing at this installation's loractld (and at
    ``config``, when the config file is not where loractld looks by default)."""
    text = (resources.files("loractld") / "units" / name).read_text()
    if config is not None:
        text = text.replace("/usr/local/bin/loractld --config /etc/loractl/loractld.toml", "/usr/local/bin/loractld")
        loractld = f"{loractld} --config {config}"
    return text.replace("/usr/local/bin/loractld", loractld).replace("%h/.local/bin/loractld", loractld)


def _loractld_path() -> str:
    beside = Path(sys.executable).parent / "loractld"
    return str(beside) if beside.exists() else (shutil.which("loractld") or "/usr/local/bin/loractld")


@app.command("install")
def install(
    user: Annotated[bool, typer.Option("--user/--system", help="A user unit (default) or a system unit.")] = True,
    socket_activated: Annotated[bool, typer.Option("--socket-activated",
                                                   help="Also install loractld.socket (system only).")] = False,
    model: Annotated[str | None, typer.Option("--model", help="Write this model into the config file.")] = None,
    http: Annotated[str | None, typer.Option("--http", metavar="HOST:PORT",
                                             help="Also install loractld-http.socket: the OpenAI-compatible API "
                                                  "on HOST:PORT (with --system --socket-activated).")] = None,
    unit_dir: Annotated[Path | None, typer.Option("--unit-dir", help="Write units here instead.")] = None,
    enable: Annotated[bool, typer.Option("--enable/--no-enable", help="systemctl enable --now afterwards.")] = True,
) -> None:
    """Write the loractld unit (and a config file if none exists), then enable it.

    The system unit runs as user 'loractl' with its socket group 'loractl' (create both
    first); the user unit runs as you.

    Examples:

        loractl daemon install --user --model demo

        sudo loractl daemon install --system --socket-activated

        sudo loractl daemon install --system --socket-activated --http 127.0.0.1:8000
    """
    if socket_activated and user:
        raise fail(InvalidRequest("socket activation is set up for the system unit only",
                                  "Use --system --socket-activated."))
    if http is not None and not socket_activated:
        raise fail(InvalidRequest("--http installs a socket unit, for the socket-activated system service",
                                  "Use --system --socket-activated --http HOST:PORT, or put http = \"HOST:PORT\" "
                                  "in loractld.toml."))
    if http is not None and (":" not in http or not http.rsplit(":", 1)[1].isdigit()):
        raise fail(InvalidRequest(f"not an address to listen on: {http!r}", "Use HOST:PORT, e.g. 127.0.0.1:8000."))
    if user:
        target = unit_dir or Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "systemd" / "user"
        units = {"loractld.service": "loractld-user.service"}
        config = Path(os.environ.get("XDG_CONFIG_HOME", Path.home() / ".config")) / "loractl" / "loractld.toml"
    else:
        target = unit_dir or Path("/etc/systemd/system")
        units = {"loractld.service": "loractld.service"}
        if socket_activated:
            units["loractld.socket"] = "loractld.socket"
        if http is not None:
            units["loractld-http.socket"] = "loractld-http.socket"
        config = Path("/etc/loractl/loractld.toml")
    if unit_dir is not None:
        config = unit_dir / "loractld.toml"
    loractld = _loractld_path()
    try:
        target.mkdir(parents=True, exist_ok=True)
        for installed, shipped in units.items():
            text = unit_text(shipped, loractld, config if unit_dir is not None else None)
            if installed == "loractld-http.socket":
                text = text.replace("ListenStream=127.0.0.1:8000", f"ListenStream={http}")
            (target / installed).write_text(text)
            stdout.print(f"wrote {target / installed}")
        if not config.exists():
            config.parent.mkdir(parents=True, exist_ok=True)
            example = (resources.files("loractld") / "units" / "loractld.toml.example").read_text()
            if model:
                example = example.replace('model = "meta-llama/Llama-3.1-8B-Instruct"', f'model = "{model}"')
            config.write_text(example)
            stdout.print(f"wrote {config}")
    except PermissionError as e:
        raise fail(InvalidRequest(f"cannot write {e.filename}: permission denied",
                                  "A system unit needs root: sudo loractl daemon install --system")) from None
    if not enable or unit_dir is not None:
        return
    scope = ["--user"] if user else []
    enabled = [u for u in units if u.endswith(".socket")] or ["loractld.service"]
    for args in (["daemon-reload"], ["enable", "--now", *enabled]):
        try:
            result = subprocess.run(["systemctl", *scope, *args], capture_output=True, text=True)
        except FileNotFoundError:
            result = subprocess.CompletedProcess(args, 127, "", "systemctl: not found (no systemd bus here)")
        if result.returncode != 0:
            no_bus = "bus" in result.stderr.lower() or "not been booted with systemd" in result.stderr
            hint = ("This machine (or session) runs no systemd manager: start loractld in the foreground "
                    f"({loractld}), or install with --no-enable and enable it where systemd runs."
                    if no_bus else f"The unit is written; run systemctl {' '.join(scope + args)} yourself to see why.")
            raise fail(InvalidRequest(f"systemctl {' '.join(scope + args)} failed: "
                                      f"{result.stderr.strip() or 'exit ' + str(result.returncode)}", hint))
    stdout.print(f"enabled {' '.join(enabled)}; follow it with: journalctl {' '.join(scope)} -u loractld -f")


def register(root: typer.Typer) -> None:
    root.add_typer(app, name="daemon")
