"""The ``tinker`` weight-sync backend: after each step the rollouts sample from the new weights.

The trainer's :meth:`~nexrl_core.BaseTrainer.export_weights` returns a ``tinker.SamplingClient``
of its current weights (a Tinker trainer implements it with
:meth:`nexrl_tinker.service.TinkerTrainService.sampling_client`, i.e.
``save_weights_and_get_sampling_client``); this backend hands it to the ``tinker`` inference
client together with the version, which every completion then reports. No weights travel
through this process: the snapshot stays on the service.
"""

from __future__ import annotations

from typing import Any

from nexrl_core import Capabilities, ConfigError, WeightSyncBackend, execute

from .inference import SAMPLER_CAPABILITY

# A trainer whose export_weights() is a sampling client of its weights on the service.
TRAINER_CAPABILITY = "trainer:tinker_sampler"
SYNC_CAPABILITY = "weight_sync:tinker_sampler"


class TinkerWeightSync(WeightSyncBackend):
    CAPABILITIES = Capabilities(
        provides={SYNC_CAPABILITY},
        requires={TRAINER_CAPABILITY: "it hands the inference backend the sampling client a Tinker trainer exports",
                  SAMPLER_CAPABILITY: "it gives the inference backend a Tinker sampling client to sample from"})

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        sampler = execute(trainer.export_weights)
        if not callable(getattr(sampler, "sample", None)):
            raise ConfigError(f"weight.backend: 'tinker' needs a trainer that trains through Tinker (its "
                              f"export_weights() gave {type(sampler).__name__}, not a tinker.SamplingClient)")
        if not hasattr(inference_client, "set_sampling_client"):
            raise ConfigError(f"weight.backend: 'tinker' needs service.inference_service.backend: tinker "
                              f"(got {type(inference_client).__name__})")
        execute(inference_client.set_sampling_client, sampler, version)
