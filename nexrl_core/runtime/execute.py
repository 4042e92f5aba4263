"""Hide the launch mode: a direct call locally, ``ray.get(actor.m.remote())`` under Ray."""

from __future__ import annotations

from typing import Any


def _is_ray_method(func: Any) -> bool:
    return hasattr(func, "remote") and callable(getattr(func, "remote"))


def execute(func: Any, *args: Any, **kwargs: Any) -> Any:
    if _is_ray_method(func):
        import ray

        return ray.get(func.remote(*args, **kwargs))
    return func(*args, **kwargs)


def execute_async(func: Any, *args: Any, **kwargs: Any) -> Any:
    """Start ``func``; returns its result (local) or an ObjectRef (Ray)."""
    if _is_ray_method(func):
        return func.remote(*args, **kwargs)
    return func(*args, **kwargs)
