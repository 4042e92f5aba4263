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

The source is compiled once per machine with the C++ compiler found (``$CXX``, else ``c++``,
``g++`` or ``clang++``) against the torch that is imported (its headers and its OpenMP), for this
CPU (``-march=native``), into ``$NEXRL_CACHE_DIR/kernels`` (default ``~/.cache/nexrl/kernels``).
The file's name hashes everything that went into it, so another torch, compiler or CPU builds its
own. The engine's ``cpu_kernels`` key chooses: ``auto`` uses them when they build, ``true`` fails
when they do not, ``false`` keeps the torch ops.
"""

from __future__ import annotations

import ctypes
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
DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16"}
LINEAR_LANES = 16  # output columns per panel of a packed weight (kLanes in the source)


class KernelBuildError(RuntimeError):
    """The kernels could not be compiled or loaded here; the message says why."""


class CompilerUnusable(KernelBuildError):
    """No C++ compiler here can build the kernels: none, one that does not run, or one too old."""


class DecodeKernels:
    """The compiled functions, called on contiguous CPU tensors of one dtype (float32 or bfloat16)."""

    def __init__(self, library: ctypes.CDLL, path: Path):
        self.path = path
        pointer, long, single = ctypes.c_void_p, ctypes.c_long, ctypes.c_float
        self._attend, self._add_rms_norm, self._silu_mul = {}, {}, {}
        for dtype, suffix in DTYPES.items():
            attend = getattr(library, f"attend_{suffix}")
            attend.argtypes = [pointer, long, pointer, pointer, pointer, pointer, pointer, pointer, long, long, long,
                               long, long, long, single, pointer]
            norm = getattr(library, f"add_rms_norm_{suffix}")
            norm.argtypes = [pointer, pointer, pointer, single, pointer, long, long]
            silu = getattr(library, f"silu_mul_{suffix}")
            silu.argtypes = [pointer, pointer, long, long]
            self._attend[dtype], self._add_rms_norm[dtype], self._silu_mul[dtype] = attend, norm, silu
        self._linear = library.linear_float32
        self._linear.argtypes = [pointer, long, long, long, pointer, long, pointer, pointer]
        self._pack_linear = library.pack_linear_float32
        self._pack_linear.argtypes = [pointer, long, long, pointer, long, long]

    def attend(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, keys: torch.Tensor,
               values: torch.Tensor, starts: torch.Tensor, column: int, scaling: float, out: torch.Tensor,
               cache_rows: torch.Tensor | None = None) -> None:
        """One decode step's attention: ``qkv`` ``[rows, (heads + 2 kv_heads) * dim]`` (queries, keys,
        values), ``cos``/``sin`` ``[rows, dim]``; rotates the new key and the queries, writes key and
        value into ``keys``/``values`` ``[cache rows, kv_heads, capacity, dim]`` at ``column``, and
        writes into ``out`` ``[rows, heads * dim]`` each row's attention over its columns ``starts`` to
        ``column``. Row r's cache row is ``cache_rows[r]`` (int64; r when None); ``starts`` (int64) is
        per cache row."""
        _, kv_heads, capacity, dim = keys.shape
        rows, heads = qkv.shape[0], out.shape[1] // dim
        self._attend[qkv.dtype](qkv.data_ptr(), qkv.stride(0), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                values.data_ptr(), starts.data_ptr(),
                                None if cache_rows is None else cache_rows.data_ptr(), rows, heads, kv_heads, dim,
                                capacity, column, scaling, out.data_ptr())

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float,
                     out: torch.Tensor) -> None:
        """``x += delta`` in place (when given), then ``out = rms_norm(x) * weight``; ``x`` ``[rows, hidden]``."""
        rows, hidden = x.shape
        self._add_rms_norm[x.dtype](x.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                    eps, out.data_ptr(), rows, hidden)

    def silu_mul(self, gate_up: torch.Tensor, out: torch.Tensor) -> None:
        """``out = silu(gate) * up``, ``gate_up`` ``[rows, 2 * intermediate]`` (gate first)."""
        rows, intermediate = out.shape
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), out.data_ptr(), rows, intermediate)


    def pack_linear(self, weights: list[torch.Tensor], packed: torch.Tensor | None = None) -> torch.Tensor:
        """The float32 weights ``[n_i, k]`` of linears that share their input, packed as one weight for
        :meth:`linear` (their outputs side by side, in order); into ``packed`` when given (the same
        total shape: a refresh in place), else into a new tensor."""
        k = weights[0].shape[1]
        total = sum(w.shape[0] for w in weights)
        size = -(-total // LINEAR_LANES) * LINEAR_LANES * k
        if packed is None:
            packed = torch.empty(size, dtype=torch.float32)
        elif packed.numel() != size:
            raise ValueError(f"packed weight holds {packed.numel()} values, {size} needed")
        column = 0
        for w in weights:
            w = w.detach().contiguous()
            self._pack_linear(w.data_ptr(), w.shape[0], k, packed.data_ptr(), column, total)
            column += w.shape[0]
        return packed

    def linear(self, x: torch.Tensor, packed: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
        """``x @ w.T + bias`` for a float32 ``x`` ``[rows, k]`` (rows contiguous) and ``w`` packed by
        :meth:`pack_linear` (``n`` output columns): ``[rows, n]``."""
        rows, k = x.shape
        out = x.new_empty(rows, n)
        self._linear(x.data_ptr(), x.stride(0), rows, k, packed.data_ptr(), n,
                     None if bias is None else bias.data_ptr(), out.data_ptr())
        return out


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
                _loaded = DecodeKernels(ctypes.CDLL(str(path)), path)
            except (KernelBuildError, OSError, AttributeError) as exc:
                _problem = str(exc)
        if _loaded is None:
            raise KernelBuildError(_problem)
        return _loaded


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
    lib = torch_dir / "lib"
    command = [*compiler, *FLAGS, f"-I{torch_dir / 'include'}", str(SOURCE), "-o", str(partial), f"-L{lib}",
               f"-Wl,-rpath,{lib}", "-lc10", "-ltorch_cpu"]
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
