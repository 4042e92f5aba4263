#!/usr/bin/env bash
# .whl/: what benchmarks/gpu_check.py needs on the lent GPU machine and it lacks (it has torch,
# transformers, accelerate, numpy, pyarrow, pandas, pytest, rich, pyyaml, pluggy; no network):
# nexrl's own wheels built from this tree, TRL and its dataset stack, nexrl-core's small
# dependencies. Pinned to what the CPU venv runs; Python 3.12 binaries where a package has them.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo '/.whl/' >> .git/info/exclude
grep -qx '/.gpu_assets/' .git/info/exclude 2>/dev/null || echo '/.gpu_assets/' >> .git/info/exclude
rm -rf .whl && mkdir -p .whl
PY="${PYTHON:-.venv/bin/python}"
"$PY" -m pip wheel -q --no-deps --no-build-isolation -w .whl . plugins/nexrl_grpo
version() { "$PY" -c "import importlib.metadata as m; print(m.version('$1'))"; }
PACKAGES=(trl datasets dill multiprocess loguru omegaconf hydra-core openai distro jiter pydantic pydantic-core
          annotated-types typing-inspection sniffio)
SPECS=()
for name in "${PACKAGES[@]}"; do SPECS+=("$name==$(version "$name")"); done
"$PY" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "${SPECS[@]}"
# gpu_check.py's profile step: a static binary in a py2.py3 wheel (not a dependency of the CPU venv).
"$PY" -m pip download -q --no-deps --only-binary=:all: --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 \
    -d .whl "py-spy==0.4.3"
# Published as a source archive only (pure Python): built here.
"$PY" -m pip wheel -q --no-deps -w .whl "antlr4-python3-runtime==$(version antlr4-python3-runtime)"
du -sh .whl
ls .whl
