"""Hide the launch mode: every call from one module to another goes through :func:`execute`.

In local mode a handle is the module itself and ``execute(handle.method, ...)`` is a plain
call. A launch mode that puts modules in other processes hands out handles whose methods
are :class:`RemoteMethod` objects; ``execute`` submits the call and waits for its result,
so callers never know where a module lives. Nothing here imports a distributed engine:
each launch mode (``nexrl_core.launch``) brings its own ``RemoteMethod``.
"""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from typing import Any

from ..errors import NexRLError


class RpcTimeout(NexRLError):
    """A module did not answer a call within its timeout."""


class ModuleUnavailable(NexRLError):
    """The module behind a handle is gone (its process died, its actor was killed)."""


class RemoteMethod(ABC):
    """A method of a module that lives elsewhere (what a launch mode's handle exposes).

    ``timeout``: seconds :func:`execute` waits for the result (None: no limit); the launch
    mode sets it from the recipe. Implementations raise :class:`RpcTimeout` when the wait
    runs out and :class:`ModuleUnavailable` when the module is gone; an exception raised
    by the method itself is re-raised as is.
    """

    timeout: float | None = None
    #: True when :meth:`submit` accepts :class:`Deferred` arguments itself (moving the result
    #: from the producing module to this one without the caller); otherwise :func:`execute`
    #: evaluates them first.
    takes_deferred: bool = False

    @abstractmethod
    def submit(self, *args: Any, **kwargs: Any) -> Any:
        """Start the call; returns a reference for :meth:`result`."""

    @abstractmethod
    def result(self, ref: Any, timeout: float | None) -> Any:
        """The value of a submitted call, waiting at most ``timeout`` seconds."""


class Deferred:
    """A module call whose result is an argument of another call (see :func:`deferred`)."""

    def __init__(self, func: Any, args: tuple[Any, ...], kwargs: dict[str, Any]):
        self.func = func
        self.args = args
        self.kwargs = kwargs

    def evaluate(self) -> Any:
        return execute(self.func, *self.args, **self.kwargs)


def deferred(func: Any, *args: Any, **kwargs: Any) -> Deferred:
    """``func(*args, **kwargs)`` as an argument of another :func:`execute`, for large results
    (weights): ``execute(engine.load_weights, deferred(trainer.export_weights), version)``.

    Locally the call runs just before the outer one. A launch mode with modules in other
    processes hands the result straight from the producing module to the consuming one (Ray:
    through the object store, written once; in process when both share an actor), never
    through the caller's process.
    """
    return Deferred(func, args, kwargs)


def _evaluate_deferred(args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if not any(isinstance(a, Deferred) for a in args) and not any(isinstance(v, Deferred) for v in kwargs.values()):
        return args, kwargs
    return (tuple(a.evaluate() if isinstance(a, Deferred) else a for a in args),
            {k: v.evaluate() if isinstance(v, Deferred) else v for k, v in kwargs.items()})


class PendingCall:
    """A call started by :func:`execute_async` on a remote module; :meth:`result` waits for it."""

    def __init__(self, method: RemoteMethod, ref: Any):
        self.method = method
        self.ref = ref

    def result(self, timeout: float | None = None) -> Any:
        return self.method.result(self.ref, self.method.timeout if timeout is None else timeout)


def execute(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Call ``func`` (a bound method of a module handle) and return its result."""
    if isinstance(func, RemoteMethod):
        if not func.takes_deferred:
            args, kwargs = _evaluate_deferred(args, kwargs)
        return func.result(func.submit(*args, **kwargs), func.timeout)
    args, kwargs = _evaluate_deferred(args, kwargs)
    return func(*args, **kwargs)


def execute_with_timeout(timeout: float | None, func: Any, *args: Any, **kwargs: Any) -> Any:
    """Like :func:`execute`, but raise :class:`RpcTimeout` when no answer comes in ``timeout`` seconds.

    A local call runs on a helper thread so that a hung module cannot hang the caller (the
    monitor's health checks); the call itself is not interrupted.
    """
    if isinstance(func, RemoteMethod):
        if not func.takes_deferred:
            args, kwargs = _evaluate_deferred(args, kwargs)
        return func.result(func.submit(*args, **kwargs), timeout)
    args, kwargs = _evaluate_deferred(args, kwargs)
    if timeout is None:
        return func(*args, **kwargs)
    outcome: list[tuple[bool, Any]] = []

    def call() -> None:
        try:
            outcome.append((True, func(*args, **kwargs)))
        except BaseException as exc:  # handed to the caller below
            outcome.append((False, exc))

    helper = threading.Thread(target=call, daemon=True, name=f"call-{getattr(func, '__name__', 'module')}")
    helper.start()
    helper.join(timeout)
    if not outcome:
        raise RpcTimeout(f"{_describe(func)} did not answer within {timeout:g}s")
    ok, value = outcome[0]
    if not ok:
        raise value
    return value


def execute_async(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Start ``func``: its result (local) or a :class:`PendingCall` (a remote module)."""
    if isinstance(func, RemoteMethod):
        if not func.takes_deferred:
            args, kwargs = _evaluate_deferred(args, kwargs)
        return PendingCall(func, func.submit(*args, **kwargs))
    args, kwargs = _evaluate_deferred(args, kwargs)
    return func(*args, **kwargs)


def wait_result(value: Any, timeout: float | None = None) -> Any:
    """The result of :func:`execute_async`, whichever launch mode produced it."""
    return value.result(timeout) if isinstance(value, PendingCall) else value


def _describe(func: Any) -> str:
    owner = getattr(func, "__self__", None)
    name = getattr(func, "__name__", repr(func))
    return f"{type(owner).__name__}.{name}" if owner is not None else name
