"""Keys that act only together with another (issue #29 item 4, docs/reliability.md): set alone, each
is one `error:` line naming the key it needs, the same from `nexrl validate` and `nexrl run` (exit 2,
nothing written); with the key it needs, the recipe is accepted. A recipe must name its trainer and
inference backend: the mock stand-ins are never chosen by default.
"""

from __future__ import annotations

import pytest
import yaml

from nexrl_core import Option, hookimpl
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.cli import main
from nexrl_core.config.options import unmet_needs
from nexrl_core.testing import use_plugins

RECIPE = {
    "data": {"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "2 + 2", "answer": "4"}]},
    "rollout_worker": {"num_workers": 1, "evaluator": {"type": "numeric_answer"}},
    "trajectory_pool": {"batch_size": 2, "group_size": 2},
    "trainer": {"type": "mock", "total_train_steps": 1},
    "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
    "logger": {"level": "WARNING"},
}
VAL = "validate.data={type: inline, rows: [{prompt: '1 + 1', answer: '2'}]}"


class DecayTrainer(MockTrainer):
    """A plugin's trainer whose own options use ``needs`` (relative keys, a comparison)."""

    OPTIONS = {
        "schedule": Option("constant", str, "constant | linear", choices=("constant", "linear")),
        "decay_steps": Option(None, int, "where the decay ends", ge=1, needs=".schedule != constant"),
    }


DecayTrainer.CAPABILITIES = MockTrainer.CAPABILITIES


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"decay": DecayTrainer}


# name -> (overrides, the error line); the same keys with what they need come in ACCEPTED
CASES = {
    "remove_previous_ckpt_without_saves": (
        ["trainer.remove_previous_ckpt=true", "trainer.save_final=false"],
        "error: trainer.remove_previous_ckpt: does nothing without trainer.save_freq > 0 or trainer.save_final: "
        "true or trainer.save_on_stop: true (set that, or delete trainer.remove_previous_ckpt)"),
    "success_threshold_without_validation": (
        ["validate.success_threshold=0.5"],
        "error: validate.success_threshold: does nothing without validate.data: true"),
    "n_samples_without_validation": (
        ["validate.n_samples=4"], "error: validate.n_samples: does nothing without validate.data: true"),
    "validate_temperature_without_validation": (
        ["rollout_worker.validate_temperature=0.0"],
        "error: rollout_worker.validate_temperature: does nothing without validate.data: true"),
    "staleness_in_sync_mode": (
        ["weight.staleness_threshold=2"],
        "error: weight.staleness_threshold: does nothing without weight.sync_mode other than sync"),
    "rollout_limit_in_async_mode": (
        ["weight.sync_mode=fully-async", "weight.staleness_threshold=1", "weight.rollout_limit=8"],
        "error: weight.rollout_limit: does nothing without weight.sync_mode: sync"),
    "max_replacements_without_dynamic_sampling": (
        ["trajectory_pool.dynamic_sampling.max_replacements=5"],
        "error: trajectory_pool.dynamic_sampling.max_replacements: does nothing without "
        "trajectory_pool.dynamic_sampling.enabled: true"),
    "resume_path_without_from_path": (
        ["resume.resume_path=/nowhere"], "error: resume.resume_path: does nothing without resume.mode: from_path"),
    "samples_per_step_without_samples": (
        ["logger.samples_every=0", "logger.samples_per_step=2"],
        "error: logger.samples_per_step: does nothing without logger.samples_every > 0"),
    "health_check_keys_when_disabled": (
        ["runtime_monitor.health_check.enabled=false", "runtime_monitor.health_check.timeout=2"],
        "error: runtime_monitor.health_check.timeout: does nothing without runtime_monitor.health_check.enabled: "
        "true"),
    "policy_when_exception_handling_disabled": (
        ["runtime_monitor.exception_handling.enabled=false", "runtime_monitor.exception_handling.policy=continue"],
        "error: runtime_monitor.exception_handling.policy: does nothing without "
        "runtime_monitor.exception_handling.enabled: true"),
    "window_when_failed_samples_disabled": (
        ["runtime_monitor.failed_samples.enabled=false", "runtime_monitor.failed_samples.window=8"],
        "error: runtime_monitor.failed_samples.window: does nothing without runtime_monitor.failed_samples.enabled: "
        "true"),
    "restart_keys_without_restart": (
        ["resume.max_restarts=5"], "error: resume.max_restarts: does nothing without resume.on_failure: restart"),
    "mock_learn_steps_in_echo_mode": (
        ["service.inference_service.mode=echo", "+service.inference_service.learn_steps=3"],
        "error: service.inference_service.learn_steps: does nothing without service.inference_service.mode: sum"),
    "a_plugins_own_option": (
        ["trainer.type=decay", "+trainer.decay_steps=10"],
        "error: trainer.decay_steps: does nothing without trainer.schedule other than constant"),
}

ACCEPTED = {
    "remove_previous_ckpt_without_saves": ["trainer.remove_previous_ckpt=true", "trainer.save_final=false",
                                           "trainer.save_freq=1"],
    "success_threshold_without_validation": ["validate.success_threshold=0.5", "validate.n_samples=2", VAL],
    "staleness_in_sync_mode": ["weight.staleness_threshold=2", "weight.sync_mode=batch-async"],
    "max_replacements_without_dynamic_sampling": ["trajectory_pool.dynamic_sampling.max_replacements=5",
                                                  "trajectory_pool.dynamic_sampling.enabled=true"],
    "samples_per_step_without_samples": ["logger.samples_every=1", "logger.samples_per_step=2"],
    "health_check_keys_when_disabled": ["runtime_monitor.health_check.timeout=2"],
    "restart_keys_without_restart": ["resume.on_failure=restart", "resume.max_restarts=5"],
    "a_plugins_own_option": ["trainer.type=decay", "+trainer.decay_steps=10", "+trainer.schedule=linear"],
    # a key set to its default does nothing either way, and is accepted
    "defaults_alone": ["trainer.remove_previous_ckpt=false", "validate.success_threshold=1.0"],
}


@pytest.fixture
def nexrl(tmp_path, capfd, reset_loguru, monkeypatch):
    """``nexrl(*argv)`` -> (exit code, error lines, stderr), with this file's plugin registered."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE}))

    def call(*argv: str):
        with use_plugins(Plugin()):
            code = main([str(a) for a in argv])
        _, err = capfd.readouterr()
        return code, [line for line in err.splitlines() if line.startswith("error: ")], err
    return call


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_key_set_without_the_key_it_needs_is_one_line_from_validate_and_run(name, nexrl, tmp_path):
    overrides, expected = CASES[name]
    results = {command: nexrl(command, "recipe.yaml", *overrides) for command in ("validate", "run")}
    for command, (code, errors, err) in results.items():
        assert code == 2, f"{command}: {err}"
        assert any(line.startswith(expected) for line in errors), f"{command}: {expected!r} not in {errors}"
        assert "Traceback" not in err
    assert results["run"][1] == results["validate"][1]
    assert not (tmp_path / "run").exists()  # refused before anything was written


@pytest.mark.parametrize("name", sorted(ACCEPTED))
def test_with_the_key_it_needs_the_recipe_is_accepted(name, nexrl):
    code, errors, err = nexrl("validate", "recipe.yaml", *ACCEPTED[name])
    assert code == 0 and not errors, err


def test_a_recipe_without_a_trainer_is_refused_not_run_on_the_mock(nexrl, tmp_path):
    """Before, a recipe with no trainer section got the mock trainer and 'finished' having trained nothing."""
    path = tmp_path / "bare.yaml"
    bare = {k: v for k, v in RECIPE.items() if k not in ("trainer", "service")}
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **bare}))
    code, errors, err = nexrl("run", str(path))
    assert code == 2, err
    assert [e.split(" (")[0] for e in errors] == ["error: trainer.type: required",
                                                  "error: service.inference_service.backend: required"]
    assert "mock: a stand-in that trains nothing" in err
    assert not (tmp_path / "run").exists()
    code, _, err = nexrl("run", str(path), "+trainer.type=mock", "+service.inference_service.backend=mock")
    assert code == 0, err  # asked for by name, the mock runs


def test_nexrl_eval_needs_no_trainer(nexrl, tmp_path):
    path = tmp_path / "eval.yaml"
    bare = {k: v for k, v in RECIPE.items() if k != "trainer"}
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **bare}))
    code, errors, err = nexrl("eval", str(path), VAL, "--out", str(tmp_path / "eval"))
    assert code == 0 and not errors, err


def test_the_conditions_of_needs():
    """The grammar: a truthy key, ==, !=, >, ``or`` alternatives, a tuple that must all hold,
    ``.key`` of the same mapping (its declared default when omitted), and a whole section."""
    options = {
        "on": Option(False, bool),
        "mode": Option("a", str),
        "n": Option(0, int),
        "x": Option(1, int, needs="root.on"),
        "y": Option(1, int, needs=".mode == b"),
        "z": Option(1, int, needs=(".mode != a", ".n > 2 or root.on")),
        "section": Option(options={"k": Option(1, int)}, needs=".mode == c"),
    }
    root = {"root": {"on": False}}
    assert unmet_needs({"x": 1, "y": 1, "z": 1, "section": {"k": 1}}, options, "s", root) == []  # defaults
    problems = unmet_needs({"x": 2, "y": 2, "z": 2, "section": {"k": 2}}, options, "s", root)
    assert problems == [
        "s.x: does nothing without root.on: true (set that, or delete s.x)",
        "s.y: does nothing without s.mode: b (set that, or delete s.y)",
        "s.z: does nothing without s.mode other than a (set that, or delete s.z)",
        "s.section: does nothing without s.mode: c (set that, or delete s.section)",
    ]
    assert unmet_needs({"mode": "b", "z": 2}, options, "s", root) == [
        "s.z: does nothing without s.n > 2 or root.on: true (set that, or delete s.z)"]
    assert unmet_needs({"mode": "b", "n": 3, "y": 2, "z": 2}, options, "s", root) == []
    assert unmet_needs({"mode": "b", "z": 2}, options, "s", {"root": {"on": True}}) == []


def test_every_needs_names_a_declared_key():
    """A typo in a declaration would make its key always (or never) refused."""
    from nexrl_core.config.schema import CORE_OPTIONS

    def walk(options, path):
        for key, opt in (options or {}).items():
            for need in (opt.needs,) if isinstance(opt.needs, str) else opt.needs or ():
                for alt in need.split(" or "):
                    yield f"{path}{key}", alt.strip().split(" ")[0], options
            yield from walk(opt.options, f"{path}{key}.")

    found = list(walk(CORE_OPTIONS, ""))
    assert len(found) >= 15
    for key, target, options in found:
        if target.startswith("."):
            assert target[1:] in options, f"{key}: needs {target}, not a key of its mapping"
            continue
        node = CORE_OPTIONS
        for part in target.split("."):
            assert node is not None and part in node, f"{key}: needs {target}, not a core key"
            node = node[part].options
