"""A launch mode for tests whose handles behave like actor handles, in one process.

``launch_mode: test_handles`` (registered by the ``handles_launch_mode`` fixture) builds every
module in process, as ``local`` does, but hands out :class:`Handle` objects instead of the
modules: a handle offers the public *methods* of its module and nothing else, each one a
``RemoteMethod`` that only ``execute`` can call; arguments and results cross it pickled, as
they cross a process boundary (handles inside them travel as references, as actor handles
do). Anything that reads a module's attribute, calls a private method or calls a method
without ``execute`` is recorded in :data:`VIOLATIONS` and fails.
"""

from __future__ import annotations

import itertools
import pickle
import threading
from collections import Counter
from typing import Any

from nexrl_core.launch.local import LocalResourceManager
from nexrl_core.runtime.execute import RemoteMethod
from nexrl_core.types import NexRLRole

VIOLATIONS: list[str] = []
CALLS: Counter = Counter()  # (role, method) -> number of calls
_HANDLES: dict[int, Handle] = {}
_IDS = itertools.count()
_LOCK = threading.Lock()


def reset() -> None:
    VIOLATIONS.clear()
    CALLS.clear()
    _HANDLES.clear()


def _handle_by_id(handle_id: int) -> Handle:
    return _HANDLES[handle_id]


def _cross(value: Any) -> Any:
    """``value`` as the other side of a process boundary would see it."""
    return pickle.loads(pickle.dumps(value))


class _Method(RemoteMethod):
    def __init__(self, handle: Handle, name: str):
        self._handle = handle
        self._name = name

    def submit(self, *args: Any, **kwargs: Any) -> tuple[bool, bytes]:
        role = self._handle.role.value
        with _LOCK:
            CALLS[(role, self._name)] += 1
        args, kwargs = _cross((args, kwargs))
        try:
            value = getattr(self._handle.target, self._name)(*args, **kwargs)
        except Exception as exc:
            return False, exc  # the caller gets the method's own exception, as from an actor
        return True, pickle.dumps(value)

    def result(self, ref: tuple[bool, Any], timeout: float | None) -> Any:
        ok, payload = ref
        if not ok:
            raise payload
        return pickle.loads(payload)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        message = f"{self._handle.role.value}.{self._name}() called directly, not through execute()"
        VIOLATIONS.append(message)
        raise TypeError(message)


class Handle:
    """The public methods of one module; nothing else."""

    def __init__(self, role: NexRLRole, target: Any):
        self.__dict__["role"] = role
        self.__dict__["target"] = target
        with _LOCK:
            self.__dict__["handle_id"] = next(_IDS)
            _HANDLES[self.handle_id] = self

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        member = getattr(type(self.target), name, None)
        if name.startswith("_") or member is None or not callable(member) or isinstance(member, property):
            message = f"{self.role.value}.{name} read through a handle (only public methods are reachable)"
            VIOLATIONS.append(message)
            raise AttributeError(message)
        return _Method(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        message = f"{self.role.value}.{name} assigned through a handle"
        VIOLATIONS.append(message)
        raise AttributeError(message)

    def __reduce__(self) -> tuple[Any, tuple[int]]:
        return _handle_by_id, (self.handle_id,)


class HandleResourceManager(LocalResourceManager):
    """Builds modules in process (with the controller's plugin manager) and hands out handles;
    ``instances(role)`` gives a test the modules themselves."""

    def _wrap(self, role: NexRLRole, instance: Any) -> Any:
        return Handle(role, instance)

    def instances(self, role: NexRLRole) -> list[Any]:
        return [h.target for h in self.get_actor_wrapper(role)]
