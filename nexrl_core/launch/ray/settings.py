"""What the Ray launcher does with the recipe's ``ray:`` section (declared, with its defaults, as
:class:`nexrl_core.config.schema.RaySectionSettings`, and checked there like every core key), read
without importing Ray: ``nexrl validate`` checks a Ray recipe on a machine without Ray, and says what
to install."""

from __future__ import annotations

import os
from dataclasses import dataclass

from ...config.schema import RayResourceSettings, RecipeSettings

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
    """The declared ``ray`` section as the launcher uses it: the cluster's address with
    ``$RAY_ADDRESS`` in, each role's reservation typed (a null one left out), the environment as text."""

    address: str | None
    num_cpus: float | None
    num_gpus: float | None
    object_store_memory: int | None
    call_timeout: float | None
    colocation: dict[str, str | None]
    resources: dict[str, RayResourceSettings]
    max_concurrency: int | None
    env_vars: dict[str, str]
    num_worker_actors: int = 1
    private_network: bool = False
    placement_timeout: float | None = None

    @classmethod
    def of(cls, settings: RecipeSettings) -> RaySettings:
        ray = settings.ray
        return cls(
            address=ray.address or os.environ.get("RAY_ADDRESS") or None,
            num_cpus=ray.num_cpus,
            num_gpus=ray.num_gpus,
            object_store_memory=ray.object_store_memory,
            call_timeout=ray.call_timeout,
            colocation=dict(ray.colocation),
            resources={role: RayResourceSettings.of(wants, f"ray.resources.{role}")
                       for role, wants in ray.resources.items() if wants is not None},
            max_concurrency=ray.max_concurrency,
            env_vars={str(k): str(v) for k, v in ray.env_vars.items()},
            num_worker_actors=settings.rollout_worker.num_actors,
            private_network=ray.private_network,
            placement_timeout=ray.placement_timeout,
        )
