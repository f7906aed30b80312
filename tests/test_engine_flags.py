"""vLLM's engine flags through loractld (issue 56): passed through by vLLM's own parser, as flags,
config keys and variables; loractld's own refused by name; status shows what is in effect.

The parsing tests run loractld's real resolution (``config.resolve`` with ``main._passthrough``,
vLLM's real ``AsyncEngineArgs.add_cli_args``); the daemon test runs a real engine and reads the
value back from vLLM's own settled config through ``loractl status --json``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from conftest import BIN, run_cli, start_daemon, sub_home


# Each resolution runs in a fresh interpreter, as the daemon's own does (vLLM's parser is built
# there): the suite's process has imported and patched much of vLLM by the time this module runs.
CHILD = """
import json, os, sys
from loractl.errors import LoractlError
from loractld import config, main
out = []
for case in json.load(sys.stdin):
    saved = dict(os.environ)
    os.environ.update(case.get("env", {}))
    try:
        a = config.resolve(main.build_parser, main.engine_flags.normalize_argv(case["argv"]), main._passthrough)
        out.append({"engine_args": a.engine_args, "max_loras": a.max_loras, "max_num_seqs": a.max_num_seqs,
                     "model": a.model})
    except LoractlError as e:
        out.append({"error": e.message, "hint": e.hint})
    finally:
        os.environ.clear()
        os.environ.update(saved)
print(json.dumps(out, default=str))
"""


def resolve_all(cases: list[dict]) -> list[dict]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORACTLD_")}
    done = subprocess.run([sys.executable, "-c", CHILD], input=json.dumps(cases), capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


REFUSED = [
    (["--enable-lora"], "--enable-lora is set by loractld itself", "loractl pull"),
    (["--kv-cache-memory-bytes", "1G"], "--kv-cache-memory-bytes is set by loractld itself", "--kv-cache-memory"),
    (["--enable-sleep-mode"], "--enable-sleep-mode is set by loractld itself", "--keep-alive"),
    (["--no-enable-prefix-caching"], "--enable-prefix-caching is set by loractld itself", "--no-prefix-caching"),
    (["--lora-modules", "sql=/tmp/a"], "--lora-modules is a `vllm serve` flag", "--preload"),
    (["--port", "8000"], "--port is a `vllm serve` flag", "--http HOST:PORT"),
    (["--gpu-memory-utilisation", "0.5"], "unknown flag --gpu-memory-utilisation", "--help=all"),
    (["--gpu-memory-utilization", "lots"], "invalid float value: 'lots'", "--help=gpu-memory-utilization"),
]


@pytest.fixture(scope="module")
def resolved(tmp_path_factory) -> dict[str, dict]:
    """Every case of this module resolved in one fresh interpreter (vLLM's import, seconds, once)."""
    folder = tmp_path_factory.mktemp("engine-flags")
    config = folder / "loractld.toml"
    config.write_text('model = "tiny"\nmax-num-batched-tokens = 512\nseed = 7\n'
                      'speculative-config = { method = "ngram", num_speculative_tokens = 2, prompt_lookup_max = 3 }\n')
    typo = folder / "typo.toml"
    typo.write_text('model = "tiny"\nmax-num-batched-token = 512\n')
    env = {"LORACTLD_MAX_NUM_BATCHED_TOKENS": "640"}
    cases = {
        "typed": {"argv": ["--model", "tiny", "--max-num-batched-tokens", "1k", "--gpu-memory-utilization", "0.5",
                           "--enforce-eager", "--kv-cache-dtype", "fp8"]},
        "spelt": {"argv": ["--model", "tiny", "--max_num_batched_tokens=384", "--max_num_seqs", "3"]},
        "file": {"argv": ["--config", str(config)]},
        "file+env": {"argv": ["--config", str(config)], "env": env},
        "file+env+flag": {"argv": ["--config", str(config), "--max-num-batched-tokens", "768"], "env": env},
        "typo": {"argv": ["--config", str(typo)]},
        **{f"refused{i}": {"argv": ["--model", "tiny", *argv]} for i, (argv, _, _) in enumerate(REFUSED)},
    }
    return dict(zip(cases, resolve_all([{"env": {}, **case} for case in cases.values()])))


def test_a_vllm_engine_flag_passes_with_vllms_type(resolved):
    args = resolved["typed"]
    # vLLM's own types: its human_readable_int reads 1k as 1000; a float; a BooleanOptionalAction.
    assert args["engine_args"] == {"max_num_batched_tokens": 1000, "gpu_memory_utilization": 0.5,
                                   "enforce_eager": True, "kv_cache_dtype": "fp8"}
    assert args["model"] == "tiny" and args["max_loras"] is None   # loractld's own stay loractld's


def test_underscore_spelling_and_equals_as_vllm_reads_them(resolved):
    args = resolved["spelt"]
    assert args["engine_args"] == {"max_num_batched_tokens": 384}
    assert args["max_num_seqs"] == 3    # loractld's flag, spelt as vLLM allows


def test_config_keys_and_variables_reach_vllms_fields_in_order(resolved):
    plain, from_env, flag = resolved["file"], resolved["file+env"], resolved["file+env+flag"]
    assert plain["engine_args"]["max_num_batched_tokens"] == 512 and plain["engine_args"]["seed"] == 7
    assert plain["engine_args"]["speculative_config"]["num_speculative_tokens"] == 2   # a TOML table, vLLM's JSON type
    # flag > environment > file, as for loractld's own settings
    assert from_env["engine_args"]["max_num_batched_tokens"] == 640
    assert flag["engine_args"]["max_num_batched_tokens"] == 768


def test_refused_by_name_with_loractlds_way(resolved):
    answers = [resolved[f"refused{i}"] for i in range(len(REFUSED))]
    for (argv, says, hint), answer in zip(REFUSED, answers):
        assert says in answer.get("error", ""), (argv, answer)
        assert hint in answer["hint"], (argv, answer)
    assert "did you mean --gpu-memory-utilization?" in answers[6]["error"]


def test_unknown_config_key_named_with_the_closest(resolved):
    answer = resolved["typo"]
    assert "unknown key 'max-num-batched-token'" in answer["error"]
    assert "did you mean 'max-num-batched-tokens'?" in answer["error"]


def test_refusal_is_one_line_and_a_hint_from_the_command():
    result = subprocess.run([str(BIN / "loractld"), "--model", "tiny", "--enable-lora"], capture_output=True,
                            text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.splitlines() == ["loractld: error: --enable-lora is set by loractld itself",
                                          "hint: LoRA is always on in loractld: store adapters with `loractl pull`."]


def test_loractlds_own_flags_alone_do_not_import_vllm():
    """The daemon binds its socket before the engine starts; vLLM's import (seconds) waits for it."""
    code = ("import sys; from loractld import config, main; "
            "a = config.resolve(main.build_parser, ['--model', 'tiny', '--max-loras', '3'], main._passthrough); "
            "assert a.engine_args == {} and a.max_loras == 3, a; "
            "assert 'vllm' not in sys.modules, 'vllm imported'")
    env = {k: v for k, v in os.environ.items() if not k.startswith("LORACTLD_")}
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60, env=env)


def test_help_shows_vllms_groups_and_one_group():
    pages = {page: subprocess.Popen([str(BIN / "loractld"), f"--help={page}"], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
             for page in ("engine", "CacheConfig")}   # side by side: each imports vLLM (seconds)
    (groups, groups_err), (one, _) = (proc.communicate(timeout=180) for proc in pages.values())
    assert pages["engine"].returncode == 0, groups_err
    for title in ("ModelConfig", "CacheConfig", "ParallelConfig", "SchedulerConfig", "LoRAConfig"):
        assert title in groups
    assert "--gpu-memory-utilization" in one and "--tensor-parallel-size" not in one
    own = subprocess.run([str(BIN / "loractld"), "--help"], capture_output=True, text=True, timeout=60)
    assert own.stdout.index("--max-loras") < own.stdout.index("vLLM's engine flags")


def test_a_passed_flag_and_key_are_in_effect_in_the_engine(home, reference):
    """--max-num-batched-tokens as a flag and seed as a config key: vLLM's settled config has both,
    status shows them under vLLM's names, and the engine still answers as HF + PEFT."""
    root = sub_home(home, "engine-flags")
    file = root / "loractld.toml"
    file.write_text("seed = 7\n")
    d = start_daemon(root, "--config", str(file), "--max-num-batched-tokens", "384", name="ef")
    try:
        result = run_cli("status", "--json", "--socket", str(d.socket))
        assert result.returncode == 0, result.stderr
        engine = json.loads(result.stdout)["engine"]
        assert engine["engine_args"]["max_num_batched_tokens"] == 384   # vLLM's scheduler_config
        assert engine["engine_args"]["seed"] == 7                       # vLLM's model_config
        assert engine["engine_args"]["max_loras"] == engine["max_loras"] == 2
        human = run_cli("status", "--socket", str(d.socket)).stdout
        assert "max_num_batched_tokens=384" in human
        prompt = "Write a query"
        out = run_cli("run", "-t", "0", "-n", "12", "--json", prompt, "--socket", str(d.socket))
        assert out.returncode == 0, out.stderr
        assert json.loads(out.stdout)["token_ids"] == reference.greedy(reference.chat_ids(prompt), None, 12)
    finally:
        d.stop()
