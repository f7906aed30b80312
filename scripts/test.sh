#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: a real vLLM engine on the CPU, a real
# daemon on a real socket, outputs checked against HF transformers + PEFT. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
# Two workers (pytest-xdist), each running whole files: a daemon's start is mostly one core's
# imports, so two at once use the machine's second core; module fixtures start once per file.
# Files go out in collection order (the longest first: tests/support_background.py), not
# xdist's default of the most tests first, which left the one-test builds to the end, alone.
exec .venv/bin/python -m pytest -q -n "${LORACTL_TEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder --durations=15 "$@"
