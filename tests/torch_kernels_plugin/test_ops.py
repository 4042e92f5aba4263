"""The kernels as torch ops (``torch.ops.nexrl_kernels.*``): what each checks at its boundary, what its
schema declares it writes, that the profiler sees it, and the kernel tests on a machine whose
compiler fails."""

from __future__ import annotations

import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.support.kernels import compiled_kernels

ROWS, HEADS, KV_HEADS, DIM, CAPACITY, HIDDEN, K = 3, 4, 2, 8, 12, 8, 24
REPO = Path(__file__).resolve().parents[2]
OPS = ("attend", "add_rms_norm", "silu_mul", "pack_linear", "linear")


def _attend_args(dtype=torch.float32, **changed):
    """Good arguments of ``attend`` (as a dict), with some replaced."""
    generator = torch.Generator().manual_seed(0)
    args = dict(qkv=torch.randn(ROWS, (HEADS + 2 * KV_HEADS) * DIM, generator=generator).to(dtype),
                cos=torch.rand(ROWS, DIM, generator=generator).to(dtype),
                sin=torch.rand(ROWS, DIM, generator=generator).to(dtype),
                keys=torch.randn(ROWS, KV_HEADS, CAPACITY, DIM, generator=generator).to(dtype),
                values=torch.randn(ROWS, KV_HEADS, CAPACITY, DIM, generator=generator).to(dtype),
                starts=torch.tensor([0, 2, 5]), column=5, scaling=DIM ** -0.5,
                out=torch.zeros(ROWS, HEADS * DIM, dtype=dtype), cache_rows=None)
    return {**args, **changed}


def _norm_args(**changed):
    generator = torch.Generator().manual_seed(1)
    args = dict(x=torch.randn(ROWS, HIDDEN, generator=generator), delta=torch.randn(ROWS, HIDDEN, generator=generator),
                weight=torch.rand(HIDDEN, generator=generator), eps=1e-5, out=torch.zeros(ROWS, HIDDEN))
    return {**args, **changed}


def _silu_args(**changed):
    return {**dict(gate_up=torch.randn(ROWS, 2 * HIDDEN), out=torch.zeros(ROWS, HIDDEN)), **changed}


def _linear_args(kernels, **changed):
    weight = torch.randn(20, K)
    args = dict(x=torch.randn(ROWS, K), packed=kernels.pack_linear([weight]), n=20, bias=torch.randn(20))
    return {**args, **changed}


def _transposed(t):
    """``t``'s values with its last two dimensions' strides swapped: no longer contiguous."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


# (op, its arguments from the kernels, the error, its message): each names the op and the argument.
BAD = [
    ("attend", lambda k: _attend_args(qkv=torch.randn(ROWS, 64, dtype=torch.float64)), TypeError,
     r"nexrl_kernels::attend: qkv is Double, expected Float \(float32\) or BFloat16"),
    ("attend", lambda k: _attend_args(cos=torch.rand(ROWS, DIM, dtype=torch.bfloat16)), TypeError,
     "attend: cos is BFloat16 but qkv is Float"),
    ("attend", lambda k: _attend_args(sin=torch.rand(ROWS, DIM + 2)), ValueError,
     r"attend: sin has shape \[3, 10\], expected \[3, 8\]"),
    ("attend", lambda k: _attend_args(qkv=torch.randn(ROWS, 7 * DIM)), ValueError,
     r"attend: qkv has shape \[3, 56\], expected \[3, 64\]"),
    ("attend", lambda k: _attend_args(qkv=_transposed(torch.randn(ROWS, 64))), ValueError,
     r"attend: qkv's rows must be contiguous \(shape \[3, 64\], strides \[1, 3\]\)"),
    ("attend", lambda k: _attend_args(keys=_transposed(torch.randn(ROWS, KV_HEADS, CAPACITY, DIM))), ValueError,
     "attend: keys must be contiguous"),
    ("attend", lambda k: _attend_args(values=torch.randn(ROWS, KV_HEADS, CAPACITY + 1, DIM)), ValueError,
     r"attend: values has shape \[3, 2, 13, 8\], expected \[3, 2, 12, 8\]"),
    ("attend", lambda k: _attend_args(starts=torch.tensor([0, 2, 5], dtype=torch.int32)), TypeError,
     "attend: starts is Int, expected Long"),
    ("attend", lambda k: _attend_args(starts=torch.tensor([0, 6, 5])), ValueError,
     "attend: cache row 1 starts at column 6, past the new column 5"),
    ("attend", lambda k: _attend_args(column=CAPACITY), ValueError,
     "attend: column 12 is outside the cache's capacity 12"),
    ("attend", lambda k: _attend_args(cache_rows=torch.tensor([0, 3, 1])), ValueError,
     "attend: row 1's cache row 3 is not one of the cache's 3 rows"),
    ("attend", lambda k: _attend_args(out=torch.zeros(ROWS, HEADS * DIM, device="meta")), ValueError,
     "attend: out is on meta, the kernels run on the CPU"),
    ("add_rms_norm", lambda k: _norm_args(weight=torch.rand(HIDDEN + 1)), ValueError,
     r"add_rms_norm: weight has shape \[9\], expected \[8\]"),
    ("add_rms_norm", lambda k: _norm_args(x=_transposed(torch.randn(ROWS, HIDDEN))), ValueError,
     "add_rms_norm: x must be contiguous"),
    ("add_rms_norm", lambda k: _norm_args(delta=torch.randn(ROWS, HIDDEN, dtype=torch.bfloat16)), TypeError,
     "add_rms_norm: delta is BFloat16 but x is Float"),
    ("silu_mul", lambda k: _silu_args(gate_up=torch.randn(ROWS, HIDDEN)), ValueError,
     r"silu_mul: gate_up has shape \[3, 8\], expected \[3, 16\]"),
    ("silu_mul", lambda k: _silu_args(out=torch.zeros(ROWS, HIDDEN, dtype=torch.int32)), TypeError,
     "silu_mul: out is Int, expected Float"),
    ("linear", lambda k: _linear_args(k, x=torch.randn(ROWS, K, dtype=torch.bfloat16)), TypeError,
     "linear: x is BFloat16, expected Float"),
    ("linear", lambda k: _linear_args(k, n=40), ValueError,
     r"linear: packed weight holds 768 values, 1152 for 40 outputs of 24 inputs \(x has shape \[3, 24\]\)"),
    ("linear", lambda k: _linear_args(k, bias=torch.randn(21)), ValueError,
     r"linear: bias has shape \[21\], expected \[20\]"),
    ("pack_linear", lambda k: dict(weights=[torch.randn(4, K), torch.randn(4, K + 1)], packed=torch.zeros(16 * K)),
     ValueError, "pack_linear: weights of 24 and 25 inputs: linears packed together share their input"),
    ("pack_linear", lambda k: dict(weights=[torch.randn(4, K)], packed=torch.zeros(16 * K, dtype=torch.float64)),
     TypeError, "pack_linear: packed is Double, expected Float"),
]


@pytest.mark.parametrize("op,make,error,message", BAD, ids=[f"{op}-{i}" for i, (op, *_) in enumerate(BAD)])
def test_a_bad_argument_is_refused_by_name_before_anything_is_written(op, make, error, message):
    kernels = compiled_kernels()
    args = make(kernels)
    before = {name: value.clone() for name, value in args.items()
              if isinstance(value, torch.Tensor) and value.device.type == "cpu"}
    with pytest.raises(error) as raised:
        getattr(torch.ops.nexrl_kernels, op)(**args)
    assert str(raised.value).startswith(f"nexrl_kernels::{op}: ") and re.search(message, str(raised.value)), \
        str(raised.value)
    for name, value in before.items():
        assert torch.equal(args[name], value), f"{op} wrote {name} before refusing"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_schemas_declare_the_outputs_each_op_writes(dtype):
    """torch's own check of a custom op's schema: inputs it writes are marked ``(a!)``, the others are untouched."""
    kernels = compiled_kernels()
    calls = [("attend", _attend_args(dtype)), ("attend", _attend_args(dtype, cache_rows=torch.tensor([2, 0]),
                                                                     qkv=_attend_args(dtype)["qkv"][:2],
                                                                     cos=_attend_args(dtype)["cos"][:2],
                                                                     sin=_attend_args(dtype)["sin"][:2],
                                                                     out=torch.zeros(2, HEADS * DIM, dtype=dtype))),
             ("add_rms_norm", {k: v.to(dtype) if isinstance(v, torch.Tensor) else v for k, v in _norm_args().items()}),
             ("add_rms_norm", _norm_args(delta=None)),
             ("silu_mul", {k: v.to(dtype) for k, v in _silu_args().items()})]
    if dtype == torch.float32:
        calls += [("pack_linear", dict(weights=[torch.randn(5, K), torch.randn(20, K)], packed=torch.zeros(32 * K))),
                  ("linear", _linear_args(kernels)), ("linear", _linear_args(kernels, bias=None))]
    for op, args in calls:
        result = torch.library.opcheck(getattr(torch.ops.nexrl_kernels, op).default, (), args,
                                       test_utils=("test_schema",))
        assert result == {"test_schema": "SUCCESS"}, (op, result)


def test_each_op_appears_in_the_profiler_by_name():
    kernels = compiled_kernels()
    packed = kernels.pack_linear([torch.randn(20, K)])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        kernels.attend(**_attend_args())
        kernels.add_rms_norm(**_norm_args())
        kernels.silu_mul(**_silu_args())
        kernels.pack_linear([torch.randn(20, K)], packed)
        kernels.linear(torch.randn(ROWS, K), packed, 20, None)
    counts = {event.key: event.count for event in profile.key_averages()}
    assert all(counts.get(f"nexrl_kernels::{op}") == 1 for op in OPS), counts


def test_with_a_compiler_that_fails_the_kernel_tests_skip_with_its_reason(tmp_path):
    """This folder's tests in a fresh process whose ``CXX`` exits 1: the kernels' tests skip naming
    why, and the rest (the engine decoding with torch ops, the compiler checks) pass."""
    failing = tmp_path / "g++"
    failing.write_text("#!/bin/sh\nexit 1\n")
    failing.chmod(failing.stat().st_mode | stat.S_IEXEC)
    this = Path(__file__).relative_to(REPO).as_posix()
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", str(Path(this).parent),
         "--deselect", f"{this}::test_with_a_compiler_that_fails_the_kernel_tests_skip_with_its_reason"],
        capture_output=True, text=True, cwd=REPO, timeout=900,
        env={**os.environ, "CXX": str(failing), "NEXRL_CACHE_DIR": str(tmp_path / "cache")})
    summary = done.stdout.strip().splitlines()[-1]
    counts = {word: int(number) for number, word in re.findall(r"(\d+) (passed|skipped|failed|errors?)", summary)}
    assert done.returncode == 0 and set(counts) == {"passed", "skipped"}, done.stdout[-3000:]
    assert counts["skipped"] >= len(BAD), summary  # this file's kernel tests at least
    skips = [line for line in done.stdout.splitlines() if line.startswith("SKIPPED")]
    reason = f"the compiled decode kernels cannot be built here: {failing} --version failed (exit 1)"
    assert skips and all(reason in line for line in skips), skips
    assert not (tmp_path / "cache" / "kernels").exists()  # no build tried
