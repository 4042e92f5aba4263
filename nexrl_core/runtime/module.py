"""NexRLModule: the base every component shares (name, activity tracker, health)."""

from __future__ import annotations

from typing import Any


class NexRLModule:
    def __init__(self) -> None:
        self._module_name: str = "invalid"
        self._activity_tracker: Any = None

    def set_activity_tracker(self, tracker: Any) -> None:
        self._activity_tracker = tracker

    def set_module_name(self, module_name: str) -> None:
        self._module_name = module_name

    def get_module_name(self) -> str:
        return self._module_name

    def health_check(self) -> bool:
        return True

    def easy_dump(self, value: Any, keys: list[str] | None = None, value_formatter: Any = None) -> str:
        shown = {k: value[k] for k in keys} if keys and isinstance(value, dict) else value
        text = value_formatter(shown) if value_formatter else repr(shown)
        return f"[{self._module_name}] {text}"
