"""loractld's settings from four layers: flag > environment > config file > default.

Every flag has a config-file key (its long name, ``max-loras`` or ``max_loras``) and an
environment variable (``LORACTLD_MAX_LORAS``; ``LORACTL_HOME``, ``LORACTL_SOCKET`` and
``LORACTL_LOG_LEVEL`` are shared with the CLI). The file is TOML: ``--config FILE``, else
``$LORACTLD_CONFIG``, else ``loractld.toml`` in the user config dir when it exists (the system
unit passes ``--config /etc/loractl/loractld.toml``). Unknown keys are errors that name the key.

What loractld's own parser does not know (a flag, a key, a ``LORACTLD_*`` variable) goes to
``passthrough`` (vLLM's engine flags, ``loractld.engine.engine_flags``), whose answer is
``engine_args`` in the result; without one, an unknown flag or key is an error here.
"""

from __future__ import annotations

import argparse
import os
import tomllib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import platformdirs

from loractl.errors import InvalidRequest
from loractld.engine.engine_flags import boolean

SHARED_ENV = {"home": "LORACTL_HOME", "socket": "LORACTL_SOCKET", "log_level": "LORACTL_LOG_LEVEL"}
_NOT_SETTINGS = {"help", "version", "config"}


def default_config_file() -> Path:
    return Path(platformdirs.user_config_dir("loractl")) / "loractld.toml"


def env_name(dest: str) -> str:
    return SHARED_ENV.get(dest, "LORACTLD_" + dest.upper())


Passthrough = Callable[[list[str], dict[str, Any], dict[str, str], str], dict[str, Any]]


def resolve(build_parser: Callable[[], argparse.ArgumentParser], argv: list[str] | None,
            passthrough: Passthrough | None = None) -> argparse.Namespace:
    parser = build_parser()
    actions = {a.dest: a for a in parser._actions if a.dest not in _NOT_SETTINGS and a.option_strings}
    defaults = {dest: a.default for dest, a in actions.items()}
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    if passthrough is None:
        given, leftover = vars(parser.parse_args(argv)), []
    else:
        namespace, leftover = parser.parse_known_args(argv)
        given = vars(namespace)

    config_path = given.pop("config", None) or os.environ.get("LORACTLD_CONFIG")
    if config_path is None and default_config_file().is_file():
        config_path = str(default_config_file())
    from_file, file_rest = _read_file(Path(config_path), actions, passthrough is not None) if config_path else ({}, {})
    from_env = {dest: _convert(a, os.environ[env_name(dest)], f"${env_name(dest)}")
                for dest, a in actions.items() if os.environ.get(env_name(dest))}
    merged = {**defaults, **from_file, **from_env, **given}
    merged["config"] = config_path
    if passthrough is not None:
        known_env = {env_name(dest) for dest in actions} | {"LORACTLD_CONFIG"}
        env_rest = {k: v for k, v in os.environ.items() if k.startswith("LORACTLD_") and k not in known_env and v}
        merged["engine_args"] = passthrough(leftover, file_rest, env_rest, str(config_path))
    return argparse.Namespace(**merged)


def _read_file(path: Path, actions: dict[str, argparse.Action],
               keep_unknown: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    try:
        data = tomllib.loads(path.read_text())
    except FileNotFoundError as e:
        raise InvalidRequest(f"config file {path} does not exist", "Check --config / $LORACTLD_CONFIG.") from e
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"config file {path} is not valid TOML: {e}", "Fix the file; see loractld(8).") from e
    values, unknown = {}, {}
    for key, raw in data.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None and keep_unknown:
            unknown[key] = raw
            continue
        if action is None:
            known = ", ".join(sorted(a.option_strings[-1].lstrip("-") for a in actions.values()))
            raise InvalidRequest(f"unknown key {key!r} in {path}", f"Known keys: {known}.")
        values[dest] = _convert(action, raw, f"{key} in {path}")
    return values, unknown


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """A file or environment value, converted and checked like the flag's own argument."""
    try:
        if isinstance(action, argparse._StoreTrueAction):
            return boolean(raw)
        if isinstance(action, argparse._AppendAction):
            items = raw if isinstance(raw, list) else [s for s in str(raw).split(",") if s.strip()]
            return [_scalar(action, item) for item in items]
        return _scalar(action, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise InvalidRequest(f"invalid value for {where}: {e}", f"See: loractld --help ({action.option_strings[-1]}).") from e


def _scalar(action: argparse.Action, raw: Any) -> Any:
    value = action.type(str(raw)) if action.type is not None else (raw if not isinstance(raw, (int, float)) else raw)
    if action.type is None and not isinstance(value, str):
        value = str(value)
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return value
