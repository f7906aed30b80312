#!/usr/bin/env bash
# Open WebUI in headless Chromium against loractld's Ollama API (issue 39, item 5): the model
# picker lists the adapters and a profile of two weighted adapters (issue 47, made with loractl
# create first), sql-expert:v1 answers in SQL, pirate:v1 like a pirate, the profile exactly as
# loractl run --lora sql-pirate does. Writes
# screenshots (default .cache/webui-check/shots) and exits non-zero on a failure. Arguments go
# to scripts/webui_check.py (--url URL uses a running daemon, --out DIR, --help).
#
# Installs what is missing first: the daemon's venv (scripts/setup.sh main; LORACTL_BIN=DIR uses
# the loractl and loractld in DIR instead, and skips it), Debian's chromium
# and chromium-driver (as root, with apt-get), and Open WebUI with Selenium in .venv-webui
# (about 2.9 GiB; a few minutes). Not part of the test suite: see README, "Ollama's API".
set -euo pipefail
cd "$(dirname "$0")/.."

WEBUI_VENV=${LORACTL_WEBUI_VENV:-.venv-webui}
OPEN_WEBUI=${OPEN_WEBUI_VERSION:-0.12.4}
PY=${PYTHON:-$(command -v python3.11 || command -v python3)}

[ -n "${LORACTL_BIN:-}" ] || bash scripts/setup.sh main

if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "webui-check: installing Debian's chromium and chromium-driver"
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null 2>&1 \
      || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null; }
  else
    echo "webui-check: error: chromium and chromedriver are needed (Debian: apt-get install chromium chromium-driver)" >&2
    exit 1
  fi
fi

if ! "$WEBUI_VENV/bin/python" -c 'import open_webui, selenium' 2>/dev/null; then
  echo "webui-check: installing open-webui==$OPEN_WEBUI and selenium in $WEBUI_VENV (about 2.9 GiB, minutes)"
  [ -x "$WEBUI_VENV/bin/python" ] || "$PY" -m venv "$WEBUI_VENV"
  # Open WebUI depends on torch (sentence-transformers); the check loads no embedding model, so
  # any build works: take the CPU build .venv has (found where pip found it), not a CUDA one.
  constraints=$(mktemp)
  trap 'rm -f "$constraints"' EXIT
  torch=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("torch"))' 2>/dev/null || true)
  [ -z "$torch" ] || echo "torch==$torch" > "$constraints"
  "$WEBUI_VENV/bin/python" -m pip --disable-pip-version-check install -q -c "$constraints" \
    "open-webui==$OPEN_WEBUI" selenium 2>&1 | { grep -v "^WARNING: Location '.*' is ignored" || true; }
  "$WEBUI_VENV/bin/python" -c 'import open_webui, selenium' \
    || { echo "webui-check: $WEBUI_VENV does not import open_webui and selenium; see the pip output above" >&2; exit 1; }
fi

args=(--webui-venv "$WEBUI_VENV")
[ -z "${LORACTL_BIN:-}" ] || args+=(--loractl-bin "$LORACTL_BIN")
exec "$WEBUI_VENV/bin/python" scripts/webui_check.py "${args[@]}" "$@"
