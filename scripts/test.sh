#!/usr/bin/env bash
# Set up (if needed) and run the whole test suite: a real vLLM engine on the CPU, a real
# daemon on a real socket, outputs checked against HF transformers + PEFT. Extra arguments go
# to pytest, e.g. `bash scripts/test.sh -k generate`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
exec .venv/bin/python -m pytest -q --durations=15 "$@"
