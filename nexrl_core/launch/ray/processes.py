"""The Ray side of :func:`nexrl_core.launch.processes.start_processes`: one actor per process, in
a placement group of one bundle each (a CPU and ``num_gpus`` GPUs, packed onto as few nodes as
hold them). The actors belong to the actor that starts them: Ray ends them with it."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

import ray
import ray.exceptions
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from ..base import IN_RAY_ACTOR, StartedProcess
from .cluster import _PASSED_NAMES, _PASSED_PREFIXES

PLACEMENT_TIMEOUT_S = 600.0  # how long the cluster may take to free the bundles


def node_address() -> str:
    return str(ray.util.get_node_ip_address())


class _Host:
    """An actor with the starting process's import path and environment; where and as which pid it runs."""

    def __init__(self, sys_path: list[str], env: dict[str, str]):
        for entry in reversed(sys_path):
            if entry not in sys.path:
                sys.path.insert(0, entry)
        os.environ.update(env)

    def where(self) -> tuple[str, int]:
        return node_address(), os.getpid()


@ray.remote
class _ProcessHost(_Host):
    """Runs one started process's target."""

    def run(self, target: Callable[..., Any], args: tuple) -> None:
        target(*args)


class _RayProcess(StartedProcess):
    kind = "Ray actor"

    def __init__(self, name: str, actor: Any, ref: Any, host: str, pid: int, group: Any, last: bool):
        self.name, self.host, self.pid = name, host, pid
        self._actor, self._ref, self._group, self._last = actor, ref, group, last
        self._cause: str | None = None

    def is_alive(self) -> bool:
        ready, _ = ray.wait([self._ref], timeout=0)
        return not ready

    def exit_cause(self) -> str | None:
        if self.is_alive():
            return None
        if self._cause is None:
            try:
                ray.get(self._ref)
                self._cause = "returned"
            except ray.exceptions.RayTaskError as exc:
                cause = exc.cause if isinstance(exc.cause, BaseException) else exc
                self._cause = f"{type(cause).__name__}: {cause}"
            except ray.exceptions.RayActorError as exc:
                text = str(exc).strip()
                self._cause = f"its actor died ({text.splitlines()[0] if text else type(exc).__name__})"
        return self._cause

    def stop(self, timeout: float = 60.0) -> None:
        ray.wait([self._ref], timeout=timeout)
        ray.kill(self._actor)
        if self._last:  # the group goes with the last of its processes
            remove_placement_group(self._group)


@ray.remote
class _ObjectHost(_Host):
    """Holds one object :func:`start_ray_objects` made and runs its methods."""

    def make(self, factory: Callable[..., Any], args: tuple) -> None:
        self._object = factory(*args)

    def call(self, method: str, args: tuple, kwargs: dict) -> Any:
        args = tuple(ray.get(a) if isinstance(a, ray.ObjectRef) else a for a in args)  # share()d values
        return getattr(self._object, method)(*args, **kwargs)


class _RayObject:
    """A handle on an object in an actor: its methods, called and waited for."""

    kind = "Ray actor"

    def __init__(self, name: str, actor: Any, host: str, pid: int, group: Any, last: bool):
        self.name, self.host, self.pid = name, host, pid
        self._actor, self._group, self._last = actor, group, last

    def __getattr__(self, method: str) -> Callable[..., Any]:
        if method.startswith("_"):
            raise AttributeError(method)
        return lambda *args, **kwargs: self._call(method, args, kwargs)

    def _call(self, method: str, args: tuple, kwargs: dict) -> Any:
        from ...errors import NexRLError

        try:
            return ray.get(self._actor.call.remote(method, args, kwargs))
        except ray.exceptions.RayActorError as exc:  # not passed on raw: callers read it as their own actor's death
            text = str(exc).strip()
            raise NexRLError(f"{self.name} ({self.host}, pid {self.pid}) stopped: its actor died "
                             f"({text.splitlines()[0] if text else type(exc).__name__})") from None

    def stop(self, timeout: float = 60.0) -> None:
        ray.kill(self._actor)
        if self._last:
            remove_placement_group(self._group)


def share_value(value: Any) -> Any:
    return ray.put(value)


def start_ray_objects(factory: Callable[..., Any], args: Sequence[tuple], names: Sequence[str], *,
                      num_gpus: float = 0) -> list[Any]:
    group, actors = _placed(_ObjectHost, len(args), names, num_gpus, max_concurrency=64)
    try:
        ray.get([actor.make.remote(factory, entry) for actor, entry in zip(actors, args)])
    except Exception:
        for actor in actors:
            ray.kill(actor)
        remove_placement_group(group)
        raise
    places = ray.get([actor.where.remote() for actor in actors])
    return [_RayObject(names[i], actor, host, pid, group, i == len(args) - 1)
            for i, (actor, (host, pid)) in enumerate(zip(actors, places))]


def _placed(host_class: Any, count: int, names: Sequence[str], num_gpus: float, **options: Any) -> tuple[Any, list]:
    """A placement group of ``count`` bundles (a CPU and ``num_gpus`` GPUs each) and an actor in each."""
    from ...errors import NexRLError

    bundle = {"CPU": 1.0, **({"GPU": float(num_gpus)} if num_gpus else {})}
    group = placement_group([dict(bundle) for _ in range(count)], strategy="PACK")
    ready, _ = ray.wait([group.ready()], timeout=PLACEMENT_TIMEOUT_S)
    if not ready:
        remove_placement_group(group)
        raise NexRLError(f"ray: no room for {count} x {bundle} for {', '.join(names)} within {PLACEMENT_TIMEOUT_S:g}s "
                         f"(cluster resources: {ray.cluster_resources()})")
    env = {k: v for k, v in os.environ.items() if k.startswith(_PASSED_PREFIXES) or k in _PASSED_NAMES}
    env[IN_RAY_ACTOR] = "1"
    actors = [host_class.options(name=f"{names[i]}-{os.getpid()}", num_cpus=1, num_gpus=num_gpus, max_restarts=0,
                                 scheduling_strategy=PlacementGroupSchedulingStrategy(group, i), **options)
              .remote(list(sys.path), env) for i in range(count)]
    return group, actors


def start_ray_processes(target: Callable[..., Any], args: Sequence[tuple], names: Sequence[str], *,
                        num_gpus: float = 0) -> list[StartedProcess]:
    group, actors = _placed(_ProcessHost, len(args), names, num_gpus)
    places = ray.get([actor.where.remote() for actor in actors])
    return [_RayProcess(names[i], actor, actor.run.remote(target, entry), host, pid, group, i == len(args) - 1)
            for i, (actor, entry, (host, pid)) in enumerate(zip(actors, args, places))]
