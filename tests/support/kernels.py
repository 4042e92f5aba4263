"""The compiled CPU decode kernels for tests: built (or loaded from the cache) once per process."""

from __future__ import annotations

import shutil

import pytest

from nexrl_grpo.cpu_kernels import DecodeKernels, decode_kernels


def compiled_kernels() -> DecodeKernels:
    """The kernels; skips only where no C++ compiler exists (a failing build fails the test)."""
    if not any(shutil.which(name) for name in ("c++", "g++", "clang++")):
        pytest.skip("no C++ compiler on PATH: the compiled decode kernels cannot be built here")
    return decode_kernels()
