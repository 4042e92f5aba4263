#!/usr/bin/env bash
# Set up .venv if needed, then run the whole test suite (CPU only, no network).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/setup_env.sh"
cd "$ROOT"
# Debian's chromium, for the test that opens `nexrl report`'s page in a real headless browser
# (tests/core/test_report.py skips without it): tried once per venv, only as root with apt-get,
# quietly; the tests go on when it fails. Here, not in setup_env.sh: the quickstart installs no system package.
CHROMIUM_TRIED="$VENV/.nexrl-chromium-tried"
if ! command -v chromium >/dev/null 2>&1 && [ ! -e "$CHROMIUM_TRIED" ] && [ "$(id -u)" = 0 ] \
    && command -v apt-get >/dev/null 2>&1; then
  touch "$CHROMIUM_TRIED"
  echo "test.sh: installing chromium (apt-get) for the browser test of nexrl report" >&2
  if ! { DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium \
         || { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq \
              --no-install-recommends chromium; }; } >/dev/null 2>&1; then
    echo "test.sh: could not install chromium; the browser test of nexrl report will skip" >&2
  fi
fi

export HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1
# Bytecode caches (__pycache__/, git-ignored) even where the environment turns them off: without
# them each pytest worker rewrites the asserts of every test module again (collection ~20 s -> ~10 s).
unset PYTHONDONTWRITEBYTECODE
# Lint first (config: pyproject.toml [tool.ruff]): CI (.ci/run) fails on a finding before any test runs.
"$VENV/bin/ruff" check --quiet "$ROOT"
# Type check of the core and the plugins (config: pyproject.toml [tool.mypy]; incremental cache in
# .mypy_cache/), beside the tests: the suite leaves part of the 2 cores idle (subprocess and Ray
# start-ups), which mypy's one thread takes; its findings are printed and fail the run at the end.
MYPY_OUT="$(mktemp)"
"$VENV/bin/mypy" --no-error-summary >"$MYPY_OUT" 2>&1 &
MYPY_PID=$!
# Two pytest workers (pytest-xdist) by default: much of the suite waits on subprocesses, Ray and
# sockets, so two keep 2 cores busy (three measured slower). NEXRL_TEST_WORKERS=0 runs in one process.
status=0
"$VENV/bin/python" -m pytest -q -p no:cacheprovider -n "${NEXRL_TEST_WORKERS:-2}" --dist worksteal "$@" || status=$?
if ! wait "$MYPY_PID"; then
  echo "test.sh: mypy found problems:" >&2
  cat "$MYPY_OUT" >&2
  status=1
fi
rm -f "$MYPY_OUT"
exit "$status"
