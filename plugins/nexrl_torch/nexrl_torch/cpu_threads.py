"""Give a thread's OpenMP workers back when the thread stops computing.

torch's CPU kernels run on OpenMP, and GNU OpenMP (libgomp, which torch's Linux wheels ship) keeps a
team of worker threads for every thread that ever ran a parallel region, for as long as that thread
lives. The engine's thread, the trainer's thread and the thread that loaded the models each keep
one. Once the process holds more OpenMP threads than CPUs, libgomp stops spinning at its barriers
(100 spins instead of about 300,000) and every parallel region wakes its workers from sleep. A
float32 decode step of SmolLM2 at 16 rows then measured 92 ms instead of 62 on two cores; its small
ops (attention, norms) cost 3-4 times as much (``benchmarks/README.md``, issue 32).

A thread that has finished its work pauses its own team (OpenMP 5's ``omp_pause_resource_all``;
libgomp frees only the calling thread's pool), so only the threads computing hold workers. The
next parallel region on that thread starts a new team (one thread creation). Results do not change:
a region runs on the same number of threads either way. Other OpenMP runtimes (LLVM's pauses the
whole process) and torch builds without OpenMP are left as they are.

:func:`use_threads` gives one thread a team of its own size (OpenMP's and MKL's counts are per
thread): the in-process engine and the trainer computing at once (``weight.rollouts_ahead``) split
the cores instead of each running a full team, which would put twice as many threads as CPUs in
the process and throttle both as above.
"""

from __future__ import annotations

import ctypes
import threading
from typing import Any, Callable

from loguru import logger

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t

_lock = threading.Lock()
_pauses: list[Callable[[int], int]] | None = None
_setters: list[Callable[[int], Any]] | None = None


def release_idle_workers() -> None:
    """Pause the calling thread's OpenMP team, if it has one (cheap when it has none)."""
    for pause in _pauses if _pauses is not None else _resolve():
        pause(_OMP_PAUSE_SOFT)


def use_threads(count: int) -> None:
    """From now on the calling thread's torch CPU ops run on ``count`` threads (its OpenMP team and
    MKL's); the process's other threads keep theirs, and so does torch's default for new threads."""
    import torch

    if count < 1:
        raise ValueError(f"use_threads: expected a positive thread count, got {count}")
    torch.get_num_threads()  # torch's per-thread set-up first: it would reset the count on its first op
    for set_count in _thread_setters():
        set_count(int(count))


def _thread_setters() -> list[Callable[[int], Any]]:
    """``omp_set_num_threads`` of every libgomp loaded and MKL's ``MKL_Set_Num_Threads_Local`` (its C entry; both
    act on the calling thread only)."""
    global _setters
    with _lock:
        if _setters is None:
            _setters = _find_thread_setters()
        return _setters


def _find_thread_setters() -> list[Callable[[int], Any]]:
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if line.rstrip().endswith(".so") or ".so." in line}
    except OSError:
        return []
    setters = []
    for path in sorted(paths):
        name = path.rsplit("/", 1)[-1]
        symbol = "omp_set_num_threads" if "libgomp" in name else \
            "MKL_Set_Num_Threads_Local" if name.startswith("libtorch_cpu") else None
        if symbol is None:
            continue
        try:
            setter = getattr(ctypes.CDLL(path), symbol)
        except (OSError, AttributeError):  # MKL not linked in: OpenMP alone
            continue
        setter.argtypes, setter.restype = [ctypes.c_int], ctypes.c_int
        setters.append(setter)
    return setters


def _resolve() -> list[Callable[[int], int]]:
    global _pauses
    with _lock:
        if _pauses is None:
            _pauses = _find_gomp_pauses()
        return _pauses


def _find_gomp_pauses() -> list[Callable[[int], int]]:
    """``omp_pause_resource_all`` of every libgomp loaded (another library may bring its own copy
    beside torch's; each copy keeps its own teams)."""
    import torch

    if "OpenMP" not in torch.__config__.parallel_info():
        return []
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "libgomp" in line.rsplit("/", 1)[-1]}
    except OSError:  # not Linux: torch ships another OpenMP runtime there
        return []
    pauses: list[Callable[[int], int]] = []
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # libgomp before GCC 9
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pauses.append(pause)
    logger.debug(f"OpenMP: a thread's idle workers are paused through {sorted(paths) if pauses else 'nothing'}")
    return pauses
