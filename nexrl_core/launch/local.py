"""Local launch: every module is an object in this process, its handle is the object itself."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from loguru import logger

from ..config.schema import RecipeSettings
from ..plugins import PluginManager, active_plugin_manager
from ..types import NexRLRole
from .base import ResourceManager, built_with
from .parts import build_module


class LocalResourceManager(ResourceManager):
    """Instantiates each role in process, in registration order; everything is co-located.
    Each module gets its parts (evaluators, weight-sync backend, sinks) built with the
    ``plugin_manager`` given here (:mod:`nexrl_core.launch.parts`)."""

    def __init__(self, config: Mapping[str, Any] | None = None, plugin_manager: PluginManager | None = None,
                 settings: RecipeSettings | None = None) -> None:
        super().__init__(config, plugin_manager, settings)
        self._instances: dict[NexRLRole, list[Any]] = {}
        if settings is not None:
            from . import unused_launch_keys_note

            note = unused_launch_keys_note(settings)
            if note:
                logger.warning(note)

    def _create(self) -> None:
        pm = self._pm or active_plugin_manager()
        for spec in self.roles():
            self._instances[spec.role] = [self._wrap(spec.role, build_module(spec.cls, built_with(spec.config), spec.kwargs, pm))
                                          for _ in range(spec.count)]

    def _wrap(self, role: NexRLRole, instance: Any) -> Any:
        """The handle the rest of the run gets for ``instance`` (locally: the instance)."""
        return instance

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return list(self._instances.get(role, []))

    def is_colocated(self, first: NexRLRole, second: NexRLRole) -> bool:
        return first in self._roles and second in self._roles  # one process holds them all
