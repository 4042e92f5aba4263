"""The compiled CPU decode kernels for tests: built (or loaded from the cache) once per process."""

from __future__ import annotations

import pytest

from nexrl_grpo.cpu_kernels import DecodeKernels, KernelBuildError, decode_kernels, find_compiler


def compiler_or_skip() -> list[str]:
    """The command that builds the kernels here; skips the test where there is none."""
    try:
        return find_compiler()
    except KernelBuildError as exc:
        pytest.skip(f"the compiled decode kernels cannot be built here: {exc}")


def compiled_kernels() -> DecodeKernels:
    """The kernels; skips only where no C++ compiler exists (a failing build fails the test)."""
    compiler_or_skip()
    return decode_kernels()
