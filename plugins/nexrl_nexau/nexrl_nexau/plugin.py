"""Entry point of nexrl-nexau: registers the NexAU rollout worker as ``nexau``."""

from __future__ import annotations

from nexrl_core import hookimpl

from .worker import DefaultNexAURolloutWorker


@hookimpl
def nexrl_rollout_workers():
    return {"nexau": DefaultNexAURolloutWorker}
