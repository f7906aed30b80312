"""vLLM's own engine flags, passed through to the engine by vLLM's own parser.

Every ``vllm serve`` engine flag (``AsyncEngineArgs.add_cli_args``: ``--gpu-memory-utilization``,
``--tensor-parallel-size``, ``--quantization``, ``--kv-cache-dtype``, ``--speculative-config``,
``--max-num-batched-tokens``, ...) is accepted by ``loractld`` with vLLM's names, types, help and
defaults, as a flag, a config-file key or a ``LORACTLD_<NAME>`` variable. Nothing is copied: the
flags are whatever the installed vLLM defines.

Two phases, so that a daemon started with loractld's flags alone does not pay vLLM's import
(seconds) before it binds its socket: loractld's own parser takes its flags and leaves the rest
(``config.resolve``); only when something is left is vLLM's parser built and asked
(:func:`parse_leftovers`).

Invariants:
- Only what the user gave reaches the engine from here: vLLM's defaults stay vLLM's, and
  loractld's device defaults (``engine.device_defaults``) fill only what the user left out.
- A vLLM flag whose job loractld does (adapter loading, the tier sizes, sleeping, the server's
  address) is refused by name with loractld's way as the hint, never silently overridden.
- ``vllm`` is imported inside functions only.
"""

from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import sys
from collections.abc import Iterable, Mapping
from typing import Any

from loractl.errors import InvalidRequest

# vLLM engine fields that loractld sets itself: the flag is refused, with loractld's way.
OWNED: dict[str, str] = {
    "enable_lora": "LoRA is always on in loractld: store adapters with `loractl pull`.",
    "kv_cache_memory_bytes": "Use loractld's --kv-cache-memory SIZE (e.g. 2GiB).",
    "enable_prefix_caching": "Prefix caching is on; loractld's --no-prefix-caching turns it off.",
    "enable_sleep_mode": "loractld puts the engine to sleep itself: use --keep-alive DURATION.",
    "worker_extension_cls": "loractld installs its own worker extension (its tier and pin methods).",
    "model": "Use loractld's --model.",
}
# `vllm serve` flags that are not engine flags but that users carry over: refused with a hint.
SERVER_FLAGS: dict[str, str] = {
    "--lora-modules": "Store each adapter with `loractl pull FOLDER --name NAME`; --preload NAME loads it at start.",
    "--host": "The OpenAI API listens where --http HOST:PORT says.",
    "--port": "The OpenAI API listens where --http HOST:PORT says.",
    "--api-key": "Use --api-key-file FILE (the key is not on the command line).",
    "--uds": "loractld's gRPC socket is --socket PATH; the OpenAI API is --http HOST:PORT.",
}
HINT = "loractld --help lists loractld's flags; --help=all vLLM's engine flags, --help=GROUP one group."


def normalize_argv(argv: Iterable[str]) -> list[str]:
    """``--max_num_seqs`` -> ``--max-num-seqs``, as vLLM's own parser reads flag names (only the
    name, up to a ``=`` or a ``.``; values are left alone)."""
    out = []
    for arg in argv:
        if arg.startswith("--") and "_" in arg:
            name, sep, value = arg.partition("=")
            head, dot, tail = name.partition(".")
            arg = "--" + head[2:].replace("_", "-") + dot + tail + sep + value
        out.append(arg)
    return out


def vllm_parser() -> argparse.ArgumentParser:
    """vLLM's own engine parser (``AsyncEngineArgs.add_cli_args`` on its ``FlexibleArgumentParser``)."""
    from vllm.engine.arg_utils import AsyncEngineArgs

    try:
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError:  # vLLM before 0.31 kept it in vllm.utils
        from vllm.utils import FlexibleArgumentParser
    parser = FlexibleArgumentParser(prog="loractld", add_help=False, allow_abbrev=False,
                                    description="vLLM's engine flags, as `vllm serve` takes them "
                                                "(loractld passes them to its engine).")
    AsyncEngineArgs.add_cli_args(parser)

    def error(message: str):
        raise _ParseError(message)
    parser.error = error  # one line with a hint instead of argparse's usage and exit 2
    return parser


class _ParseError(Exception):
    pass


def engine_actions(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    return {a.dest: a for a in parser._actions if a.option_strings and a.dest != "help"}


def parse_leftovers(argv: list[str], from_file: Mapping[str, Any], from_env: Mapping[str, str], *,
                    own_options: Iterable[str], file_name: str = "the config file") -> dict[str, Any]:
    """The vLLM engine fields the user set in what loractld's parser left: flags (``argv``), config
    keys (``from_file``, key -> TOML value) and ``LORACTLD_*`` variables (``from_env``, name -> text;
    those naming no vLLM field are ignored, as loractld ignores variables it does not read).
    Precedence as for loractld's own: flag > environment > file. {} without importing vLLM when
    nothing is left."""
    own_options = set(own_options)
    for arg in argv:
        flag = arg.partition("=")[0]
        if flag in SERVER_FLAGS:
            raise InvalidRequest(f"{flag} is a `vllm serve` flag that loractld does not take", SERVER_FLAGS[flag])
        # Refused by name before vLLM's import (seconds): an answer as quick as a typo's in loractld's own.
        name = flag[2:].replace("-", "_") if flag.startswith("--") else ""
        dest = next((d for d in (name, name.removeprefix("no_")) if d in OWNED and d != "model"), None)
        if dest is not None:
            raise InvalidRequest(f"--{dest.replace('_', '-')} is set by loractld itself", OWNED[dest])
    if not argv and not from_file and not from_env:
        return {}
    parser = vllm_parser()
    actions = engine_actions(parser)
    values: dict[str, Any] = {}
    for key, raw in from_file.items():
        dest = key.replace("-", "_")
        action = actions.get(dest)
        if action is None:
            raise InvalidRequest(f"unknown key {key!r} in {file_name}: neither loractld's nor one of vLLM's engine "
                                 f"settings{_did_you_mean(key, _keys(actions, own_options))}", HINT)
        values[dest] = _convert(action, raw, f"{key} in {file_name}")
    for name, raw in from_env.items():
        dest = name.removeprefix("LORACTLD_").lower()
        if dest in actions:
            values[dest] = _convert(actions[dest], raw, f"${name}")
    if argv:
        for action in parser._actions:
            action.default = argparse.SUPPRESS
        try:
            given = vars(parser.parse_args(argv))
        except _ParseError as e:
            raise _flag_error(str(e), actions, own_options) from None
        values.update(given)
    for dest in values:
        if dest in OWNED:
            raise InvalidRequest(f"{_flag(actions[dest])} is set by loractld itself", OWNED[dest])
    return values


def boolean(raw: Any) -> bool:
    """A TOML boolean, or an environment variable's 1/true/yes or 0/false/no."""
    if isinstance(raw, str):
        if raw.lower() not in ("1", "true", "yes", "0", "false", "no"):
            raise ValueError(f"not a boolean: {raw!r}")
        return raw.lower() in ("1", "true", "yes")
    return bool(raw)


def _convert(action: argparse.Action, raw: Any, where: str) -> Any:
    """A TOML or environment value for one of vLLM's flags, through the flag's own type."""
    try:
        if isinstance(action, (argparse.BooleanOptionalAction, argparse._StoreTrueAction)):
            return boolean(raw)
        if isinstance(action, argparse._StoreFalseAction):
            return not boolean(raw)
        if action.nargs in ("+", "*") or isinstance(action.nargs, int):
            items = raw if isinstance(raw, list) else str(raw).split()
            return [_scalar(action, item) for item in items]
        return _scalar(action, raw)
    except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
        raise InvalidRequest(f"invalid value for {where}: {e}", f"See: loractld --help={_flag(action).lstrip('-')}") from e


def _scalar(action: argparse.Action, raw: Any) -> Any:
    text = json.dumps(raw) if isinstance(raw, (dict, list)) else ("true" if raw is True else "false" if raw is False
                                                                  else str(raw))
    value = action.type(text) if action.type is not None else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"{value!r} is not one of {', '.join(map(str, action.choices))}")
    return value


def _flag(action: argparse.Action) -> str:
    return next((o for o in action.option_strings if o.startswith("--")), action.option_strings[0])


def _keys(actions: Mapping[str, argparse.Action], own_options: Iterable[str]) -> list[str]:
    return [_flag(a).lstrip("-") for a in actions.values()] + [o.lstrip("-") for o in own_options]


def _did_you_mean(word: str, candidates: list[str]) -> str:
    close = difflib.get_close_matches(word.lstrip("-").replace("_", "-"), candidates, n=1, cutoff=0.75)
    return f" (did you mean {close[0]!r}?)" if close else ""


def _flag_error(message: str, actions: Mapping[str, argparse.Action], own_options: Iterable[str]) -> InvalidRequest:
    """vLLM's parser's complaint as one line: an unknown flag named (with the closest known one)."""
    if message.startswith("unrecognized arguments:"):
        unknown = next((w for w in message.split(":", 1)[1].split() if w.startswith("-")), message.split(":", 1)[1].strip())
        flag = unknown.partition("=")[0]
        close = difflib.get_close_matches(flag, ["--" + k for k in _keys(actions, own_options)], n=1, cutoff=0.75)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return InvalidRequest(f"unknown flag {flag}: neither loractld's nor one of vLLM's engine flags{hint}", HINT)
    named = re.match(r"argument (--[a-z0-9-]+)", message)
    if named:   # a value the flag's own type refused
        return InvalidRequest(message, f"vLLM's help for it: loractld --help={named.group(1)[2:]}")
    return InvalidRequest(message, HINT)


def print_help(keyword: str) -> None:
    """``loractld --help=KEYWORD``: vLLM's own help for its engine flags, as ``vllm serve --help=KEYWORD``
    shows it: ``all``, a group (``CacheConfig``), or a part of a flag's name; ``engine`` lists the groups."""
    parser = vllm_parser()
    parser.usage = "loractld [loractld's flags: loractld --help] [vLLM's engine flags]"
    parser.epilog = ("Where the user gives none, loractld chooses on a GPU: --gpu-memory-utilization from the "
                     "card's free memory, the KV cache, --max-loras and --max-cpu-loras (loractl status says "
                     "what and why); vLLM's defaults above apply to the rest.")
    if keyword.lower() not in ("engine", "vllm"):
        type(parser)._search_keyword = keyword
    try:
        sys.stdout.write(parser.format_help() + "\n")
        sys.stdout.flush()
    except BrokenPipeError:   # `loractld --help=all | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())


def settled(args: Any, config: Any, given: Iterable[str] = ()) -> dict[str, Any]:
    """The engine settings in effect, under vLLM's field names: each ``AsyncEngineArgs`` field
    that was set (a plain value that differs from vLLM's default, or any field in ``given``, the
    user's), then what vLLM settled on for the ones users ask about most (read from its
    ``VllmConfig``, which may differ from what was asked)."""
    import dataclasses

    given = set(given)
    out: dict[str, Any] = {}
    for f in dataclasses.fields(args):
        value = getattr(args, f.name)
        if f.name not in given and not isinstance(value, (type(None), bool, int, float, str)):
            continue  # vLLM's own config objects, filled in by its start: not a setting anyone made
        if f.default is not dataclasses.MISSING:
            default = f.default
        elif f.default_factory is not dataclasses.MISSING:
            try:
                default = f.default_factory()
            except Exception:  # noqa: BLE001 - a factory that needs context: show the value
                default = object()
        else:
            default = object()
        try:
            same = value == default
        except Exception:  # noqa: BLE001 - an incomparable value: show it
            same = False
        if not same:
            out[f.name] = _jsonable(value)
    for name, path in SETTLED.items():
        value = config
        for part in path.split("."):
            value = getattr(value, part, None)
            if value is None:
                break
        if value is not None:
            out[name] = _jsonable(value)
    return dict(sorted(out.items()))


# vLLM field -> where its VllmConfig keeps the value in effect (0.26-0.32 alike).
SETTLED = {
    "dtype": "model_config.dtype",
    "max_model_len": "model_config.max_model_len",
    "quantization": "model_config.quantization",
    "enforce_eager": "model_config.enforce_eager",
    "seed": "model_config.seed",
    "max_num_seqs": "scheduler_config.max_num_seqs",
    "max_num_batched_tokens": "scheduler_config.max_num_batched_tokens",
    "gpu_memory_utilization": "cache_config.gpu_memory_utilization",
    "kv_cache_memory_bytes": "cache_config.kv_cache_memory_bytes",
    "kv_cache_dtype": "cache_config.cache_dtype",
    "block_size": "cache_config.block_size",
    "enable_prefix_caching": "cache_config.enable_prefix_caching",
    "tensor_parallel_size": "parallel_config.tensor_parallel_size",
    "pipeline_parallel_size": "parallel_config.pipeline_parallel_size",
    "max_loras": "lora_config.max_loras",
    "max_cpu_loras": "lora_config.max_cpu_loras",
    "max_lora_rank": "lora_config.max_lora_rank",
}


def _jsonable(value: Any) -> Any:
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    text = str(value)
    return text.removeprefix("torch.")
