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
the process and throttle both as above. :class:`ThreadShare` makes that split follow who computes:
a side that computes nothing lends its threads to the other, which takes them at its next switch
point (a decode step, a layer) and gives them back the same way.
"""

from __future__ import annotations

import contextlib
import ctypes
import threading
from collections.abc import Iterator
from typing import Any, Callable

from loguru import logger

_OMP_PAUSE_SOFT = 1  # omp_pause_resource_t

_lock = threading.Lock()
_found: dict[str, list[Callable[[int], Any]]] = {}  # the C entries below, looked up once per process


def release_idle_workers() -> None:
    """Pause the calling thread's OpenMP team, if it has one (cheap when it has none)."""
    for pause in _resolve():
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


def _once(name: str, find: Callable[[], list[Callable[[int], Any]]]) -> list[Callable[[int], Any]]:
    found = _found.get(name)
    if found is None:
        with _lock:
            found = _found.get(name)
            if found is None:
                found = _found[name] = find()
    return found


def _resolve() -> list[Callable[[int], Any]]:
    return _once("pauses", _find_gomp_pauses)


def _thread_setters() -> list[Callable[[int], Any]]:
    """``omp_set_num_threads`` of every libgomp loaded and MKL's ``MKL_Set_Num_Threads_Local`` (its C entry; both
    act on the calling thread only)."""
    return _once("setters", _find_thread_setters)


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


def _find_gomp_pauses() -> list[Callable[[int], Any]]:
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
    pauses: list[Callable[[int], Any]] = []
    for path in sorted(paths):
        try:
            pause = ctypes.CDLL(path).omp_pause_resource_all
        except (OSError, AttributeError):  # libgomp before GCC 9
            continue
        pause.argtypes, pause.restype = [ctypes.c_int], ctypes.c_int
        pauses.append(pause)
    logger.debug(f"OpenMP: a thread's idle workers are paused through {sorted(paths) if pauses else 'nothing'}")
    return pauses


class ThreadShare:
    """The process's torch threads split between the in-process engine and a trainer computing beside
    it (``weight.rollouts_ahead``): while both compute, the engine runs on ``engine`` threads and the
    trainer on the rest; with ``lend_idle``, while one side computes nothing (the engine between
    batches, the trainer between its calls) the other runs on all of them. Each side applies its count
    to its own thread (:func:`follow_share`) at its next switch point: a decode step, a layer."""

    def __init__(self, total: int, engine: int, lend_idle: bool):
        if not 1 <= engine < total:
            raise ValueError(f"ThreadShare: the engine's share must leave the trainer at least one of {total} "
                             f"threads, got {engine}")
        self.total, self.engine, self.lend_idle = total, engine, lend_idle
        self._computing = {"engine": 0, "trainer": 0}
        self._count_lock = threading.Lock()

    def threads_for(self, side: str) -> int:
        other = "trainer" if side == "engine" else "engine"
        if self.lend_idle and not self._computing[other]:
            return self.total
        return self.engine if side == "engine" else self.total - self.engine

    def computing(self, side: str, busy: bool) -> None:
        with self._count_lock:
            self._computing[side] += 1 if busy else -1


_share: ThreadShare | None = None


def start_share(total: int, engine: int, lend_idle: bool) -> ThreadShare:
    """Split the process's threads (see :class:`ThreadShare`) until :func:`end_share`."""
    global _share
    _share = ThreadShare(total, engine, lend_idle)
    return _share


def end_share() -> None:
    global _share
    _share = None


def current_share() -> ThreadShare | None:
    return _share


def follow_share(side: str) -> None:
    """On ``side``'s thread: run on the threads the share gives it now (nothing without a share). A
    thread giving threads up pauses its team first, so the process never keeps more OpenMP workers
    than CPUs (the module doc)."""
    share = _share
    if share is None:
        return
    import torch

    wanted, now = share.threads_for(side), torch.get_num_threads()
    if wanted != now:
        if wanted < now:
            release_idle_workers()
        use_threads(wanted)


@contextlib.contextmanager
def computing(side: str) -> Iterator[None]:
    """``side`` computes inside: while a share holds, the other side keeps to its own part."""
    share = _share
    if share is None:
        yield
        return
    share.computing(side, True)
    try:
        follow_share(side)
        yield
    finally:
        share.computing(side, False)


def follow_share_at_layers(model: Any, side: str) -> None:
    """Switch points for ``side`` in ``model``: before each block of a ``ModuleList`` (a decoder layer)
    runs forward and before its gradient flows back, :func:`follow_share` (nothing without a share)."""
    import torch

    def before_forward(module: Any, args: Any) -> None:
        follow_share(side)

    def after_forward(module: Any, args: Any, output: Any) -> None:
        first = output[0] if isinstance(output, (tuple, list)) and output else output
        if _share is not None and isinstance(first, torch.Tensor) and first.requires_grad:
            first.register_hook(lambda grad: follow_share(side))

    for module in model.modules():
        if isinstance(module, torch.nn.ModuleList):
            for block in module:
                block.register_forward_pre_hook(before_forward)
                block.register_forward_hook(after_forward)
