#!/usr/bin/env bash
# The main job on the embedded default: set up, start loractld on the tiny demo model (built
# locally, offline), answer a prompt with the base model and with a demo adapter, stop.
# Files go under $LORACTL_HOME (default: ./.loractl-demo).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh

export LORACTL_HOME=${LORACTL_HOME:-$PWD/.loractl-demo}
mkdir -p "$LORACTL_HOME"
BIN=.venv/bin
log="$LORACTL_HOME/loractld.log"
prompt=${1:-Write a query that lists every user who ordered twice}

echo "demo: starting loractld --model demo (log: $log)"
"$BIN/loractld" --model demo --kv-cache-memory 128MiB --max-model-len 512 >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT

for _ in $(seq 1 240); do
  if "$BIN/loractl" status --json 2>/dev/null | grep -q '"ready": true'; then break; fi
  if ! kill -0 $daemon 2>/dev/null; then echo "demo: loractld exited; its log:" >&2; tail -20 "$log" >&2; exit 1; fi
  sleep 0.5
done
"$BIN/loractl" status

echo
echo "\$ loractl pull \$LORACTL_HOME/demo/adapters/sql-expert/v1 --name sql-expert/v1"
"$BIN/loractl" pull "$LORACTL_HOME/demo/adapters/sql-expert/v1" --name sql-expert/v1
echo
echo "\$ loractl ls"
"$BIN/loractl" ls
echo
echo "\$ loractl run --temperature 0 \"$prompt\""
"$BIN/loractl" run --temperature 0 --max-tokens 48 "$prompt"
echo
echo "\$ loractl run --lora sql-expert/v1 --temperature 0 \"$prompt\""
"$BIN/loractl" run --lora sql-expert/v1 --temperature 0 --max-tokens 48 "$prompt"
echo
echo "demo: done (the demo model has random weights: the text is noise, but exactly reproducible)"
