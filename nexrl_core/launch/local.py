"""Local launch: every module is an object in this process, its handle is the object itself."""

from __future__ import annotations

from typing import Any

from loguru import logger

from ..plugins import PluginManager, use_plugin_manager
from ..types import NexRLRole
from .base import ResourceManager


class LocalResourceManager(ResourceManager):
    """Instantiates each role in process, in registration order; everything is co-located.
    Modules resolve their own parts (evaluators, weight-sync backends, sinks) with the
    ``plugin_manager`` given here."""

    def __init__(self, config: Any = None, plugin_manager: PluginManager | None = None) -> None:
        super().__init__(config, plugin_manager)
        self._instances: dict[NexRLRole, list[Any]] = {}
        if config is not None:
            from . import unused_launch_keys_note

            note = unused_launch_keys_note(config)
            if note:
                logger.warning(note)

    def _create(self) -> None:
        with use_plugin_manager(self._pm):
            for spec in self.roles():
                self._instances[spec.role] = [self._wrap(spec.role, spec.cls(spec.config, **spec.kwargs))
                                              for _ in range(spec.count)]

    def _wrap(self, role: NexRLRole, instance: Any) -> Any:
        """The handle the rest of the run gets for ``instance`` (locally: the instance)."""
        return instance

    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return list(self._instances.get(role, []))

    def is_colocated(self, first: NexRLRole, second: NexRLRole) -> bool:
        return first in self._roles and second in self._roles  # one process holds them all
