"""RayResourceManager: the seed's resource manager; every module of a run in a Ray actor.

Placement (``ray.colocation``, role -> group): the roles of one group share one actor (one per
instance); a role without a group gets an actor of its own; the rollout workers
(``rollout_worker.num_workers``) are spread over ``rollout_worker.num_actors`` actors. An actor
reserves the sum of its roles' ``ray.resources``. The default for one machine: the control
plane (tracker, data loaders, pool, validator, weight-sync controller) in one actor, the trainer
with the inference engine in another (their weight sync stays in process), the workers in a
third.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import ray
import ray.exceptions
from loguru import logger

from ...config.schema import RecipeSettings
from ...errors import NexRLError
from ...redaction import known_secrets
from ...types import NexRLRole
from ..base import ResourceManager, RoleConfig
from .actors import HostPayload, HostSetup, RayActorWrapper, Slot, host_class, public_methods
from .cluster import Cluster, actor_env, connect, driver_path
from .settings import UNBOUNDED_METHODS, RaySettings

#: calls an actor serves at once beyond one per rollout worker (controller, trainer, monitor...)
_BASE_CONCURRENCY = 32
#: seconds shutdown waits for killed actors to be gone (ray.kill only asks the cluster to kill)
_KILL_WAIT_S = 10.0


@dataclass
class ActorPlan:
    name: str
    group: str
    slots: list[Slot] = field(default_factory=list)
    num_cpus: float = 0.0
    num_gpus: float = 0.0
    memory: float = 0.0
    custom: dict[str, float] = field(default_factory=dict)


@dataclass
class ActorInfo:
    """One actor of the run (for reports and tests)."""

    name: str
    group: str
    roles: list[tuple[str, int]]
    handle: Any
    pid: int | None = None
    node_id: str | None = None


class RayResourceManager(ResourceManager):
    # Questions and waits cross processes here: ask less often (each is a call, and 16 workers
    # polling 20 times a second took a quarter of a core from a training step on two cores). A
    # worker held back still starts the moment a weight push lets it; it sees a validation start
    # up to idle_wait_s later.
    poll_interval_s = 0.2
    idle_wait_s = 1.0

    def __init__(self, config: Mapping[str, Any] | None = None, plugin_manager: Any = None,
                 settings: RecipeSettings | None = None) -> None:
        settings = RecipeSettings.of(config) if settings is None else settings
        super().__init__(config, plugin_manager, settings)
        self._run = settings
        self._settings = RaySettings.of(settings)
        self._cluster: Cluster | None = None
        self._actors: list[ActorInfo] = []
        self._handles: dict[NexRLRole, list[RayActorWrapper]] = {}
        self._run_id = secrets.token_hex(3)

    # -- registration ------------------------------------------------------------------------
    def register_role(self, role: NexRLRole, cls: type, config: RoleConfig, count: int = 1,
                      colocation_group: str | None = None, kwargs: dict[str, Any] | None = None) -> None:
        """As the base; a role registered without a group takes the one ``ray.colocation`` gives it."""
        if colocation_group is None:
            colocation_group = self._settings.colocation.get(role.value)
        super().register_role(role, cls, config, count, colocation_group, kwargs)

    # -- creation ------------------------------------------------------------------------------
    def _plan(self) -> list[ActorPlan]:
        plans: dict[tuple[str, int], ActorPlan] = {}
        order: list[ActorPlan] = []

        def actor(group: str, instance: int, name: str) -> ActorPlan:
            key = (group, instance)
            if key not in plans:
                plans[key] = ActorPlan(name=f"nexrl-{name}-{self._run_id}", group=group)
                order.append(plans[key])
            return plans[key]

        for spec in self.roles():
            role = spec.role.value
            for index in range(spec.count):
                if spec.role is NexRLRole.ROLLOUT_WORKER:
                    n_actors = min(self._settings.num_worker_actors, spec.count)
                    j = index * n_actors // spec.count
                    group = spec.colocation_group or "rollout_worker"
                    plan = actor(f"{group}#workers", j, f"{group}-{j}")
                elif spec.colocation_group is not None:
                    suffix = f"-{index}" if spec.count > 1 else ""
                    plan = actor(spec.colocation_group, index, f"{spec.colocation_group}{suffix}")
                else:
                    suffix = f"-{index}" if spec.count > 1 else ""
                    plan = actor(f"{role}#own", index, f"{role}{suffix}")
                plan.slots.append(Slot(role, index, spec.cls, spec.config, dict(spec.kwargs)))
        for plan in order:
            for role in dict.fromkeys(s.role for s in plan.slots):
                res = self._settings.resources.get(role)
                if res is None:  # the role's reservation is null: nothing
                    continue
                plan.num_cpus += res.num_cpus or 0.0  # null (the declared default): none reserved
                plan.num_gpus += res.num_gpus or 0.0
                plan.memory += res.memory or 0.0
                for key, amount in (res.resources or {}).items():
                    plan.custom[key] = plan.custom.get(key, 0.0) + float(amount)
        return order

    def _setup(self, plan: ActorPlan) -> HostSetup:
        run = self._run
        return HostSetup(sys_path=driver_path(), env=actor_env(self._settings, plan.num_cpus or None),
                         load_plugins=os.environ.get("NEXRL_LOAD_PLUGINS"), run_dir=run.run_dir or None,
                         log_level=run.logger.level, seed=run.seed, niceness=os.nice(0), secrets=known_secrets())

    def _in_process_plugins(self) -> list[tuple[str, Any, str, str]]:
        if self._pm is None:
            return []
        return [(r.name, r.module, r.distribution, r.version) for r in self._pm.records.values()
                if r.source == "in_process"]

    def _concurrency(self) -> int:
        if self._settings.max_concurrency:
            return int(self._settings.max_concurrency)
        workers = sum(s.count for s in self.roles() if s.role is NexRLRole.ROLLOUT_WORKER)
        return workers + _BASE_CONCURRENCY

    def _create(self) -> None:
        self._cluster = connect(self._settings)
        try:
            self._start_actors()
        except BaseException:
            self.shutdown()
            raise

    def _unschedulable(self, plans: list[ActorPlan]) -> list[str]:
        """Actors that no node of the cluster has the resources for, one line each: Ray would wait
        for such a node for ever (printing a warning every half minute)."""
        nodes = [node.get("Resources", {}) for node in ray.nodes() if node.get("Alive")]
        problems = []
        for plan in plans:
            asked = _asked(plan)
            if any(all(node.get(k, 0.0) >= v for k, v in asked.items()) for node in nodes):
                continue
            roles = ", ".join(dict.fromkeys(s.role for s in plan.slots))
            wants = ", ".join(f"{k} {v:g}" for k, v in asked.items())
            have = "; ".join(", ".join(f"{k} {node.get(k, 0.0):g}" for k in asked) for node in nodes) or "no node"
            problems.append(f"ray.resources: the actor of {roles} asks for {wants}, which no node of the cluster "
                            f"has (nodes: {have})")
        return problems

    def _wait_placed(self, pending: list[tuple[ActorPlan, Any, Any]]) -> None:
        """Until every actor runs on a node, at most ``ray.placement_timeout`` s: Ray waits for ever
        for a node with the resources an actor asks for (a cluster attached by address that never
        gets one; actors that fit a node alone but not together). An actor still starting then
        (placed, or a node has room for it: its process is slow to come up) is left to its build."""
        limit = self._settings.placement_timeout
        refs = [ready for _, _, ready in pending]
        # a ready ref is done when the actor's process started, or when the actor died (its build says why)
        _, waiting = ray.wait(refs, num_returns=len(refs), timeout=limit) if refs else ([], [])
        if not waiting:
            return
        nodes = _nodes()
        unplaced = [plan for plan, handle, ready in pending
                    if ready in waiting and not _has_worker(handle) and not _room_for(_asked(plan), nodes)]
        if not unplaced:
            return
        asked = [(", ".join(dict.fromkeys(s.role for s in plan.slots)), _asked(plan)) for plan in unplaced]
        keys = list(dict.fromkeys(["CPU", "GPU", *(k for _, want in asked for k in want)]))
        actors = "; ".join(f"the actor of {roles} asks for "
                           f"{', '.join(f'{k} {_amount(k, v)}' for k, v in want.items()) or 'nothing'}"
                           for roles, want in asked)
        have = "; ".join(f"{name}: " + ", ".join(_have(k, total, free) for k in keys)
                         for name, total, free in nodes) or "none alive"
        raise NexRLError(f"ray: not placed on any node within {limit:g}s (ray.placement_timeout): {actors}; "
                         f"nodes of the cluster: {have}")

    def _start_actors(self) -> None:
        concurrency, in_process = self._concurrency(), self._in_process_plugins()
        pending = []
        plans = self._plan()
        problems = self._unschedulable(plans)
        if problems and self._cluster is not None and self._cluster.connected and not self._cluster.started:
            # a cluster attached by address may add nodes (an autoscaler): said, then waited for
            # (at most ray.placement_timeout)
            limit = self._settings.placement_timeout
            until = f"up to {limit:g}s (ray.placement_timeout)" if limit else "without limit (ray.placement_timeout: null)"
            for problem in problems:
                logger.warning(f"{problem}; waiting {until} for one to join")
        elif problems:
            raise NexRLError("; ".join(problems))
        for plan in plans:
            roles: dict[str, list[str]] = {}
            for slot in plan.slots:
                roles.setdefault(slot.role, public_methods(slot.cls))
            options: dict[str, Any] = {
                "name": plan.name, "max_concurrency": concurrency, "num_cpus": plan.num_cpus,
                "num_gpus": plan.num_gpus, "max_restarts": 0,
            }
            if plan.memory:
                options["memory"] = plan.memory
            if plan.custom:
                options["resources"] = plan.custom
            if any(s.role == NexRLRole.ACTIVITY_TRACKER.value for s in plan.slots):
                # The run's records are written on the machine that runs `nexrl run`.
                options["scheduling_strategy"] = ray.util.scheduling_strategies.NodeAffinitySchedulingStrategy(
                    node_id=ray.get_runtime_context().get_node_id(), soft=False)
            actor = ray.remote(host_class(plan.group, roles)).options(**options).remote(plan.name)
            info = ActorInfo(plan.name, plan.group, [(s.role, s.index) for s in plan.slots], actor)
            self._actors.append(info)
            payload = ray.cloudpickle.dumps(HostPayload(plan.slots, in_process))
            ready = actor.__ray_ready__.remote()  # done once the actor's process is up on a node
            pending.append((info, plan, roles, actor.build.remote(self._setup(plan), payload), ready))
            logger.debug(f"ray: actor {plan.name} hosts {', '.join(f'{r}[{i}]' for r, i in info.roles)} "
                         f"(cpus {plan.num_cpus:g}, gpus {plan.num_gpus:g})")
        self._wait_placed([(plan, info.handle, ready) for info, plan, _, _, ready in pending])
        timeout, unbounded = self._settings.call_timeout, UNBOUNDED_METHODS
        for info, plan, roles, ref, _ in pending:
            try:
                built = ray.get(ref)  # model loads take as long as they take; a failure raises here
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                if isinstance(cause, NexRLError):
                    raise cause from None
                raise NexRLError(f"ray: actor {info.name} could not build "
                                 f"{', '.join(r for r, _ in info.roles)}: {type(cause).__name__}: {cause}") from None
            except ray.exceptions.RayActorError as exc:
                raise NexRLError(f"ray: actor {info.name} ({', '.join(r for r, _ in info.roles)}) died while "
                                 f"starting: {str(exc).strip().splitlines()[0] if str(exc).strip() else exc}") from None
            info.pid, info.node_id = built["pid"], built["node_id"]
            for slot in plan.slots:
                handle = RayActorWrapper(info.handle, info.name, slot.role, slot.index, roles[slot.role],
                                         timeout, unbounded)
                self._handles.setdefault(NexRLRole(slot.role), []).append(handle)
        for handles in self._handles.values():
            handles.sort(key=lambda h: h._index)

    # -- access --------------------------------------------------------------------------------
    def get_actor_wrapper(self, role: NexRLRole) -> list[Any]:
        return list(self._handles.get(role, []))

    def actors(self) -> list[ActorInfo]:
        """The run's actors: name, group, hosted (role, index) pairs, process id."""
        return list(self._actors)

    def actor_of(self, role: NexRLRole, index: int = 0) -> ActorInfo:
        for info in self._actors:
            if (role.value, index) in info.roles:
                return info
        raise NexRLError(f"no actor hosts {role.value}[{index}]")

    # -- end -----------------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the run's actors and wait until they are gone; stop the cluster if this run
        started it (disconnect if it attached)."""
        for info in self._actors:
            try:
                ray.kill(info.handle, no_restart=True)
            except Exception as exc:  # already gone
                logger.debug(f"ray: killing {info.name}: {exc}")
        self._wait_gone(_KILL_WAIT_S)
        cluster, self._cluster = self._cluster, None
        if cluster is not None:
            cluster.close()

    def _wait_gone(self, timeout: float) -> None:
        """Until a call to each killed actor fails (the kill took effect), at most ``timeout`` s:
        once the run is over, no module of it answers any more."""
        deadline = time.monotonic() + timeout
        for info in self._actors:
            while ray.is_initialized():
                try:
                    ray.get(info.handle.ping.remote(), timeout=max(0.1, deadline - time.monotonic()))
                except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                    break  # gone (a hung actor is not waited for beyond the deadline)
                except Exception as exc:
                    logger.debug(f"ray: waiting for {info.name} to go: {exc}")
                    break
                if time.monotonic() >= deadline:
                    logger.warning(f"ray: actor {info.name} still answers {timeout:g}s after it was killed")
                    return
                time.sleep(0.05)


def _asked(plan: ActorPlan) -> dict[str, float]:
    """What an actor reserves, by Ray's resource names (nothing asked: not named)."""
    asked = {"CPU": plan.num_cpus, "GPU": plan.num_gpus, "memory": plan.memory, **plan.custom}
    return {k: v for k, v in asked.items() if v}


def _amount(key: str, value: float) -> str:
    return f"{value / 2 ** 30:.3g} GiB" if key in ("memory", "object_store_memory") else f"{value:g}"


def _have(key: str, total: dict[str, float], free: dict[str, float] | None) -> str:
    """``CPU 2 (1 free)``: what a node has of ``key`` and, where it has some and Ray says, how much is free."""
    amount = float(total.get(key, 0.0))
    if free is None or not amount:
        return f"{key} {_amount(key, amount)}"
    return f"{key} {_amount(key, amount)} ({_amount(key, float(free.get(key, 0.0)))} free)"


def _has_worker(handle: Any) -> bool:
    """Whether Ray gave the actor a worker process on a node (its table entry has the worker's
    address); False where that cannot be read (a private API)."""
    try:
        info = ray._private.state.actors(actor_id=handle._actor_id.hex())
        address = info.get("Address") or {}
        return bool(address.get("IPAddress")) and bool(address.get("Port"))
    except Exception:
        return False


def _room_for(asked: dict[str, float], nodes: list[tuple[str, dict[str, float], dict[str, float] | None]]) -> bool:
    """Whether a live node has ``asked`` free now (its totals, where Ray does not say what is free)."""
    return any(all(float((free if free is not None else total).get(k, 0.0)) >= v for k, v in asked.items())
               for _, total, free in nodes)


def _nodes() -> list[tuple[str, dict[str, float], dict[str, float] | None]]:
    """(address, resources, free resources or None where Ray does not say) of each live node."""
    try:
        free_by_node: dict[str, dict[str, float]] | None = ray._private.state.available_resources_per_node()
    except Exception:  # a private API: the totals alone then
        free_by_node = None
    nodes = []
    for node in ray.nodes():
        if not node.get("Alive"):
            continue
        node_id = str(node.get("NodeID", ""))
        free = free_by_node.get(node_id, {}) if free_by_node is not None else None
        nodes.append((str(node.get("NodeManagerAddress") or node_id[:8]), dict(node.get("Resources", {})), free))
    return nodes
