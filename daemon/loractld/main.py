"""``loractld``: the daemon's command line. Runs in the foreground (systemd runs exactly this)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import re
import sys
from pathlib import Path

from loractl import __version__
from loractl.errors import InvalidRequest, LoractlError
from loractld import config
from loractld.trust import audit
from loractld.serving.admission import DEFAULT_MAX_WAIT_S, DEFAULT_POLICY, POLICIES
from loractld.serving import keep_alive
from loractld.api.grpc_service import DEFAULT_MAX_MESSAGE_BYTES
from loractld.api.http import settings as http_settings
from loractld.api import dynamo as dynamo_settings
from loractld.engine import engine_flags, openai_serving
from loractld.engine.client import EngineSettings
from loractld.engine.device import keep_cuda_uninitialized
from loractld.worker.media_packages import hide_media_packages
from loractld.lifecycle import DaemonSettings, serve
from loractld.store.copies import SNAPSHOT_BUDGET

EPILOG = """\
examples:
  loractld --model demo                      SmolLM2-135M-Instruct + demo adapters (built on first start)
  loractld --model meta-llama/Llama-3.1-8B-Instruct --max-loras 8 --max-cpu-loras 32
  loractld --model ~/models/llama-3.2-1b-instruct-q4_k_m.gguf   GGUF: converted once, then served
  loractld --model hf://org/repo/model-q4_k_m.gguf              a GGUF file in a Hub repo
  loractld --model /srv/smollm2 --served-model-name HuggingFaceTB/SmolLM2-135M-Instruct
  LORACTL_HOME=/tmp/lc loractld --model tiny --device cpu   the tiny random test model (offline, seconds)
  loractld --config /etc/loractl/loractld.toml

settings come from flag > environment (LORACTLD_<FLAG>, e.g. LORACTLD_MAX_LORAS=8) > config
file (TOML, keys named like the flags: max-loras = 8, preload = ["sql-expert/v1"]) > default.

vLLM's engine flags: every `vllm serve` engine flag is taken as vLLM names it, as a flag, a
config key or a LORACTLD_ variable, and passed to the engine (loractl status shows what is in
effect), e.g. --gpu-memory-utilization 0.5, --tensor-parallel-size 2, --quantization awq,
--kv-cache-dtype fp8, --max-num-batched-tokens 4096. vLLM's help for them:
  loractld --help=engine        vLLM's groups of engine flags
  loractld --help=CacheConfig   one group;  --help=all every flag;  --help=memory flags matching 'memory'
"""

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """'64MiB', '1G', '512k', '1048576' -> bytes (binary units)."""
    match = _SIZE.match(text)
    if not match:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (try 256MiB or 2GiB)")
    number, unit = float(match.group(1)), match.group(2).lower()
    return int(number * (1 << (10 * " kmgt".index(unit or " "))))


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def positive_seconds(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {text}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="loractld",
        description="The loractl daemon: one vLLM engine, LoRA adapters across disk -> host -> device, "
                    "served over gRPC on a Unix socket.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,   # a prefix of one of loractld's flags may be a vLLM flag of its own
    )
    p.add_argument("--config", metavar="FILE",
                   help="TOML file with any of these settings (default: loractld.toml in the user config dir)")
    p.add_argument("--model", help="base model: a local folder, a Hub repo id, a .gguf file, 'demo' or 'tiny' (required)")
    p.add_argument("--served-model-name", metavar="NAME",
                   help="the model's name: in the HTTP API (default: the --model argument), and what it is "
                        "(e.g. its Hub id) when --model is a folder named otherwise: adapters whose "
                        "base_model_name_or_path says NAME are accepted")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file to use instead of the model's own (for models without one)")
    p.add_argument("--home", help="put every file under this folder (default: $LORACTL_HOME, else user dirs)")
    p.add_argument("--socket", help="Unix socket to listen on (default: $LORACTL_SOCKET, else under home)")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                   help="where the engine runs: cuda when a GPU is present under auto (default: auto)")
    p.add_argument("--dtype", default="auto", help="model dtype (default on CPU: float32, bfloat16 if float32 weights would take over half the "
                        "free RAM; on CUDA vLLM's choice)")
    p.add_argument("--max-loras", type=positive_int, default=None,
                   help="adapter slots on the device (default on CPU: 2; on CUDA from the free GPU memory and the "
                        "adapters' rank, 2 to 8)")
    p.add_argument("--max-cpu-loras", type=positive_int, default=None,
                   help="adapters cached in host RAM (default on CPU: 4; on CUDA from the free host RAM and the "
                        "adapters' rank, up to 64; at least --max-loras)")
    p.add_argument("--max-lora-rank", type=positive_int, default=None,
                   help="largest adapter rank; every slot is padded to it (default: the installed adapters' largest, "
                        "at least 16)")
    p.add_argument("--max-model-len", type=positive_int, default=None,
                   help="context length (default: the model's own, lowered only to fit the KV cache)")
    p.add_argument("--max-num-seqs", type=positive_int, default=None,
                   help="sequences per engine step (default: vLLM's server default, 128 on CPU)")
    p.add_argument("--kv-cache-memory", type=parse_size, default=None,
                   help="KV cache size, e.g. 256MiB (default on CPU: the model's full context, within 256MiB-4GiB "
                        "and 1/8 of free RAM; on CUDA vLLM sizes it)")
    p.add_argument("--preload", action="append", default=[], metavar="NAME",
                   help="load this stored adapter onto the device before reporting ready (repeatable)")
    p.add_argument("--max-adapter-size", type=parse_size, default=4 << 30,
                   help="refuse adapter weight files larger than this (default: 4GiB)")
    p.add_argument("--snapshot-budget", type=parse_size, default=SNAPSHOT_BUDGET, metavar="SIZE",
                   help="disk kept for private copies of adapters placed by hand or used from a folder once "
                        "no request holds them (default: 2GiB); copies in use are always kept")
    p.add_argument("--no-prefix-caching", action="store_true", help="disable vLLM's prefix cache")
    p.add_argument("--no-cpu-fixes", action="store_true",
                   help="do not install the fixes for vLLM's CPU LoRA bugs (to reproduce them; never in production)")
    p.add_argument("--admission", choices=POLICIES, default=DEFAULT_POLICY,
                   help="which waiting adapter gets a freed device slot: 'measured' is batching whose hand-over bound "
                        "is the measured hand-over cost and which closes one adapter per starving adapter at once, "
                        "'batching' drains a hot adapter's queue "
                        "in one batch while bounding every wait (--admission-max-wait), 'adaptive' is batching with the bound "
                        "lowered to the measured drain, 'first-come' admits in "
                        "arrival order, 'passthrough' holds nothing while no device pin is held (vLLM's scheduler "
                        "keeps each step within max_loras), 'auto' is measured on the CPU with loractl's LoRA ops (a mixed step "
                        "costs more there) and passthrough elsewhere; change it while serving with loractl admission "
                        f"(default: {DEFAULT_POLICY})")
    p.add_argument("--admission-max-wait", type=float, default=DEFAULT_MAX_WAIT_S, metavar="SECONDS",
                   help="batching; measured and adaptive (at most, and before anything is measured): after a request for "
                        "another adapter waited this long, an adapter holding a slot stops taking new requests and hands "
                        f"it over (default: {DEFAULT_MAX_WAIT_S})")
    p.add_argument("--prefetch", action=argparse.BooleanOptionalAction, default=False,
                   help="while a request waits at the admission gate for an adapter on disk, load it into host RAM "
                        "if an entry is free or held by no request (--no-prefetch: only the engine step loads it); "
                        "default: off, as it did not pay on CPU (docs/benchmarks.md, 'Prefetch at the gate')")
    p.add_argument("--shutdown-grace", type=float, default=10.0,
                   help="seconds running generations get to finish on SIGTERM (default: 10)")
    p.add_argument("--keep-alive", type=keep_alive.duration_arg, default=None, metavar="DURATION",
                   help="after this long with no request the engine sleeps, giving its memory back (CUDA: vLLM's "
                        "sleep mode; CPU: the engine stops); the next request wakes it. 5m, 300s, 1h; 0 or forever: "
                        "never (default: 5m on CUDA, forever on the CPU)")
    p.add_argument("--sleep-level", choices=("1", "2"), default="1",
                   help="vLLM's sleep mode level for --keep-alive on CUDA: 1 keeps the weights in host RAM (faster "
                        "wake), 2 drops them too and reloads them from disk at wake (default: 1)")
    p.add_argument("--socket-group", metavar="GROUP",
                   help="make the socket 0660 and owned by GROUP (the system unit uses 'loractl'); default: 0600")
    p.add_argument("--max-message-size", type=parse_size, default=DEFAULT_MAX_MESSAGE_BYTES, metavar="SIZE",
                   help="refuse socket (gRPC) request messages larger than this with RESOURCE_EXHAUSTED, before "
                        "reading them (default: 4MiB)")
    http_settings.add_arguments(p, parse_size, positive_int, positive_seconds)
    dynamo_settings.add_arguments(p)
    openai_serving.add_arguments(p)
    p.add_argument("--auto-pull", action="store_true",
                   help="a request naming a Hub reference (org/repo) that is not in the store pulls it first; "
                        "over HTTP only with --api-key-file (default: off)")
    p.add_argument("--grpc-writes", choices=("coalesced", "per-frame"), default="coalesced",
                   help="how the socket's gRPC server writes: 'coalesced' gathers a stream's frames into one write "
                        "per loop turn, 'per-frame' is grpclib's own server (a benchmark's control; default: coalesced)")
    p.add_argument("--gc-freeze", action=argparse.BooleanOptionalAction, default=True,
                   help="once started, move the start-up heap out of the garbage collector's sight, as vLLM's server "
                        "does (--no-gc-freeze: a benchmark's control; default: on)")
    p.add_argument("--log-level", default="INFO",
                   choices=("DEBUG", "INFO", "WARNING", "ERROR"),
                   help="log verbosity on stderr (default: INFO, or $LORACTL_LOG_LEVEL)")
    p.add_argument("--version", action="version", version=f"loractld {__version__}")
    return p


def settings_from(args: argparse.Namespace) -> DaemonSettings:
    if not args.model:
        raise InvalidRequest("no base model given", "Pass --model PATH_OR_REPO (or 'demo'), or set model in the config file.")
    if not args.admission_max_wait >= 0:
        raise InvalidRequest(f"--admission-max-wait must be 0 or more seconds, got {args.admission_max_wait}")
    if args.max_cpu_loras is not None and args.max_loras is not None and args.max_cpu_loras < args.max_loras:
        raise InvalidRequest(
            f"--max-cpu-loras ({args.max_cpu_loras}) is below --max-loras ({args.max_loras})",
            f"Every adapter on the device is also cached on the host: use --max-cpu-loras {args.max_loras} or more.",
        )
    engine = EngineSettings(
        model=args.model, device=args.device, dtype=args.dtype, max_loras=args.max_loras,
        max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank or 0, max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs, kv_cache_bytes=args.kv_cache_memory,
        enable_prefix_caching=not args.no_prefix_caching, cpu_fixes=not args.no_cpu_fixes,
        chat_template=_read_template(args.chat_template) if args.chat_template else None,
        openai=openai_serving.options_from(args), engine_args=dict(getattr(args, "engine_args", None) or {}),
    )
    return DaemonSettings(engine=engine, home=args.home, socket=args.socket, shutdown_grace_s=args.shutdown_grace,
                          max_adapter_bytes=args.max_adapter_size, snapshot_budget=args.snapshot_budget, preload=tuple(args.preload or ()),
                          socket_group=args.socket_group, served_model_name=args.served_model_name,
                          http=http_settings.settings_from(args), admission_policy=args.admission,
                          admission_max_wait_s=args.admission_max_wait, max_message_bytes=args.max_message_size,
                          dynamo=dynamo_settings.settings_from(args), auto_pull=args.auto_pull,
                          prefetch=args.prefetch, keep_alive_s=args.keep_alive, sleep_level=int(args.sleep_level),
                          grpc_coalesce=args.grpc_writes == "coalesced", gc_freeze=args.gc_freeze)


def _read_template(path: str) -> str:
    try:
        text = Path(path).expanduser().read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise InvalidRequest(f"cannot read the chat template {path}: {e.strerror if isinstance(e, OSError) else e}",
                             "Give --chat-template the path of a Jinja template file.") from e
    if not text.strip():
        raise InvalidRequest(f"the chat template {path} is empty", "Give --chat-template a Jinja template file.")
    return text


def _quiet_vllm_import() -> None:
    """vLLM's logging level, read when vllm is imported (for its flags, before the settings are
    resolved): its start-up warnings are nothing a loractl user can act on (see main)."""
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")


def _passthrough(leftover: list[str], from_file: dict, from_env: dict, file_name: str) -> dict:
    """vLLM's engine flags among what loractld's parser left (``engine_flags``)."""
    if not (leftover or from_file or from_env):
        return {}
    hide_media_packages(children=True)  # before vLLM's import, as for the engine (worker/media_packages.py)
    _quiet_vllm_import()
    own = [o for a in build_parser()._actions for o in a.option_strings if o.startswith("--")]
    return engine_flags.parse_leftovers(leftover, from_file, from_env, own_options=own, file_name=file_name)


def _vllm_help(keyword: str) -> None:
    hide_media_packages(children=True)
    _quiet_vllm_import()
    engine_flags.print_help(keyword)


def _run(coro):
    """uvloop where installed (the engine extras bring it), as vLLM's own server runs: its
    socket and callback handling is what a request's trip through the daemon is made of."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


def main(argv: list[str] | None = None) -> None:
    keep_cuda_uninitialized()  # first: nothing before vLLM's fork may initialize CUDA (engine/device.py)
    argv = engine_flags.normalize_argv(sys.argv[1:] if argv is None else argv)
    try:
        wanted_help = next((a.split("=", 1)[1] for a in argv if a.startswith("--help=")), None)
        if wanted_help is not None:
            _vllm_help(wanted_help)
            sys.exit(0)
        args = config.resolve(build_parser, argv, _passthrough)
    except LoractlError as e:
        print(f"loractld: error: {e.message}\nhint: {e.hint}", file=sys.stderr)
        sys.exit(e.exit_code)
    # Before anything imports transformers (worker/media_packages.py), after the arguments: it may
    # import torchvision to see whether it works, which --help and --version need not wait for.
    hide_media_packages(children=True)
    logging.basicConfig(level=args.log_level, stream=sys.stderr, format=audit.FORMAT)
    audit.install(sys.stderr)  # audit lines whatever --log-level says
    # vLLM's own logging (read when vllm is imported, in this process and the engine's):
    # at the default level its dozen start-up warnings (Triton, tcmalloc, deprecations) are
    # nothing a loractl user can act on; its errors still show, and --log-level DEBUG
    # brings everything back. An explicit VLLM_LOGGING_LEVEL wins.
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "DEBUG" if args.log_level == "DEBUG" else "ERROR")
    try:
        code = _run(serve(settings_from(args)))
    except LoractlError as e:
        print(f"loractld: error: {e.message}\nhint: {e.hint}", file=sys.stderr)
        if os.environ.get("LORACTL_DEBUG"):
            raise
        code = e.exit_code
    sys.exit(code)


if __name__ == "__main__":
    main()
