"""Built-in weight-sync backend for services that need no weight transfer."""

from __future__ import annotations

from ..markers import hookimpl
from ..weight_sync import VersionOnlyWeightSync


@hookimpl
def nexrl_weight_sync_backends():
    return {"version_only": VersionOnlyWeightSync}
