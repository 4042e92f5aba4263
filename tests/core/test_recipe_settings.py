"""The core's own recipe sections as typed Settings (nexrl_core.config.schema), the whole recipe
read once per run into one RecipeSettings, and the Option tables every walker reads derived from
those classes (issue #42, step 2)."""

from __future__ import annotations

import dataclasses
import typing

import pytest

from nexrl_core import ConfigError, Settings
from nexrl_core.config import schema
from nexrl_core.config.schema import CORE_OPTIONS, RecipeSettings, WeightSettings
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.testing import make_recipe, write_recipe

SECTIONS = {"data": schema.DataSettings, "rollout_worker": schema.RolloutWorkerSettings,
            "trajectory_pool": schema.TrajectoryPoolSettings, "weight": WeightSettings, "ray": schema.RaySectionSettings}


def test_every_core_table_is_its_settings_class():
    assert CORE_OPTIONS is RecipeSettings.options()
    for key, cls in SECTIONS.items():  # each section of the root is its class's table
        assert CORE_OPTIONS[key].options is cls.options(), key
    assert CORE_OPTIONS["validate"].options["data"].options is schema.ValidateDataSettings.options()
    assert CORE_OPTIONS["service"].options["inference_service"].options is schema.InferenceServiceSettings.options()
    # removed keys stay declared as such (nexrl validate names what to do instead)
    assert schema.TrajectoryPoolSettings.options()["type"].removed and WeightSettings.options()["type"].removed
    assert CORE_OPTIONS["validate"].options["eval"].removed


def _classes(cls: type[Settings]):
    yield cls
    for hint in typing.get_type_hints(cls).values():
        for arg in (hint, *typing.get_args(hint)):
            if isinstance(arg, type) and issubclass(arg, Settings):
                yield from _classes(arg)


def test_no_field_of_the_core_settings_is_any():
    for cls in set(_classes(RecipeSettings)):
        for name, hint in typing.get_type_hints(cls).items():
            if name.isupper() or name.startswith("_"):
                continue
            assert hint is not typing.Any and "Any" not in repr(hint), f"{cls.__name__}.{name}: {hint!r}"


def _leaves(settings: Settings, path: str = ""):
    for field in dataclasses.fields(settings):
        value = getattr(settings, field.name)
        full = f"{path}.{field.name}" if path else field.name
        if isinstance(value, Settings):
            yield from _leaves(value, full)
        else:
            yield full, value


def test_the_loaded_recipe_reads_into_typed_fields_with_the_same_values(tmp_path):
    recipe = make_recipe(logger={"backend": ["tensorboard"], "tensorboard": {"flush_secs": 5}},
                         weight={"sync_mode": "batch-async", "staleness_threshold": 2},
                         trajectory_pool={"batch_size": 8, "group_size": 2})
    cfg = load_recipe(write_recipe(recipe, tmp_path / "r.yaml"))
    settings = RecipeSettings.of(cfg)
    assert settings.weight.sync_mode == "batch-async" and settings.weight.staleness_threshold == 2
    assert settings.trajectory_pool.batch_size == 8 and isinstance(settings.runtime_monitor.health_check.timeout,
                                                                   float)
    leaves = dict(_leaves(settings))
    assert len(leaves) > 60
    for dotted, value in leaves.items():  # every core key: the composed recipe's value, typed
        node = cfg
        for part in dotted.split("."):
            node = node[part]
        plain = node if not hasattr(node, "_content") else __import__("omegaconf").OmegaConf.to_container(node)
        assert value == plain, dotted
    # the keys of the components the sections select (the mock backend's mode, the sink's section)
    # are theirs: not part of the core's settings
    assert "mode" not in settings.service.inference_service.to_dict()
    assert "tensorboard" not in settings.logger.to_dict()


def test_a_bad_core_value_is_one_line_naming_its_key():
    with pytest.raises(ConfigError, match=r"^trajectory_pool.batch_size: expected a positive integer, got 0$"):
        schema.TrajectoryPoolSettings.of({"batch_size": 0}, "trajectory_pool")
    with pytest.raises(ConfigError, match=r"weight.sync_mode: 'async' is not one of sync, batch-async, fully-async"):
        WeightSettings.own({"sync_mode": "async", "backend": "in_process", "bucket_mb": 4}, "weight")
    with pytest.raises(ConfigError, match=r"^trainer.type: required"):
        RecipeSettings.of({"launch_mode": "local", "run_dir": "r"})


def test_a_run_reads_its_recipe_once_even_across_a_restart(tmp_path, monkeypatch, reset_loguru):
    """nexrl_core.run(): the prologue reads the recipe into RecipeSettings once; the controller, the
    resource manager and each restarted attempt receive that object."""
    import nexrl_core

    reads = []
    of = RecipeSettings.of.__func__

    def counting(cls, section, path=""):
        reads.append(path)
        return of(cls, section, path)

    monkeypatch.setattr(RecipeSettings, "of", classmethod(counting))
    monkeypatch.chdir(tmp_path)
    recipe = make_recipe(run_dir=str(tmp_path / "run"), trainer={"total_train_steps": 2},
                         logger={"backend": [], "progress": "off", "level": "WARNING"})
    summary = nexrl_core.run(recipe)
    assert summary.global_step == 2 and reads == [""]
