"""The interface every launch mode implements (the seed's RayResourceManager shape)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from ..config.schema import RecipeSettings
from ..config.settings import Settings
from ..errors import NexRLError
from ..types import NexRLRole

#: what a role's module is built with: its recipe section (a component reads its own keys there),
#: or, for the core's own modules, its typed settings
RoleConfig = Mapping[str, Any] | Settings | None


def built_with(config: RoleConfig) -> Mapping[str, Any] | None:
    """``config`` as ``launch/parts.py``'s ``build_module`` is annotated (a mapping): a core module's
    settings pass through it to the module's constructor unread."""
    return cast("Mapping[str, Any] | None", config)

# Set in every actor process of a Ray run (launch/ray/actors.py): processes started there are actors too.
IN_RAY_ACTOR = "NEXRL_IN_RAY_ACTOR"


class StartedProcess:
    """One process :func:`start_processes` started."""

    name: str
    host: str
    pid: int
    kind = "process"  # what a log line calls it

    def is_alive(self) -> bool:
        raise NotImplementedError

    def exit_cause(self) -> str | None:
        """Why it ended (None while it runs): its exception's message, or its exit code."""
        raise NotImplementedError

    def stop(self, timeout: float = 60.0) -> None:
        """Wait up to ``timeout`` s for it to end by itself, then end it."""
        raise NotImplementedError


@dataclass
class RoleSpec:
    """One registered role: ``count`` instances of ``cls(config, **kwargs)``."""

    role: NexRLRole
    cls: type
    config: RoleConfig
    count: int = 1
    colocation_group: str | None = None
    kwargs: dict[str, Any] = field(default_factory=dict)


class ResourceManager(ABC):
    """Builds the modules of a run and hands out handles to them.

    The controller registers every role (in the order modules must be built), calls
    :meth:`create_all_actors` once, then works only with the handles of
    :meth:`get_actor_wrapper`, through ``execute``. Roles that name the same
    ``colocation_group`` must live in one process (one actor per instance hosting all of
    them, as the seed's co-located actors); ``None`` means a place of its own.
    """

    #: seconds between two rounds of the controller's monitor loop (each round asks the trainer,
    #: the weight-sync controller and the tracker a few questions: cheap in process, a few
    #: round trips between processes)
    poll_interval_s: float = 0.02
    #: seconds a rollout worker waits for a slot or a task before it looks at its mode again
    idle_wait_s: float = 0.05

    def __init__(self, config: Mapping[str, Any] | None = None, plugin_manager: Any = None,
                 settings: RecipeSettings | None = None) -> None:
        """``config``: the recipe (modules are built with its sections); ``settings``: the core's
        reading of it (a mode reads its own settings there; None: a manager built by hand, with the
        declared defaults); ``plugin_manager``: what modules built in this process resolve their
        parts with (None: the process default)."""
        self._config = config
        self._recipe = settings
        self._pm = plugin_manager
        self._roles: dict[NexRLRole, RoleSpec] = {}
        self._created = False

    def register_role(self, role: NexRLRole, cls: type, config: RoleConfig, count: int = 1,
                      colocation_group: str | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """Declare ``count`` instances of ``cls(config, **kwargs)`` for ``role``."""
        if self._created:
            raise NexRLError(f"role {role.value} registered after create_all_actors()")
        if role in self._roles:
            raise NexRLError(f"role {role.value} is registered twice")
        if count < 1:
            raise NexRLError(f"role {role.value}: count must be at least 1, got {count}")
        self._roles[role] = RoleSpec(role, cls, config, int(count), colocation_group, dict(kwargs or {}))

    def roles(self) -> list[RoleSpec]:
        """The registered roles, in registration order."""
        return list(self._roles.values())

    def colocation_groups(self) -> dict[str, list[RoleSpec]]:
        """Named co-location groups and their roles (registration order); roles in one group
        must have the same count (instance ``i`` of each shares a process)."""
        groups: dict[str, list[RoleSpec]] = {}
        for spec in self._roles.values():
            if spec.colocation_group is not None:
                groups.setdefault(spec.colocation_group, []).append(spec)
        for name, specs in groups.items():
            counts = {s.count for s in specs}
            if len(counts) > 1:
                listing = ", ".join(f"{s.role.value}={s.count}" for s in specs)
                raise NexRLError(f"co-location group '{name}': its roles need the same count, got {listing}")
        return groups

    def create_all_actors(self) -> None:
        """Build every registered role (registration order within the constraints of co-location)."""
        if self._created:
            raise NexRLError("create_all_actors() was already called")
        self.colocation_groups()  # reject inconsistent groups before building anything
        self._create()
        self._created = True

    @abstractmethod
    def _create(self) -> None:
        """Build the modules of every registered role."""

    @abstractmethod
    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        """Handles of ``role``'s instances (empty when the role was not registered)."""

    def is_colocated(self, first: NexRLRole, second: NexRLRole) -> bool:
        """Whether instances of the two roles share a process (and so may share memory)."""
        a, b = self._roles.get(first), self._roles.get(second)
        return a is not None and b is not None and a.colocation_group is not None \
            and a.colocation_group == b.colocation_group

    def shutdown(self) -> None:
        """Release what the launch mode holds (processes, clusters); the modules are stopped already."""
