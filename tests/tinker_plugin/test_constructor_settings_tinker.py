"""The remote GRPO trainer selects its estimator and builds its typed settings and reward processing
once, in its constructor (issue 42): a bad ``algorithm`` section is refused there, before the
service is built, with the ConfigError ``nexrl validate`` prints for the same recipe."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nexrl_core import ConfigError, algorithms
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import check_config
from nexrl_tinker.trainers import RemoteApiGrpoTrainer, RemoteGrpoSettings
from tests.tinker_plugin.helpers import grpo_recipe, tinker_plugin_manager


def _recipe(tiny_folder: str, **algorithm) -> dict:
    recipe = grpo_recipe("/tmp/unused", "http://127.0.0.1:9", tiny_folder, steps=1, group=2)
    recipe["algorithm"] = {"type": "grpo", **algorithm}
    return recipe


def test_settings_and_reward_processing_are_built_in_the_constructor(tiny_folder):
    trainer = build_module(RemoteApiGrpoTrainer, OmegaConf.create(_recipe(tiny_folder, type="rloo", loss_fn="ppo")),
                           pm=tinker_plugin_manager())
    assert trainer.train_service is None  # nothing contacted, nothing built
    assert isinstance(trainer.settings, RemoteGrpoSettings) and trainer.settings.loss_fn == "ppo"
    assert trainer.selection.functions["type"].name == "rloo"
    assert isinstance(trainer.reward_processor, algorithms.RewardProcessor)
    assert trainer.algorithm_state() == {"reward_running": trainer.reward_processor.state_dict()}


@pytest.mark.parametrize("algorithm", [{"type": "grpp"}, {"clip_ratio_low": 0.1}, {"loss_fn": "cross_entropy"}])
def test_a_bad_algorithm_section_fails_the_constructor_as_validate_reports_it(tiny_folder, algorithm):
    recipe = OmegaConf.create(_recipe(tiny_folder, **algorithm))
    pm = tinker_plugin_manager()
    (problem,) = check_config(recipe, pm)  # what `nexrl validate` prints
    with pytest.raises(ConfigError) as info:
        build_module(RemoteApiGrpoTrainer, recipe, pm=pm)
    assert str(info.value) == problem
