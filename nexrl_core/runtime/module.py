"""NexRLModule: the base every component shares (name, activity tracker, health)."""

from __future__ import annotations

from typing import Any


class NexRLModule:
    #: seconds :meth:`health_problem` waits for each of the module's locks: one held longer is a hang
    HEALTH_LOCK_WAIT_S: float = 30.0

    def __init__(self) -> None:
        self._module_name: str = "invalid"
        self._activity_tracker: Any = None
        self._fault: str | None = None  # why the module cannot go on (set by mark_faulty)

    def set_activity_tracker(self, tracker: Any) -> None:
        self._activity_tracker = tracker

    def set_module_name(self, module_name: str) -> None:
        self._module_name = module_name

    def get_module_name(self) -> str:
        return self._module_name

    def health_check(self) -> bool:
        return self.health_problem() is None

    def health_problem(self) -> str | None:
        """Why the module is unhealthy (None: healthy): a fault it recorded (:meth:`mark_faulty`), or a
        lock of its (:meth:`_health_locks`) that stays held, which is a hung or deadlocked call. The
        monitor gives the check ``runtime_monitor.health_check.timeout`` to answer, so a lock held
        that long is found even before ``HEALTH_LOCK_WAIT_S``."""
        if self._fault is not None:
            return self._fault
        for name, lock in self._health_locks().items():
            if not lock.acquire(timeout=self.HEALTH_LOCK_WAIT_S):
                return f"its {name} lock has been held for over {self.HEALTH_LOCK_WAIT_S:g}s"
            lock.release()
        return None

    def mark_faulty(self, why: str) -> None:
        """Record that the module cannot go on (its health check fails from now on)."""
        if self._fault is None:
            self._fault = why

    def _health_locks(self) -> dict[str, Any]:
        """The locks every call of this module takes, by name (a lock or a Condition)."""
        return {}

    def easy_dump(self, value: Any, keys: list[str] | None = None, value_formatter: Any = None) -> str:
        shown = {k: value[k] for k in keys} if keys and isinstance(value, dict) else value
        text = value_formatter(shown) if value_formatter else repr(shown)
        return f"[{self._module_name}] {text}"
