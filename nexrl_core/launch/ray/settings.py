"""The recipe's ``ray:`` section, read and checked without importing Ray (``nexrl validate``
checks a Ray recipe on a machine without Ray, and says what to install)."""

from __future__ import annotations

import importlib.util
import math
import os
from dataclasses import dataclass, field
from typing import Any

from ...types import NexRLRole

ROLES = tuple(r.value for r in NexRLRole)
RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources")
#: Calls that last as long as the work they do (model load, checkpoint, weight push, waits on
#: other modules, stop): not bounded by ``ray.call_timeout``. A module that dies still fails
#: them at once.
UNBOUNDED_METHODS = frozenset({
    "initialize_workers", "save_checkpoint", "resume_checkpoint", "load_model_state", "save_model_state",
    "sync_weight_to_rollout_service", "train_worker_notify_weight_update", "load_weights", "export_weights",
    "stop", "close", "wait_quiescent", "compute_and_log_metrics",
})


@dataclass
class RaySettings:
    address: str | None = None
    num_cpus: float | None = None
    num_gpus: float | None = None
    object_store_memory: int | None = None
    call_timeout: float | None = 300.0
    colocation: dict[str, str | None] = field(default_factory=dict)
    resources: dict[str, dict[str, Any]] = field(default_factory=dict)
    max_concurrency: int | None = None
    env_vars: dict[str, str] = field(default_factory=dict)
    num_worker_actors: int = 1

    @classmethod
    def from_config(cls, config: Any) -> RaySettings:
        section = _plain(config.get("ray")) or {}
        address = section.get("address") or os.environ.get("RAY_ADDRESS") or None
        workers = config.get("rollout_worker") or {}
        return cls(
            address=address,
            num_cpus=section.get("num_cpus"),
            num_gpus=section.get("num_gpus"),
            object_store_memory=section.get("object_store_memory"),
            call_timeout=section.get("call_timeout", 300.0),
            colocation=dict(section.get("colocation") or {}),
            resources={k: dict(v or {}) for k, v in (section.get("resources") or {}).items()},
            max_concurrency=section.get("max_concurrency"),
            env_vars={str(k): str(v) for k, v in (section.get("env_vars") or {}).items()},
            num_worker_actors=int(workers.get("num_actors", 1) or 1),
        )


def _plain(section: Any) -> Any:
    if section is None or isinstance(section, dict):
        return section
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True)


def ray_installed() -> bool:
    return importlib.util.find_spec("ray") is not None


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def ray_problems(config: Any) -> list[str]:
    """Problems of the ``ray`` section and the Ray-related worker keys (one line each; the
    section's key names and types are checked with the other strict sections)."""
    problems: list[str] = []
    section = _plain(config.get("ray")) or {}
    if not isinstance(section, dict):
        return problems  # reported as "expected a mapping" by the strict key check
    for key in ("num_cpus", "num_gpus"):
        value = section.get(key)
        if value is not None and (not _number(value) or value < 0):
            problems.append(f"ray.{key}: expected a number >= 0 or null, got {value!r}")
    value = section.get("object_store_memory")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value <= 0):
        problems.append(f"ray.object_store_memory: expected a positive number of bytes or null, got {value!r}")
    value = section.get("call_timeout")
    if value is not None and (not _number(value) or value <= 0):
        problems.append(f"ray.call_timeout: expected seconds > 0 or null (no limit), got {value!r}")
    value = section.get("max_concurrency")
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        problems.append(f"ray.max_concurrency: expected a positive integer or null, got {value!r}")
    colocation = section.get("colocation") or {}
    if isinstance(colocation, dict):
        for role, group in colocation.items():
            if group is not None and (not isinstance(group, str) or not group):
                problems.append(f"ray.colocation.{role}: expected a group name or null, got {group!r}")
        worker_group = colocation.get("rollout_worker")
        if worker_group is not None:
            others = sorted(r for r, g in colocation.items() if g == worker_group and r != "rollout_worker")
            if others:
                problems.append(f"ray.colocation: rollout workers spread over rollout_worker.num_actors actors of "
                                f"their own; group '{worker_group}' also names {', '.join(others)}")
    resources = section.get("resources") or {}
    if not isinstance(resources, dict):
        problems.append(f"ray.resources: expected a mapping of role -> resources, got {resources!r}")
        resources = {}
    for role, spec in resources.items():
        if role not in ROLES:
            problems.append(f"ray.resources.{role}: unknown role (roles: {', '.join(ROLES)})")
            continue
        if not isinstance(spec, dict):
            problems.append(f"ray.resources.{role}: expected a mapping with {', '.join(RESOURCE_KEYS)}, got {spec!r}")
            continue
        for key, value in spec.items():
            where = f"ray.resources.{role}.{key}"
            if key not in RESOURCE_KEYS:
                problems.append(f"{where}: unknown key (resources: {', '.join(RESOURCE_KEYS)})")
            elif key == "resources":
                if not isinstance(value, dict) or not all(_number(v) and v >= 0 for v in value.values()):
                    problems.append(f"{where}: expected a mapping of custom resource -> amount >= 0, got {value!r}")
            elif not _number(value) or value < 0:
                problems.append(f"{where}: expected a number >= 0, got {value!r}")
    env_vars = section.get("env_vars") or {}
    if not isinstance(env_vars, dict):
        problems.append(f"ray.env_vars: expected a mapping of name -> value, got {env_vars!r}")
    workers = config.get("rollout_worker") or {}
    num_actors, num_workers = workers.get("num_actors", 1), workers.get("num_workers", 1)
    if not isinstance(num_actors, int) or isinstance(num_actors, bool) or num_actors < 1:
        problems.append(f"rollout_worker.num_actors: expected a positive integer, got {num_actors!r}")
    elif isinstance(num_workers, int) and num_actors > num_workers:
        problems.append(f"rollout_worker.num_actors ({num_actors}) exceeds rollout_worker.num_workers "
                        f"({num_workers}): every actor hosts at least one worker")
    return problems
