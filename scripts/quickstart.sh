#!/usr/bin/env bash
# From nothing to a trained model: set up .venv, then GRPO-train SmolLM2 on the CPU.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
exec "$VENV/bin/nexrl" run recipes/quickstart.yaml "$@"
