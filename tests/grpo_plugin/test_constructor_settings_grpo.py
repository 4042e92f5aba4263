"""The GRPO and OPD trainers select their algorithm and build their typed settings once, in their
constructor, from the registry the launcher hands them there (issue 42): nothing is resolved
later, no model loads before a bad ``algorithm`` section is refused, and the refusal is the
ConfigError ``nexrl validate`` prints for the same recipe."""

from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from nexrl_core import ConfigError, NexRLError, TrainerParts
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_grpo.critic import CriticAlgorithmSettings
from nexrl_grpo.opd import OpdSettings, SelfHostedOpdTrainer
from nexrl_grpo.trainers import GrpoSettings, SelfHostedGrpoTrainer
from tests.support.letters import grpo_plugin_manager

QUICKSTART = str(Path(__file__).resolve().parents[2] / "recipes" / "quickstart.yaml")


def test_settings_are_built_in_the_constructor_before_any_model(tmp_path):
    cfg = load_recipe(QUICKSTART, [f"run_dir={tmp_path}", "+algorithm.type=gae", "+algorithm.ppo_epochs=2"])
    trainer = build_module(SelfHostedGrpoTrainer, cfg, pm=grpo_plugin_manager())
    assert trainer.train_service is None  # initialize_workers (the model) has not run
    assert isinstance(trainer.settings, GrpoSettings) and trainer.settings.ppo_epochs == 2
    assert trainer._ppo_epochs == 2
    assert trainer.selection.functions["type"].name == "gae"
    assert (trainer.algorithm.selection, trainer.algorithm.settings) == (trainer.selection, trainer.settings)
    assert isinstance(trainer.algorithm.critic, CriticAlgorithmSettings)  # gae needs values: a critic


@pytest.mark.parametrize("override", ["+algorithm.type=grpp", "+algorithm.critic_warmup=2", "algorithm.loss_agg_mode=x"])
def test_a_bad_algorithm_section_fails_the_constructor_as_validate_reports_it(tmp_path, override):
    cfg = load_recipe(QUICKSTART, [f"run_dir={tmp_path}", override])
    pm = grpo_plugin_manager()
    (problem,) = check_config(cfg, pm)  # what `nexrl validate` prints
    with pytest.raises(ConfigError) as info:
        build_module(SelfHostedGrpoTrainer, cfg, pm=pm)
    assert str(info.value) == problem


def test_opd_reads_its_settings_in_the_constructor(tmp_path):
    recipe = OmegaConf.to_container(load_recipe(QUICKSTART, [f"run_dir={tmp_path}"]))
    recipe["trainer"]["type"], recipe["algorithm"] = "self_hosted_opd", {"kl_coef": 0.5}
    recipe["service"]["reference_service"] = {"backend": "hf", "model_path": "unused: nothing loads yet"}
    trainer = build_module(SelfHostedOpdTrainer, OmegaConf.create(recipe), pm=grpo_plugin_manager())
    assert isinstance(trainer.settings, OpdSettings) and trainer.settings.kl_coef == 0.5
    assert trainer.teacher is None and trainer.train_service is None


def test_a_grpo_trainer_without_a_registry_says_how_to_get_one(tmp_path):
    cfg = load_recipe(QUICKSTART, [f"run_dir={tmp_path}"])
    with pytest.raises(NexRLError, match="has no algorithm registry: build it with nexrl_core.testing.build_module"):
        SelfHostedGrpoTrainer(cfg)
    registry = build_module(SelfHostedGrpoTrainer, cfg, pm=grpo_plugin_manager()).algorithm_registry
    by_hand = SelfHostedGrpoTrainer(cfg, TrainerParts(algorithm_registry=registry))  # parts given by hand
    assert by_hand.selection.functions["type"].name == "grpo"
