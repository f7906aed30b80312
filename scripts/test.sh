#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: a real vLLM engine on the CPU, a real
# daemon on a real socket, outputs checked against HF transformers + PEFT. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers by default (LORACTL_TEST_WORKERS=N to change, 0 for one process): most tests wait
# on a daemon's start or on a subprocess, so a second worker saves about a third of the wall time.
workers=${LORACTL_TEST_WORKERS:-2}
parallel=()
[ "$workers" != 0 ] && parallel=(-n "$workers" --dist loadgroup --no-loadscope-reorder)
exec .venv/bin/python -m pytest -q --durations=15 "${parallel[@]}" "$@"
