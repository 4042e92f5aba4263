#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (CPU only, no network).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Lint first (config: pyproject.toml [tool.ruff]): CI (.ci/run) fails on a finding before any test runs.
"$VENV/bin/ruff" check --quiet "$ROOT"
# Type check of nexrl_core/ (config: pyproject.toml [tool.mypy]; incremental cache in .mypy_cache/).
"$VENV/bin/mypy" --no-error-summary
# Two pytest workers (pytest-xdist) by default: much of the suite waits on subprocesses, Ray and
# sockets, so two keep 2 cores busy. NEXRL_TEST_WORKERS=0 runs in one process.
exec "$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${NEXRL_TEST_WORKERS:-2}" --dist worksteal "$@"
