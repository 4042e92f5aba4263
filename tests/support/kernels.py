"""The compiled CPU decode kernels for tests: built (or loaded from the cache) once per process."""

from __future__ import annotations

import pytest

from nexrl_torch_kernels import CompilerUnusable, DecodeKernels, decode_kernels, usable_compiler


def compiler_or_skip() -> list[str]:
    """The command that builds the kernels here; skips the test where there is none, or only one
    that cannot build them (too old, or it does not run), naming why."""
    try:
        return usable_compiler()[0]
    except CompilerUnusable as exc:
        pytest.skip(f"the compiled decode kernels cannot be built here: {exc}")


def compiled_kernels() -> DecodeKernels:
    """The kernels; skips only where no usable C++ compiler exists (a failing build of the source fails the test)."""
    compiler_or_skip()
    return decode_kernels()
