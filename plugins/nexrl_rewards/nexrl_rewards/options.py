"""Checks of the evaluators' options: a bad value is a ConfigError naming its recipe key."""

from __future__ import annotations

import math
from typing import Any

from nexrl_core import ConfigError

KEY = "rollout_worker.evaluator"


def number(value: Any, name: str, *, low: float | None = None, positive: bool = False) -> float:
    """``value`` as a finite number, at least ``low`` / above 0."""
    _check_number(value, name, False, low, positive)
    return float(value)


def whole(value: Any, name: str, *, low: float | None = None) -> int:
    """``value`` as a whole number, at least ``low``."""
    _check_number(value, name, True, low, False)
    return int(value)


def _check_number(value: Any, name: str, integer: bool, low: float | None, positive: bool) -> None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if ok and integer:
        ok = float(value).is_integer()
    if ok and positive:
        ok = value > 0
    if ok and low is not None:
        ok = value >= low
    if not ok:
        kind = "a whole number" if integer else "a number"
        bound = " above 0" if positive else f" >= {low:g}" if low is not None else ""
        raise ConfigError(f"{KEY}.{name}: {value!r} is not {kind}{bound}")


def choice(value: Any, name: str, choices: tuple[str, ...]) -> str:
    if value not in choices:
        raise ConfigError(f"{KEY}.{name}: {value!r} is not one of {', '.join(choices)}")
    return value
