"""Compiled CPU kernels for the fast path's decode step (``csrc/decode_step.cpp``).

A float32 decode step of SmolLM2 at 16 rows spent about 15 ms outside its 38 ms of matmuls in some
1,200 small torch ops (norms, rotary, attention per run of rows, SiLU, residual adds), each a
dispatch and a pass over memory. The kernels do a layer's work between two matmuls in one call:
attention with the rotary and the cache write, the residual add with the next RMS norm, and
SiLU times up. Each row is computed by one thread in an order fixed by that row alone, so a row's
bits do not depend on its batch (see :mod:`nexrl_torch.rollout.decoding`).

The matmuls of a float32 model go through them too: a decode step streams every weight from memory
for a few rows, which oneDNN's prepacked matmul did at about 14 GB/s. Packed as panels of 16
output columns (:meth:`DecodeKernels.pack_linear`, in place after each weight push, at memory
speed), a weight is read front to back with a software prefetch ahead, and each row's input is
broadcast from a transposed copy: SmolLM2's linears at 16 rows in 28-33 ms against 35-39 ms.

The kernels are torch ops, ``torch.ops.nexrl_kernels.attend``, ``add_rms_norm``, ``silu_mul``,
``pack_linear`` and ``linear`` (``TORCH_LIBRARY``, with schemas that mark the outputs they write),
so that the profiler shows them by name and each call is checked at the C++ boundary: a wrong
device, dtype, shape or stride, or a cache row or start column out of range, raises a
``TypeError``/``ValueError`` naming the op and the argument before any memory is touched.
:class:`DecodeKernels` wraps them with the signatures the engine calls.

The source is compiled once per machine with the C++ compiler found (``$CXX``, else ``c++``,
``g++`` or ``clang++``; GCC 12 or newer, or clang) against the torch that is imported (the include
and library folders and C++ ABI of ``torch.utils.cpp_extension``, its OpenMP), for this CPU
(``-march=native``), in one compiler call into ``$NEXRL_CACHE_DIR/kernels`` (default
``~/.cache/nexrl/kernels``), then loaded with ``torch.ops.load_library``. The command is our own
rather than ``cpp_extension.load``: ``load`` needs ninja, keeps its own cache folder and naming,
and builds in steps; ours keeps the cache key, the atomic install and the compiler's own error
lines. The file's name hashes everything that went into it, so another torch, compiler or CPU
builds its own. A process registers the ops once (a namespace can be defined only once), from the
first file it loads. The engine's ``cpu_kernels`` key chooses: ``auto`` uses them when they build,
``true`` fails when they do not, ``false`` keeps the torch ops.
"""

from __future__ import annotations

import hashlib
import os
import re
import shlex
import shutil
import subprocess
import threading
import time
from pathlib import Path

import torch
from loguru import logger

SOURCE = Path(__file__).with_name("csrc") / "decode_step.cpp"
COMPILE_TIMEOUT_S = 600
FLAGS = ("-O3", "-march=native", "-fopenmp", "-std=c++17", "-shared", "-fPIC")
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}  # what the ops take (linear: float32 only)
LINEAR_LANES = 16  # output columns per panel of a packed weight (kLanes in the source)


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here; the message says why."""


class CompilerUnusable(KernelBuildError):
    """No C++ compiler here can build the kernels: none, one that does not run, or one too old."""


class DecodeKernels:
    """The ops ``torch.ops.nexrl_kernels.*`` (CPU, float32 or bfloat16 tensors of one dtype), built into
    ``path``. Each op checks its arguments' dtypes, shapes, strides and indices before it runs: a
    ``TypeError`` (dtype) or ``ValueError`` (the rest) naming the op and the argument."""

    def __init__(self, path: Path):
        self.path = path
        ops = torch.ops.nexrl_kernels
        # The overloads themselves: a call skips the packet's overload lookup (a decode step makes ~5 per layer).
        self._attend, self._add_rms_norm, self._silu_mul = ops.attend.default, ops.add_rms_norm.default, \
            ops.silu_mul.default
        self._pack_linear, self._linear = ops.pack_linear.default, ops.linear.default

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, starts: torch.Tensor, column: int, scaling: float, out: torch.Tensor,
               cache_rows: torch.Tensor | None = None) -> None:
        """One decode step's attention: ``qkv`` ``[rows, (heads + 2 kv_heads) * dim]`` (queries, keys,
        values; rows may be apart by any stride), ``cos``/``sin`` ``[rows, dim]``; rotates the new key and
        the queries, writes key and value into ``keys``/``values`` ``[cache rows, kv_heads, capacity, dim]``
        at ``column``, and writes into ``out`` ``[rows, heads * dim]`` each row's attention over its
        columns ``starts`` to ``column``. Row r's cache row is ``cache_rows[r]`` (int64; r when None);
        ``starts`` (int64) is per cache row."""
        self._attend(qkv, cos, sin, keys, values, starts, column, scaling, out, cache_rows)

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        """``x += delta`` in place (when given), then ``out = rms_norm(x) * weight``; ``x`` ``[rows, hidden]``."""
        self._add_rms_norm(x, delta, weight, eps, out)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up``, ``gate_up`` ``[rows, 2 * intermediate]`` (gate first)."""
        self._silu_mul(gate_up, out)

    def pack_linear(self, weights: list[torch.Tensor], packed: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights ``[n_i, k]`` of linears that share their input, packed as one weight for
        :meth:`linear` (their outputs side by side, in order); into ``packed`` when given (the same
        total shape: a refresh in place), else into a new tensor."""
        if packed is None:
            total = sum(w.shape[0] for w in weights)
            packed = torch.empty(-(-total // LINEAR_LANES) * LINEAR_LANES * weights[0].shape[-1], dtype=torch.float32)
        self._pack_linear([w.detach().contiguous() for w in weights], packed)
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T + bias`` for a float32 ``x`` ``[rows, k]`` (each row contiguous) and ``w`` packed by
        :meth:`pack_linear` (``n`` output columns): ``[rows, n]``."""
        return self._linear(x, packed, n, bias)


_lock = threading.Lock()
_loaded: DecodeKernels | None = None
_problem: str | None = None


def decode_kernels() -> DecodeKernels:
    """The kernels, compiled on the first call in this machine and loaded once per process; a
    :class:`KernelBuildError` (the same one on later calls) when they cannot be."""
    global _loaded, _problem
    with _lock:
        if _loaded is None and _problem is None:
            try:
                path = _build()
                _register(path)
                _loaded = DecodeKernels(path)
            except (KernelBuildError, OSError, RuntimeError) as exc:
                _problem = str(exc)
        if _loaded is None:
            raise KernelBuildError(_problem)
        return _loaded


def _register(path: Path) -> None:
    """Loads the ops from ``path`` unless this process has them already: a namespace is defined once per
    process, and another build of the same source (another cache folder or compiler) holds the same ops."""
    if not hasattr(torch.ops.nexrl_kernels, "attend"):
        torch.ops.load_library(str(path))


def find_compiler() -> list[str]:
    """The compiler's command: ``$CXX`` (which may carry a launcher or flags, ``ccache g++``), else the first of
    ``c++``, ``g++``, ``clang++`` on PATH."""
    named = shlex.split(os.environ.get("CXX", ""))
    if named:
        found = shutil.which(named[0])
        if not found:
            raise CompilerUnusable(f"CXX={shlex.join(named)!r} is not an executable on PATH")
        return [found, *named[1:]]
    for candidate in ("c++", "g++", "clang++"):
        found = shutil.which(candidate)
        if found:
            return [found]
    raise CompilerUnusable("no C++ compiler on PATH (c++, g++ or clang++; or set CXX)")


MIN_GCC = 12  # the oldest GCC seen to build the source (12.2 here); g++ 11 was seen to fail on it


def compiler_version_problem(version: str) -> str | None:
    """Why the compiler whose ``--version`` printed ``version`` cannot build the kernels, or None."""
    first = version.strip().splitlines()[0] if version.strip() else ""
    if "clang" in first.lower():
        return None
    numbers = re.findall(r"(\d+)\.(\d+)\.(\d+)", first)
    if numbers and ("g++" in first or "GCC" in first or "Free Software Foundation" in version):
        major = int(numbers[-1][0])
        if major < MIN_GCC:
            return f"GCC {'.'.join(numbers[-1])} is older than GCC {MIN_GCC}, which the kernels need"
    return None


def usable_compiler() -> tuple[list[str], str]:
    """The compiler's command and its ``--version`` text; :class:`CompilerUnusable` saying why not."""
    compiler = find_compiler()
    try:
        done = subprocess.run([*compiler, "--version"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        raise CompilerUnusable(f"{shlex.join(compiler)} --version failed: {exc}") from None
    if done.returncode != 0:
        raise CompilerUnusable(f"{shlex.join(compiler)} --version failed (exit {done.returncode})")
    problem = compiler_version_problem(done.stdout)
    if problem:
        raise CompilerUnusable(f"{shlex.join(compiler)}: {problem}")
    return compiler, done.stdout


def _cpu_identity() -> str:
    """What ``-march=native`` compiles for: the CPU's model and feature flags."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform

        return platform.processor() or platform.machine()
    wanted = ("model name", "flags", "Features", "CPU part")
    return "\n".join(sorted({line for line in lines if line.split(":")[0].strip() in wanted}))


def _build() -> Path:
    compiler, version = usable_compiler()
    torch_dir = Path(torch.__file__).parent
    name = Path(compiler[0]).name
    source = SOURCE.read_bytes()
    key = hashlib.sha256(b"\0".join(
        [source, torch.__version__.encode(), str(torch_dir).encode(), version.encode(),
         shlex.join([*compiler[1:], *FLAGS]).encode(),
         _cpu_identity().encode()])).hexdigest()[:16]
    # nexrl's per-machine cache (nexrl_torch.models.nexrl_cache_dir), named here so this distribution needs only torch
    folder = Path(os.environ.get("NEXRL_CACHE_DIR", "~/.cache/nexrl")).expanduser() / "kernels"
    target = folder / f"decode_step-{key}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    partial = folder / f".decode_step-{key}.{os.getpid()}.{threading.get_ident()}.so"
    compile_flags, link_flags = _torch_flags()
    command = [*compiler, *FLAGS, *compile_flags, str(SOURCE), "-o", str(partial), *link_flags]
    started = time.perf_counter()
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"{name} did not run: {exc}") from None
    if done.returncode != 0:
        partial.unlink(missing_ok=True)
        tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
        raise KernelBuildError(f"{name} failed (exit {done.returncode}): {tail}")
    os.replace(partial, target)  # atomic: a process building beside this one reads a whole file
    logger.info(f"decode kernels compiled in {time.perf_counter() - started:.1f} s: {target}")
    return target



def _torch_flags() -> tuple[list[str], list[str]]:
    """The compile and link flags of an extension of the imported torch: its headers, its C++ ABI, its libraries."""
    try:
        from torch.utils import cpp_extension  # imports setuptools (a quarter second): only to build
    except ImportError as exc:
        raise KernelBuildError(f"torch.utils.cpp_extension cannot be imported: {exc}") from None
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    libraries = cpp_extension.library_paths()
    return ([*(f"-I{folder}" for folder in cpp_extension.include_paths()), f"-D_GLIBCXX_USE_CXX11_ABI={abi}"],
            [*(f"-L{f}" for f in libraries), *(f"-Wl,-rpath,{f}" for f in libraries), "-lc10", "-ltorch_cpu"])
