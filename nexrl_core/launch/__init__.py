"""Launch modes: where the modules of a run live and how the controller gets handles to them.

``local`` builds every module in this process. A mode that spreads modules over processes
implements :class:`~nexrl_core.launch.base.ResourceManager` in a folder of its own here
(the only place that may import its engine) and adds itself to :data:`LAUNCH_MODES`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..config.bound import declared_value, fill_defaults
from ..config.options import option_defaults
from ..config.schema import (
    CORE_OPTIONS,
    LAUNCH_MODES,
    PLANNED_LAUNCH_MODES,
    RAY,
    ROLLOUT_WORKER,
    launch_mode_problem,
    ray_installed,
)
from ..errors import ConfigError
from .base import ResourceManager, RoleSpec


def unused_launch_keys(config: Any) -> list[str]:
    """Keys of another launch mode that the recipe sets to other than their defaults (a Ray
    recipe run with ``launch_mode=local``): accepted, so one key switches the mode, but named,
    so nobody believes they took effect."""
    if _launch_mode(config) == "ray":
        return []
    section = config.get("ray") or {}
    defaults = fill_defaults(option_defaults(RAY), RAY)  # as the composed recipe holds them
    keys = [f"ray.{k}" for k in RAY if k in section and _plain(section[k]) != defaults[k]]
    workers = config.get("rollout_worker") or {}
    if "num_actors" in workers and workers["num_actors"] != ROLLOUT_WORKER["num_actors"].default:
        keys.append("rollout_worker.num_actors")
    return keys


def _launch_mode(config: Any) -> Any:
    return declared_value(config, "launch_mode", CORE_OPTIONS)


def _plain(value: Any) -> Any:
    from omegaconf import DictConfig, ListConfig, OmegaConf

    return OmegaConf.to_container(value, resolve=True) if isinstance(value, (DictConfig, ListConfig)) else value


def unused_launch_keys_note(config: Any) -> str | None:
    keys = unused_launch_keys(config)
    if not keys:
        return None
    return (f"{', '.join(keys)}: appl{'ies' if len(keys) == 1 else 'y'} to launch_mode: ray only; this run is "
            f"launch_mode: {_launch_mode(config)} and does not use {'it' if len(keys) == 1 else 'them'}")


def create_resource_manager(config: Any, plugin_manager: Any = None) -> ResourceManager:
    """The resource manager of the recipe's ``launch_mode``."""
    mode = _launch_mode(config)
    problem = launch_mode_problem(mode)
    if problem is not None:
        raise ConfigError(problem)
    module, _, name = LAUNCH_MODES[mode].partition(":")
    return getattr(importlib.import_module(module), name)(config, plugin_manager)


__all__ = ["LAUNCH_MODES", "PLANNED_LAUNCH_MODES", "ResourceManager", "RoleSpec", "create_resource_manager",
           "launch_mode_problem", "ray_installed", "unused_launch_keys", "unused_launch_keys_note"]
