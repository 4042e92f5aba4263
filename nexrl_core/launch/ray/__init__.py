"""``launch_mode: ray``: every module in a Ray actor (roles of one co-location group share one).

The only place in nexrl that imports ``ray`` (an optional extra: ``pip install nexrl-core[ray]``).
This package's ``__init__`` and :mod:`.settings` stay importable without it, so ``nexrl validate``
can check a Ray recipe anywhere; :mod:`.manager`, :mod:`.actors` and :mod:`.cluster` import Ray.
"""

from __future__ import annotations

from typing import Any

__all__ = ["RayResourceManager"]


def __getattr__(name: str) -> Any:
    if name == "RayResourceManager":
        from .manager import RayResourceManager

        return RayResourceManager
    raise AttributeError(name)
