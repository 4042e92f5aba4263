"""Built-in weight-sync backend for services that need no weight transfer."""

from __future__ import annotations

from typing import Any

from ..markers import hookimpl
from ..runtime.execute import execute
from ..weight_sync import WeightSyncBackend


class VersionOnlyWeightSync(WeightSyncBackend):
    """For services that need no weight transfer (test backends, frozen references)."""

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        execute(inference_client.set_model_version, version)


@hookimpl
def nexrl_weight_sync_backends():
    return {"version_only": VersionOnlyWeightSync}
