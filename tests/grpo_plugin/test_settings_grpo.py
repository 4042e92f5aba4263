"""The GRPO trainer reads its ``algorithm.*`` keys from typed settings (:class:`GrpoSettings`,
:class:`CriticAlgorithmSettings`) built once from the checked section, after the selected
functions' recommended defaults; the nested sections are typed objects too; and it refuses, by
key, a train service it cannot drive."""

from __future__ import annotations

from typing import Any

import pytest
from omegaconf import OmegaConf

from nexrl_core import ConfigError, TrainService, algorithms
from nexrl_core.launch.parts import build_module
from nexrl_grpo.critic import CriticAlgorithmSettings, CriticSettings
from nexrl_grpo.trainers import GrpoSettings, SelfHostedGrpoTrainer
from tests.grpo_plugin.test_on_policy import make_trainer


def test_a_recommended_default_reaches_the_typed_settings_and_the_recipe_beats_it(tiny_model_dir):
    # reinforce_plus_plus recommends use_kl_in_reward: true (its recommended_defaults).
    trainer = make_trainer(tiny_model_dir, type="reinforce_plus_plus")
    assert isinstance(trainer.settings, GrpoSettings) and trainer.settings.use_kl_in_reward is True
    assert trainer.algorithm.critic is None  # no estimator that needs values: no critic keys
    chosen = make_trainer(tiny_model_dir, type="reinforce_plus_plus", use_kl_in_reward=False)
    assert chosen.settings.use_kl_in_reward is False


def test_nested_sections_are_typed_and_read_from_the_recipe(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, type="gae", use_kl_in_reward=True,
                           kl_ctrl={"type": "adaptive", "target_kl": 0.5},
                           rollout_correction={"enabled": True, "cap": 3.0},
                           reward_processing={"norm": "group", "domains": {"math": {"clip": 1.0}}},
                           critic_warmup=2, critic={"lr": 3e-4, "loss_agg_mode": "seq-mean-token-sum"})
    settings = trainer.settings
    assert isinstance(settings.kl_ctrl, algorithms.KlCtrlSettings)
    assert (settings.kl_ctrl.type, settings.kl_ctrl.target_kl, settings.kl_ctrl.kl_coef) == ("adaptive", 0.5, 0.001)
    assert isinstance(trainer.algorithm.kl_ctrl, algorithms.AdaptiveKLController)  # built from those settings
    assert settings.rollout_correction == algorithms.RolloutCorrectionSettings(enabled=True, cap=3.0)
    assert isinstance(settings.reward_processing, algorithms.RewardProcessingSettings)
    assert settings.reward_processing.norm == "group" and settings.reward_processing.domains == {"math": {"clip": 1.0}}
    assert trainer.algorithm.reward_processor.options["domains"] == {"math": {"clip": 1.0}}
    critic = trainer.algorithm.critic
    assert isinstance(critic, CriticAlgorithmSettings) and isinstance(critic.critic, CriticSettings)
    assert (critic.critic_warmup, critic.critic.lr, critic.critic.loss_agg_mode) == (2, 3e-4, "seq-mean-token-sum")
    assert trainer.critic is not None and trainer.critic.optimizer.param_groups[0]["lr"] == 3e-4


class _CountingService(TrainService):
    """A train service of another kind (it keeps no model): what the GRPO trainer cannot drive."""

    BATCH_FORMAT = "torch_tensors"

    def forward(self, batch: Any) -> Any:
        return None

    def forward_backward(self, batch: Any, loss: Any) -> Any:
        return {}

    def optim_step(self) -> Any:
        return {}

    def save_state(self, folder: str, extra_state: dict[str, Any] | None = None) -> None:
        pass

    def load_state(self, folder: str) -> dict[str, Any]:
        return {}

    def sampling_client(self) -> Any:
        return None


def test_a_train_service_it_cannot_drive_is_refused_by_key(tiny_model_dir):
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 8},
        "rollout_worker": {}, "algorithm": {},
        "service": {"train_service": {"model_path": tiny_model_dir}, "inference_service": {}},
    })
    trainer = build_module(SelfHostedGrpoTrainer, config)
    trainer._train_service_factory = lambda steps: _CountingService()
    with pytest.raises(ConfigError, match="service.train_service.backend: SelfHostedGrpoTrainer trains through "
                                          "nexrl-torch's LocalTorchTrainService .* not _CountingService"):
        trainer.initialize_workers()
