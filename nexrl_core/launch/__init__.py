"""Launch modes: where the modules of a run live and how the controller gets handles to them.

``local`` builds every module in this process. A mode that spreads modules over processes
implements :class:`~nexrl_core.launch.base.ResourceManager` in a folder of its own here
(the only place that may import its engine) and adds itself to :data:`LAUNCH_MODES`.
"""

from __future__ import annotations

import importlib
from typing import Any

from ..errors import ConfigError
from .base import ResourceManager, RoleSpec
from .ray.settings import ray_installed

# launch_mode -> "module:class" of its resource manager
LAUNCH_MODES: dict[str, str] = {
    "local": "nexrl_core.launch.local:LocalResourceManager",
    "ray": "nexrl_core.launch.ray.manager:RayResourceManager",
}
# Accepted names that do not run yet, and why (one message for `nexrl validate` and `nexrl run`).
PLANNED_LAUNCH_MODES: dict[str, str] = {}


def launch_mode_problem(mode: Any) -> str | None:
    """Why ``launch_mode: mode`` cannot run, or None when it can."""
    if mode == "ray" and not ray_installed():
        return "launch_mode: 'ray' needs Ray, an optional extra: pip install 'nexrl-core[ray]'"
    if mode in LAUNCH_MODES:
        return None
    if mode in PLANNED_LAUNCH_MODES:
        return PLANNED_LAUNCH_MODES[mode]
    return f"launch_mode: '{mode}' is not one of {', '.join(LAUNCH_MODES)}"


def create_resource_manager(config: Any, plugin_manager: Any = None) -> ResourceManager:
    """The resource manager of the recipe's ``launch_mode``."""
    mode = config.get("launch_mode", "local")
    problem = launch_mode_problem(mode)
    if problem is not None:
        raise ConfigError(problem)
    module, _, name = LAUNCH_MODES[mode].partition(":")
    return getattr(importlib.import_module(module), name)(config, plugin_manager)


__all__ = ["LAUNCH_MODES", "PLANNED_LAUNCH_MODES", "ResourceManager", "RoleSpec", "create_resource_manager",
           "launch_mode_problem"]
