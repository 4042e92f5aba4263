"""The recipe's ``ray:`` section (declared, with its defaults, in :data:`nexrl_core.config.schema.RAY`,
and checked there like every core key), read without importing Ray: ``nexrl validate`` checks a
Ray recipe on a machine without Ray, and says what to install."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ...config.bound import declared_value
from ...config.options import option_defaults
from ...config.schema import RAY, ROLLOUT_WORKER

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
    address: str | None
    num_cpus: float | None
    num_gpus: float | None
    object_store_memory: int | None
    call_timeout: float | None
    colocation: dict[str, str | None]
    resources: dict[str, dict[str, Any]]
    max_concurrency: int | None
    env_vars: dict[str, str]
    num_worker_actors: int = 1
    private_network: bool = False
    placement_timeout: float | None = None

    @classmethod
    def from_config(cls, config: Any) -> RaySettings:
        """From a loaded recipe (every key present); a partial mapping gets the schema's defaults."""
        section = {**option_defaults(RAY), **(_plain(config.get("ray")) or {})}
        colocation = {**option_defaults(RAY["colocation"].options), **(section["colocation"] or {})}
        workers = config.get("rollout_worker") or {}
        return cls(
            address=section["address"] or os.environ.get("RAY_ADDRESS") or None,
            num_cpus=section["num_cpus"],
            num_gpus=section["num_gpus"],
            object_store_memory=section["object_store_memory"],
            call_timeout=section["call_timeout"],
            colocation=colocation,
            resources={k: {n: a for n, a in (v or {}).items() if a is not None}
                       for k, v in section["resources"].items()},
            max_concurrency=section["max_concurrency"],
            env_vars={str(k): str(v) for k, v in section["env_vars"].items()},
            num_worker_actors=int(declared_value(workers, "num_actors", ROLLOUT_WORKER, "rollout_worker")),
            private_network=section["private_network"],
            placement_timeout=section["placement_timeout"],
        )


def _plain(section: Any) -> Any:
    if section is None or isinstance(section, dict):
        return section
    from omegaconf import OmegaConf

    return OmegaConf.to_container(section, resolve=True)
