"""A rollout worker and a trainer receive their parts (evaluators; the algorithm registry and train
service) in their constructor, as nexrl_core.launch.parts.build_module builds them (issue 42). A
subclass written the old way, ``__init__(self, config)``, still runs where it would miss nothing,
and otherwise is refused with one message that says what to change."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest
from omegaconf import OmegaConf

from nexrl_core import (
    BaseTrainer,
    ConfigError,
    NexRLError,
    Option,
    PluginError,
    RolloutParts,
    Settings,
    SimpleRolloutWorker,
    TrainerParts,
    hookimpl,
    setting,
)
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.launch.recipe import check_config
from nexrl_core.testing import build_module, check_plugin, make_recipe, plugin_manager

FIX = "write `def __init__(self, config, parts=None):` and call `super().__init__(config, parts)`"


class PartsWorker(SimpleRolloutWorker):
    """Written the new way: what it was given is there while its constructor runs."""

    def __init__(self, config: Any, parts: RolloutParts | None = None):
        super().__init__(config, parts)
        self.evaluator_at_init = self.evaluator_for({})


class OldWorker(SimpleRolloutWorker):
    """Written before parts came to the constructor."""

    def __init__(self, config: Any):
        super().__init__(config)
        self.built = True


def _worker_section(**section: Any) -> Any:
    return OmegaConf.create({"type": "simple", "seed": 0, **section})


def test_a_worker_has_its_evaluator_in_its_constructor(core_pm):
    worker = build_module(PartsWorker, _worker_section(evaluator={"type": "exact_match"}), pm=core_pm)
    assert type(worker.evaluator_at_init).__name__ == "ExactMatchEvaluator"
    assert worker._evaluator_label == "evaluator 'exact_match' (nexrl-core)"
    assert worker._worker_label == "rollout worker 'simple' (nexrl-core)"  # the recipe's rollout_worker.type
    bare = PartsWorker(_worker_section(evaluator={"type": "exact_match"}))  # by hand: no parts, no evaluator
    assert bare.evaluator_at_init is None and bare._evaluator_label == "no evaluator"


def test_an_old_style_worker_runs_without_an_evaluator_and_is_refused_with_one(core_pm):
    assert build_module(OldWorker, _worker_section(), pm=core_pm).built
    with pytest.raises(PluginError) as info:
        build_module(OldWorker, _worker_section(evaluator={"type": "exact_match"}), pm=core_pm)
    assert str(info.value) == (f"{__name__}.OldWorker.__init__ takes no `parts`, so it would run without evaluator "
                               f"'exact_match' (nexrl-core): a rollout worker or trainer receives its parts in its "
                               f"constructor; {FIX}")
    with pytest.raises(PluginError, match=r"without rollout_worker\.domain_evaluators: "):
        build_module(OldWorker, _worker_section(domain_evaluators={"math": {"type": "exact_match"}}), pm=core_pm)


@dataclass(frozen=True, kw_only=True)
class ShiftSettings(Settings):
    shift: float = setting(0.0, "added to every reward")


class AlgoTrainer(BaseTrainer):
    """A torch-free trainer that selects an estimator, as nexrl-grpo's do."""

    NO_MODEL_STATE = True
    ALGORITHM_OPTIONS = {**ShiftSettings.options(), "type": Option("grpo", str, "the estimator")}
    ALGORITHM_SELECTORS = {"type": "advantage_estimator"}

    def __init__(self, config: Any, parts: TrainerParts | None = None):
        super().__init__(config, parts)
        self.selection, self.settings = self.select_algorithm(ShiftSettings)

    def train(self, trajectories):
        return {}


class OldAlgoTrainer(AlgoTrainer):
    def __init__(self, config: Any):
        super().__init__(config)


class OldMock(MockTrainer):
    def __init__(self, config: Any):
        super().__init__(config)
        self.built = True


class _Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"algo": AlgoTrainer}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"old_worker": OldWorker}


def _recipe(**algorithm: Any) -> Any:
    return OmegaConf.create(make_recipe(trainer={"type": "algo"}, algorithm=algorithm))


def test_a_trainer_selects_its_algorithm_in_its_constructor():
    pm = plugin_manager(_Plugin())
    trainer = build_module(AlgoTrainer, _recipe(type="rloo", shift=0.5), pm=pm)
    assert trainer.selection.functions["type"].name == "rloo"
    assert trainer.settings == ShiftSettings(shift=0.5)
    assert trainer.algorithm_registry.names("advantage_estimator") == sorted(pm.functions("advantage_estimator"))


def test_a_bad_algorithm_key_fails_the_constructor_as_validate_reports_it():
    pm = plugin_manager(_Plugin())
    recipe = _recipe(type="rloo", shift="far")
    (problem,) = check_config(recipe, pm)  # what `nexrl validate` prints
    assert problem.startswith("algorithm.shift: ")
    with pytest.raises(ConfigError) as info:
        build_module(AlgoTrainer, recipe, pm=pm)
    assert str(info.value) == problem


def test_a_trainer_built_by_hand_has_no_registry_and_says_how_to_get_one():
    with pytest.raises(NexRLError, match=r"AlgoTrainer has no algorithm registry: build it with "
                                         r"nexrl_core\.testing\.build_module \(or pass parts=TrainerParts"):
        AlgoTrainer(_recipe())
    mock = MockTrainer(OmegaConf.create(make_recipe()))  # one that selects nothing needs none
    with pytest.raises(NexRLError, match="has no algorithm registry"):
        mock.algorithm_registry  # noqa: B018 - reading it is what fails


def test_an_old_style_trainer_runs_when_it_needs_no_parts_and_is_refused_when_it_does(core_pm):
    assert build_module(OldMock, OmegaConf.create(make_recipe()), pm=core_pm).built
    with pytest.raises(PluginError) as info:
        build_module(OldAlgoTrainer, _recipe(), pm=plugin_manager(_Plugin()))
    assert str(info.value).startswith(f"{__name__}.OldAlgoTrainer.__init__ takes no `parts`, so it would run "
                                      f"without the algorithm registry: ")
    assert str(info.value).endswith(FIX)


def test_the_plugin_check_notes_a_constructor_without_parts():
    reports = {r.component.split(" (")[0]: r for r in check_plugin("_Plugin", pm=plugin_manager(_Plugin()))}
    assert any("takes no `parts`" in n and FIX in n for n in reports["rollout worker 'old_worker'"].notes)
    assert not any("parts" in n for n in reports["trainer 'algo'"].notes)
