"""Launch modes: where the modules of a run live and how the controller gets handles to them.

``local`` builds every module in this process. A mode that spreads modules over processes
implements :class:`~nexrl_core.launch.base.ResourceManager` in a folder of its own here
(the only place that may import its engine) and adds itself to :data:`LAUNCH_MODES`.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

from ..config.schema import (
    LAUNCH_MODES,
    PLANNED_LAUNCH_MODES,
    RaySectionSettings,
    RecipeSettings,
    RolloutWorkerSettings,
    launch_mode_problem,
    ray_installed,
)
from ..errors import ConfigError
from .base import ResourceManager, RoleSpec


def unused_launch_keys(settings: RecipeSettings) -> list[str]:
    """Keys of another launch mode that the recipe sets to other than their defaults (a Ray
    recipe run with ``launch_mode=local``): accepted, so one key switches the mode, but named,
    so nobody believes they took effect."""
    if settings.launch_mode == "ray":
        return []
    ray, defaults = settings.ray.to_dict(), RaySectionSettings.of({}).to_dict()
    keys = [f"ray.{k}" for k in ray if ray[k] != defaults[k]]
    if settings.rollout_worker.num_actors != RolloutWorkerSettings.options()["num_actors"].default:
        keys.append("rollout_worker.num_actors")
    return keys


def unused_launch_keys_note(settings: RecipeSettings) -> str | None:
    keys = unused_launch_keys(settings)
    if not keys:
        return None
    return (f"{', '.join(keys)}: appl{'ies' if len(keys) == 1 else 'y'} to launch_mode: ray only; this run is "
            f"launch_mode: {settings.launch_mode} and does not use {'it' if len(keys) == 1 else 'them'}")


def create_resource_manager(config: Mapping[str, Any], plugin_manager: Any = None,
                            settings: RecipeSettings | None = None) -> ResourceManager:
    """The resource manager of the recipe's ``launch_mode`` (``settings``: ``config`` as the run's
    prologue read it; None: read here)."""
    settings = RecipeSettings.of(config) if settings is None else settings
    problem = launch_mode_problem(settings.launch_mode)
    if problem is not None:
        raise ConfigError(problem)
    module, _, name = LAUNCH_MODES[settings.launch_mode].partition(":")
    return getattr(importlib.import_module(module), name)(config, plugin_manager, settings)


__all__ = ["LAUNCH_MODES", "PLANNED_LAUNCH_MODES", "ResourceManager", "RoleSpec", "create_resource_manager",
           "launch_mode_problem", "ray_installed", "unused_launch_keys", "unused_launch_keys_note"]
