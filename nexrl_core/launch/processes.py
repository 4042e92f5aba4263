"""Processes a component starts for itself, placed by the run's launch mode.

A data-parallel train service runs one process per rank besides its own. In ``launch_mode:
local`` they are child processes of this one (``spawn``); inside a Ray actor of a ``launch_mode:
ray`` run they are Ray actors in a placement group (one bundle each: a CPU and the GPUs it asks
for), so ranks take GPUs of their own, on this node or others. The component calls
:func:`start_processes` and never imports ray.

``target(*args)`` runs in each process; when it raises, its message is what
:meth:`StartedProcess.exit_cause` reports (an exit code or a signal when the process was killed).
"""

from __future__ import annotations

import os
import socket
import traceback
from collections.abc import Callable, Sequence
from typing import Any

from .base import IN_RAY_ACTOR, StartedProcess


def start_processes(target: Callable[..., Any], args: Sequence[tuple], names: Sequence[str], *,
                    num_gpus: float = 0) -> list[StartedProcess]:
    """One process per entry of ``args``, running ``target(*entry)``, named by ``names``."""
    if os.environ.get(IN_RAY_ACTOR):
        from .ray.processes import start_ray_processes

        return start_ray_processes(target, args, names, num_gpus=num_gpus)
    return [_LocalProcess(target, entry, name) for entry, name in zip(args, names)]


def start_objects(factory: Callable[..., Any], args: Sequence[tuple], names: Sequence[str], *,
                  num_gpus: float = 0) -> list[Any]:
    """One object per entry of ``args``, ``factory(*entry)``, each in a Ray actor of its own (placed
    as :func:`start_processes` places its actors; ``launch_mode: ray`` only). A returned handle calls
    the object's methods and waits for them (from any thread: an actor serves many calls at once);
    it also has ``name``, ``host``, ``pid`` and ``stop()``. An argument made by :func:`share` is
    sent once to the object store, however many objects take it."""
    if not processes_are_actors():
        raise ValueError("objects in processes of their own need launch_mode: ray")
    from .ray.processes import start_ray_objects

    return start_ray_objects(factory, args, names, num_gpus=num_gpus)


def processes_are_actors() -> bool:
    """Whether :func:`start_processes` and :func:`start_objects` start Ray actors here (inside an
    actor of a ``launch_mode: ray`` run)."""
    return bool(os.environ.get(IN_RAY_ACTOR))


def share(value: Any) -> Any:
    """``value`` put in Ray's object store once, to pass to several :func:`start_objects` handles."""
    from .ray.processes import share_value

    return share_value(value)


def rendezvous_host() -> str:
    """The address the processes reach this one at."""
    if os.environ.get(IN_RAY_ACTOR):
        from .ray.processes import node_address

        return node_address()
    return "127.0.0.1"


class _LocalProcess(StartedProcess):
    def __init__(self, target: Callable[..., Any], args: tuple, name: str):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self._receive, send = context.Pipe(duplex=False)
        self._proc = context.Process(target=_report_failure, args=(target, args, send), name=name, daemon=True)
        self._proc.start()
        send.close()
        self.name, self.host, self.pid = name, socket.gethostname(), int(self._proc.pid or 0)
        self._cause: str | None = None

    def is_alive(self) -> bool:
        return self._proc.is_alive()

    def exit_cause(self) -> str | None:
        if self._proc.is_alive():
            return None
        if self._cause is None:
            try:
                self._cause = self._receive.recv() if self._receive.poll() else None
            except (EOFError, OSError):
                self._cause = None
            code = self._proc.exitcode
            self._cause = self._cause or f"exit code {code}" + (f" (signal {-code})" if code is not None and code < 0
                                                                 else "")
        return self._cause

    def stop(self, timeout: float = 60.0) -> None:
        self._proc.join(timeout=timeout)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=10)


def _report_failure(target: Callable[..., Any], args: tuple, report: Any) -> None:
    """A child's life: ``target(*args)``; an exception goes to the parent, then the child exits."""
    try:
        target(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the parent, then this process ends
        try:
            detail = "" if isinstance(exc, (KeyboardInterrupt, SystemExit)) else \
                "\n" + traceback.format_exc(limit=8)
            report.send(f"{type(exc).__name__}: {exc}{detail}")
        finally:
            os._exit(1)
