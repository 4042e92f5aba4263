"""Hydra-style composition of a recipe (nexrl_core.launch.compose): the defaults list, `_self_` order,
config groups from the recipe's folder and from the package, `# @package`, nested defaults, and
group overrides (`g=x`, `+g=x`, `~g`) on the command line."""

from __future__ import annotations

import textwrap

import pytest

from nexrl_core.errors import ConfigError
from nexrl_core.launch.recipe import check_config, load_recipe

BASE = """\
data: {type: inline, rows: [{prompt: "1 + 2", answer: "3"}]}
trajectory_pool: {batch_size: 4, group_size: 2}
trainer: {type: mock}
service: {inference_service: {backend: mock}}
"""


@pytest.fixture
def folder(tmp_path):
    def write(files: dict[str, str]):
        for name, text in files.items():
            path = tmp_path / name
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(textwrap.dedent(text))
        return tmp_path
    return write


def test_a_package_group_and_self_ordering(folder):
    root = folder({"r.yaml": "defaults:\n  - weight: fully_async\n  - _self_\n" + BASE +
                   "weight: {staleness_threshold: 5}\n"})
    cfg = load_recipe(str(root / "r.yaml"))
    assert cfg.weight.sync_mode == "fully-async"  # from nexrl_core/conf/weight/fully_async.yaml
    assert cfg.weight.staleness_threshold == 5  # _self_ comes last: the recipe wins
    assert cfg.weight.backend == "version_only"  # the core's defaults lie underneath
    # _self_ first: the group wins over the recipe's own value
    root = folder({"r2.yaml": "defaults:\n  - _self_\n  - weight: fully_async\n" + BASE +
                   "weight: {staleness_threshold: 5}\n"})
    assert load_recipe(str(root / "r2.yaml")).weight.staleness_threshold == 2
    # without _self_ it is implicitly last (Hydra 1.1+)
    root = folder({"r3.yaml": "defaults:\n  - weight: fully_async\n" + BASE + "weight: {staleness_threshold: 5}\n"})
    assert load_recipe(str(root / "r3.yaml")).weight.staleness_threshold == 5


def test_groups_in_the_recipe_folder_shadow_the_package_and_nest(folder):
    root = folder({
        "r.yaml": "defaults:\n  - trainer: long\n  - weight: sync\n  - common\n  - _self_\n" + BASE,
        "trainer/long.yaml": "defaults:\n  - schedule: slow\ntotal_train_steps: 50\n",
        "trainer/schedule/slow.yaml": "# @package trainer\nsave_freq: 25\n",
        "weight/sync.yaml": "sync_mode: sync\nvalidate_freq: 0\nrollout_limit: 3\n",  # shadows the package's
        "common.yaml": "# @package _global_\nseed: 7\nrollout_worker: {num_workers: 3}\n",
    })
    cfg = load_recipe(str(root / "r.yaml"))
    assert cfg.trainer.total_train_steps == 50 and cfg.trainer.save_freq == 25
    assert cfg.weight.rollout_limit == 3
    assert cfg.seed == 7 and cfg.rollout_worker.num_workers == 3
    assert cfg.data.seed == 7  # interpolations resolve after composition
    assert check_config(cfg, _pm()) == []


def _pm():
    from nexrl_core.plugins import PluginManager

    return PluginManager(load_entrypoints=False)


def test_group_overrides_select_add_and_remove(folder):
    root = folder({
        "r.yaml": "defaults:\n  - trainer: short\n  - _self_\n" + BASE,
        "trainer/short.yaml": "total_train_steps: 2\n",
        "trainer/long.yaml": "total_train_steps: 50\n",
    })
    path = str(root / "r.yaml")
    assert load_recipe(path).trainer.total_train_steps == 2
    assert load_recipe(path, ["trainer=long"]).trainer.total_train_steps == 50
    assert load_recipe(path, ["~trainer"]).trainer.total_train_steps == 10  # the core default
    cfg = load_recipe(path, ["+weight=batch_async", "weight.staleness_threshold=4", "trainer=long"])
    assert cfg.weight.sync_mode == "batch-async" and cfg.weight.staleness_threshold == 4
    assert cfg.trainer.total_train_steps == 50
    # a value override still reaches a key a group set
    assert load_recipe(path, ["trainer.total_train_steps=9"]).trainer.total_train_steps == 9


@pytest.mark.parametrize("files, overrides, expected", [
    ({"r.yaml": "defaults:\n  - weight: fast\n" + BASE}, [],
     "r.yaml: defaults[0]: config group 'weight' has no option 'fast' (available: batch_async, fully_async, sync)"),
    ({"r.yaml": "defaults:\n  - trainer: grpo\n" + BASE}, [], "r.yaml: defaults[0]: no config 'trainer/grpo.yaml' in"),
    ({"r.yaml": "defaults:\n  - optional trainer: grpo\n" + BASE}, ["trainer.total_train_steps=0"], None),
    ({"r.yaml": BASE}, ["weight=sync"],
     "override 'weight=sync': the recipe's defaults list has no group 'weight' (use '+weight=sync' to add it)"),
    ({"r.yaml": BASE}, ["~weight"], "override '~weight': the defaults list has no group 'weight' to remove"),
    ({"r.yaml": BASE}, ["+weight=[sync]"], "override '+weight=[sync]': 'weight' is a config group: give one "
                                           "option name (available: batch_async, fully_async, sync)"),
    ({"r.yaml": "defaults: {weight: sync}\n" + BASE}, [], "r.yaml: defaults: expected a list"),
    ({"r.yaml": "defaults:\n  - _self_\n  - _self_\n" + BASE}, [], "defaults[1]: _self_ appears twice"),
    ({"r.yaml": "defaults:\n  - weight: [sync, fully_async]\n" + BASE}, [],
     "defaults[0]: option of group 'weight' must be one name, got list"),
    ({"r.yaml": "defaults:\n  - a\n" + BASE, "a.yaml": "defaults:\n  - a\n"}, [], "'a' includes itself"),
    ({"r.yaml": "defaults:\n  - extra\n" + BASE, "extra.yaml": "seed: [unclosed\n"}, [], "extra.yaml:1: not valid YAML (a '[' opens here, column 7, and is never closed)"),
    ({"r.yaml": "defaults:\n  - extra\n" + BASE, "extra.yaml": "- 1\n"}, [],
     "extra.yaml: a config must be a mapping of keys, got list"),
])
def test_composition_errors_name_the_file_and_entry(folder, files, overrides, expected):
    root = folder(files)
    if expected is None:  # an optional group that does not exist is skipped
        assert load_recipe(str(root / "r.yaml"), overrides).trainer.total_train_steps == 0
        return
    with pytest.raises(ConfigError) as info:
        load_recipe(str(root / "r.yaml"), overrides)
    assert expected in str(info.value)


def test_a_value_override_on_a_section_with_no_group_is_refused(folder):
    root = folder({"r.yaml": BASE})
    with pytest.raises(ConfigError) as info:
        load_recipe(str(root / "r.yaml"), ["trainer=grpo"])
    assert str(info.value) == ("override 'trainer=grpo': 'trainer' is a section, not a value, and there is no config "
                               "group 'trainer' (no trainer/grpo.yaml next to the recipe or in nexrl_core/conf); set "
                               "one of its keys, e.g. trainer.type=grpo")
    # a folder of data files next to the recipe is not a config group
    folder({"data/train.jsonl": '{"prompt": "a"}\n'})
    with pytest.raises(ConfigError, match=r"'data' is a section, not a value, and there is no config group 'data'"):
        load_recipe(str(root / "r.yaml"), ["data=train"])
    # a group in the recipe's folder makes the same override a selection
    folder({"trainer/grpo.yaml": "total_train_steps: 3\n"})
    with pytest.raises(ConfigError, match=r"use '\+trainer=grpo' to add it"):
        load_recipe(str(root / "r.yaml"), ["trainer=grpo"])
    assert load_recipe(str(root / "r.yaml"), ["+trainer=grpo"]).trainer.total_train_steps == 3


def test_the_quickstart_composes_like_before():
    cfg = load_recipe("recipes/quickstart.yaml")
    assert cfg.trainer.type == "self_hosted_grpo" and cfg.weight.backend == "in_process"
    assert cfg.data.seed == 7 and cfg.trainer.checkpoint_path == "runs/quickstart/checkpoints"


def test_an_empty_mapping_override_sets_a_section_back_to_its_defaults(folder):
    """`algorithm={}` is what the refusal of `~algorithm` suggests: it must clear the recipe's keys
    of the section (a mapping override merges key by key, and an empty one would change nothing)."""
    root = folder({"r.yaml": BASE + "logger: {samples_every: 7, samples_per_step: 2}\n"
                                    "runtime_monitor: {stop_timeout: 9}\n"})
    plain = load_recipe(str(root / "r.yaml"))
    assert (plain.logger.samples_every, plain.logger.samples_per_step) == (7, 2)
    cfg = load_recipe(str(root / "r.yaml"), ["logger={}"])
    folder({"no_logger.yaml": BASE + "runtime_monitor: {stop_timeout: 9}\n"})
    default = load_recipe(str(root / "no_logger.yaml"))
    assert cfg.logger == default.logger and cfg.logger.samples_every != 7  # the declared defaults
    assert cfg.runtime_monitor.stop_timeout == 9  # other sections keep the recipe's values
    with pytest.raises(ConfigError) as info:
        load_recipe(str(root / "r.yaml"), ["~algorithm"])
    assert "cannot be deleted; set it instead, e.g. algorithm={} (its defaults)" in str(info.value)
    # a later override in the same command still applies over the defaults
    assert load_recipe(str(root / "r.yaml"), ["logger={}", "logger.samples_every=5"]).logger.samples_every == 5
