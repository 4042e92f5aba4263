"""Recipe loading, Hydra-style overrides, strict checking and the ``nexrl`` CLI's exit codes and
messages (in process through ``nexrl_core.cli.main``, plus the installed console script)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap

import pytest

from nexrl_core.cli import main
from nexrl_core.errors import ConfigError
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.testing import make_recipe

GOOD = """\
data:
  type: inline
  rows:
    - {prompt: "1 + 2", answer: "3"}
    - {prompt: "2 + 2", answer: "4"}
rollout_worker:
  num_workers: 2
trajectory_pool: {batch_size: 4, group_size: 2}
trainer: {type: mock, total_train_steps: 2}
service:
  inference_service: {backend: mock, mode: sum}
"""


@pytest.fixture
def recipe(tmp_path):
    def write(text: str = GOOD, name: str = "recipe.yaml"):
        path = tmp_path / name
        path.write_text(textwrap.dedent(text))
        return str(path)
    return write


@pytest.fixture
def cli(core_pm, capfd, reset_loguru):
    """``cli(*argv)`` -> (exit code, stdout, stderr), run in process with core-only plugins."""
    def call(*argv: str):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


# ----------------------------------------------------------------------------- overrides


def test_overrides_set_add_and_delete(recipe):
    path = recipe()
    cfg = load_recipe(path, ["trainer.total_train_steps=7", "+trainer.step_time_s=0.5", "~data.rows",
                             "~trainer.checkpoint_path", "logger.backend=[console]",
                             "rollout_worker.evaluator.type=numeric_answer",
                             "+rollout_worker.evaluator.format_reward=0.1", "trajectory_pool.key_list=[uid,data_source]"])
    assert cfg.trainer.total_train_steps == 7
    assert cfg.trainer.step_time_s == 0.5
    assert "rows" not in cfg.data  # a component's key: gone
    assert cfg.trainer.checkpoint_path is None  # a core key that may be null: null (no checkpoints)
    assert list(cfg.logger.backend) == ["console"]
    assert cfg.rollout_worker.evaluator.type == "numeric_answer"
    assert cfg.rollout_worker.evaluator.format_reward == 0.1
    assert list(cfg.trajectory_pool.key_list) == ["uid", "data_source"]
    # untouched recipe and default values survive
    assert cfg.trajectory_pool.batch_size == 4
    assert cfg.weight.sync_mode == "sync"
    # interpolations of the defaults follow the overridden values
    cfg = load_recipe(path, ["run_dir=/tmp/somewhere"])
    assert cfg.trainer.checkpoint_path == "/tmp/somewhere/checkpoints"


def test_deleting_a_key_the_recipe_set_restores_its_default(cli, recipe):
    # Hydra's ~key: the recipe's value is gone, so the declared default applies (not null)
    path = recipe(GOOD + "weight: {rollout_limit: 4, served_probe_tolerance: 0.01}\n")
    cfg = load_recipe(path, ["~weight.rollout_limit", "~weight.served_probe_tolerance"])
    assert cfg.weight.rollout_limit == "batch" and cfg.weight.served_probe_tolerance == 1e-3
    # the case it is for: an async run of a sync recipe, its sync-only key deleted, validates clean
    code, _, err = cli("validate", path, "weight.sync_mode=fully-async")
    assert code == 2 and "weight.rollout_limit: does nothing without weight.sync_mode: sync" in err
    code, _, err = cli("validate", path, "weight.sync_mode=fully-async", "~weight.rollout_limit")
    assert code == 0, err
    assert "rollout_limit" not in err
    # a key that holds its default already and may be null is switched off, as before
    assert load_recipe(path, ["~weight.rollout_limit", "~weight.rollout_limit"]).weight.rollout_limit is None
    assert load_recipe(path, ["~trainer.checkpoint_path"]).trainer.checkpoint_path is None


@pytest.mark.parametrize("override, expected", [
    ("trainer.no_such_key=0.5", "override 'trainer.no_such_key=0.5': key 'trainer.no_such_key' does not exist; "
                                "use '+trainer.no_such_key=0.5' to add a new key under trainer"),
    ("trainer.total_train_step=3", "key 'trainer.total_train_step' does not exist (did you mean "
                                   "'trainer.total_train_steps'?)"),
    ("~trainer.no_such_key", "override '~trainer.no_such_key': key 'trainer.no_such_key' does not exist"),
    ("trainer.type=[", "override 'trainer.type=[':"),
])
def test_bad_overrides_are_config_errors_naming_the_key(recipe, override, expected):
    with pytest.raises(ConfigError) as info:
        load_recipe(recipe(), [override])
    assert expected in str(info.value)


def test_recipe_without_overrides_keeps_recipe_values(recipe):
    cfg = load_recipe(recipe())
    assert cfg.trainer.total_train_steps == 2
    assert cfg.service.inference_service.mode == "sum"
    assert cfg.recipe_dir == os.path.dirname(recipe())


# ----------------------------------------------------------------------------- validate


def test_validate_good_recipe_exits_0(cli, recipe):
    code, out, err = cli("validate", recipe())
    assert code == 0, err
    assert out.strip().endswith(": ok")
    assert "Traceback" not in err


def test_validate_with_overrides(cli, recipe):
    code, _, err = cli("validate", recipe(), "trajectory_pool.batch_size=5")
    assert code == 2
    assert "trajectory_pool.batch_size (5) must be a multiple of trajectory_pool.group_size (2)" in err
    code, _, err = cli("validate", recipe(), "trajectory_pool.batch_size=8")
    assert code == 0, err


BAD = """\
trianer: {}
data:
  type: inline
  rows: [{prompt: "1 + 1", answer: "2"}]
rollout_worker: {num_workers: four}
trajectory_pool: {batch_size: 6, group_size: 4, chek_batch_ready_function: batch_size}
trainer: {type: mokc}
weight: {validate_frq: 2}
logger: {level: 3}
service: {inference_service: {backend: mock}}
"""


def test_validate_prints_every_problem_with_exit_2(cli, recipe):
    code, out, err = cli("validate", recipe(BAD))
    assert code == 2
    assert out == ""
    lines = [line for line in err.splitlines() if line.strip()]
    expected = [
        "error: trianer: unknown key; did you mean 'trainer'?",
        "error: trajectory_pool.chek_batch_ready_function: unknown key; did you mean "
        "'trajectory_pool.check_batch_ready_function'?",
        "error: weight.validate_frq: unknown key; did you mean 'weight.validate_freq'?",
        "error: logger.level: expected a string, got an integer (3)",
        "error: trajectory_pool.batch_size (6) must be a multiple of trajectory_pool.group_size (4) so groups are "
        "never split across batches",
        "error: rollout_worker.num_workers: expected an integer, got a string ('four')",
    ]
    for line in expected:
        assert line in lines, f"missing {line!r} in:\n{err}"
    unknown = [line for line in lines if line.startswith("error: trainer.type: unknown trainer 'mokc'")]
    assert len(unknown) == 1 and "Did you mean 'mock'?" in unknown[0] and "'mock' (nexrl-core)" in unknown[0]
    assert len(lines) == len(expected) + 1 and all(line.startswith("error: ") for line in lines)
    assert "Traceback" not in err


KEY_PROBLEMS = [
    ("trainer: {totl_train_steps: 3}\n",
     "trainer.totl_train_steps: unknown key; did you mean 'trainer.total_train_steps'?"),
    ("trajectory_pool: {batch_size: sixteen}\n",
     "trajectory_pool.batch_size: expected an integer, got a string ('sixteen')"),
    ("weight: {sync_mode: [sync]}\n", "weight.sync_mode: expected a string, got a list"),
    ("validate: {validate_before_train: 'yes'}\n",
     "validate.validate_before_train: expected a boolean, got a string ('yes')"),
    ("runtime_monitor: {health_check: {timeout: soon}}\n",
     "runtime_monitor.health_check.timeout: expected a number, got a string ('soon')"),
    ("service: {inference_service: {backend: mokc}}\n",
     "service.inference_service.backend: unknown inference backend 'mokc'. Did you mean 'mock'? Available: "
     "'mock' (nexrl-core), 'openai' (nexrl-core)."),
    ("service: {inference_service: {backend: mock, mdoe: sum}}\n",
     "service.inference_service.mdoe: unknown key; did you mean 'service.inference_service.mode'?"),
    ("weight: {backend: nccl}\n", "weight.backend: unknown weight sync backend 'nccl'."),
    ("rollout_worker: {evaluator: {type: exact_match, answer_kye: x}}\n",
     "rollout_worker.evaluator.answer_kye: unknown key; did you mean 'rollout_worker.evaluator.answer_key'? "
     "(evaluator 'exact_match' accepts: answer_key, case_sensitive, extract_pattern)"),
    ("rollout_worker: {sampling: {max_token: 8}}\n",
     "rollout_worker.sampling.max_token: unknown key; did you mean 'rollout_worker.sampling.max_tokens'?"),
    ("rollout_worker: {sampling: {temprature: 0.7}}\n",
     "rollout_worker.sampling.temprature: unknown key; did you mean 'rollout_worker.sampling.temperature'?"),
    ("rollout_worker: {sampling: {stop: ['a', 3]}}\n",
     "rollout_worker.sampling.stop: expected a list of strings, got a list"),
    ("rollout_worker: {reward_range: [1, 0]}\n",
     "rollout_worker.reward_range: expected [low, high] with low <= high, got [1, 0]"),
    ("rollout_worker: {validate_temperature: -1}\n",
     "rollout_worker.validate_temperature: expected a non-negative number, got -1"),
    ("rollout_worker: {answer_key: x}\n", "rollout_worker.answer_key: unknown key"),
    ("rollout_worker: {evaluator: {type: numeric_answer, tolerance: -0.1}}\n",
     "rollout_worker.evaluator.tolerance: expected a non-negative number, got -0.1"),
    ("rollout_worker: {evaluator: {type: exact_match, case_sensitive: maybe}}\n",
     "rollout_worker.evaluator.case_sensitive: expected a boolean, got a string ('maybe')"),
    ("validate: {data: {type: arithmetic, num_rows: 0}}\n",
     "validate.data.num_rows: expected a positive integer, got 0"),
    ("validate: {data: {type: arithmetic, min_value: 5, max_value: 2}}\n",
     "validate.data.max_value: 2 is below min_value 5"),
    ("validate: {data: {type: arithmetic, split: test}}\n",
     "validate.data.split: 'test' is not one of train, validation"),
    ("validate: {data: {type: arithmetic, shuffle: true}}\n", "validate.data.shuffle: unknown key"),
    ("validate: {data: {type: inline, rows: [a, b]}}\n", "validate.data.rows: expected a list of mappings, got a list"),
    ("validate: {data: {type: inline}}\n", "validate.data.rows: required"),
    ("service: {inference_service: {backend: mock, mode: summ}}\n",
     "service.inference_service.mode: 'summ' is not one of echo, sum; did you mean 'sum'?"),
    ("service: {inference_service: {backend: openai}}\n",
     "service.inference_service.url: required (the server's OpenAI base URL"),
    ("service: {inference_service: {backend: openai, url: 'http://x/v1', timeout: 0}}\n",
     "service.inference_service.timeout: expected a positive number, got 0"),
    ("service: {train_service: {backend: local_torch}}\n",
     "service.train_service.backend: unknown key"),
    ("weight: {rollout_limit: some}\n", "weight.rollout_limit: expected null, 'batch' or a positive integer, got 'some'"),
    ("weight: {sync_mode: async}\n", "weight.sync_mode: 'async' is not one of sync, batch-async, fully-async"),
    ("runtime_monitor: {failed_samples: {max_fraction: 1.5}}\n",
     "runtime_monitor.failed_samples.max_fraction: expected a number >= 0 and <= 1, got 1.5"),
    ("runtime_monitor: {health_check: {timeout: .inf}}\n",
     "runtime_monitor.health_check.timeout: expected a finite number, got inf"),
    ("trainer: {checkpoint_path: '???'}\n", "trainer.checkpoint_path: a value is required here (the recipe has '???')"),
    ("logger: {backend: [console, tensorbord]}\n", "logger.backend: unknown metrics sink 'tensorbord'"),
    ("logger: {backend: [console], wandb: {mode: offline}}\n", "logger.wandb: unknown key"),
    ("logger: {backend: [wandb], wandb: {mode: onlin}}\n",
     "logger.wandb.mode: 'onlin' is not one of online, offline, disabled; did you mean 'online'?"),
    # (a mapping with type replaces GOOD's: batch and group given again)
    ("trajectory_pool: {type: default, batch_size: 4, group_size: 2}\n", "trajectory_pool.type: no longer a recipe key"),
    ("validate: {data: {type: inline, rows: [{prompt: a}], seed: 3}}\n", "validate.data.seed: unknown key"),
    ("overwrite_run_dir: true\nresume: {mode: auto}\n",
     "overwrite_run_dir: applies to a fresh run only (resume.mode: disable)"),
    ("seed: 1.5\n", "seed: expected an integer, got a number (1.5)"),
    ("launch_mode: cluster\n", "launch_mode: 'cluster' is not one of local"),
    ("resume: {mode: from_path}\n", "resume.resume_path: required when resume.mode is 'from_path'"),
    ("trajectory_pool: {batch_size: 0}\n", "trajectory_pool.batch_size: expected a positive integer, got 0"),
    ("trajectory_pool: {group_size: 2, key_list: []}\n",
     "trajectory_pool.key_list: groups of more than one trajectory need a grouping key"),
    ("service: {reward_service: {}}\n", "service.reward_service: unknown key"),
]


@pytest.mark.parametrize("text, expected", KEY_PROBLEMS, ids=[e.split(":")[0] for _, e in KEY_PROBLEMS])
def test_each_problem_names_its_key(core_pm, recipe, text, expected):
    path = recipe(_merge(GOOD, text))
    problems = check_config(load_recipe(path), core_pm)
    assert any(expected in p for p in problems), problems


def _merge(base: str, extra: str) -> str:
    """Recipe text with ``extra``'s sections merged over ``base``'s as the kit merges them (YAML keeps
    one copy of a key)."""
    import yaml

    return yaml.safe_dump(make_recipe(yaml.safe_load(base), **yaml.safe_load(extra)))


def test_good_recipe_has_no_problems(core_pm, recipe):
    assert check_config(load_recipe(recipe()), core_pm) == []


def test_float_seconds_are_accepted_for_monitor_intervals(core_pm, recipe):
    path = recipe(GOOD + "runtime_monitor: {stop_timeout: 2.5, health_check: {check_interval: 0.5, "
                         "grace_period: 1.5}}\n")
    assert check_config(load_recipe(path), core_pm) == []


def test_validate_missing_recipe_and_malformed_yaml(cli, recipe, tmp_path):
    code, _, err = cli("validate", str(tmp_path / "nope.yaml"))
    assert code == 2 and "nope.yaml: recipe file not found" in err
    path = recipe("trainer:\n  total_train_steps: 3\n   bad_indent: 1\n")
    code, _, err = cli("validate", path)
    assert code == 2
    assert f"{path}:3: not valid YAML" in err
    assert "Traceback" not in err


def test_run_refuses_a_bad_recipe_with_exit_2_and_no_traceback(cli, recipe, tmp_path):
    code, out, err = cli("run", recipe(), "trajectory_pool.group_size=3", f"run_dir={tmp_path / 'run'}")
    assert code == 2
    assert "error: trajectory_pool.batch_size (4) must be a multiple of trajectory_pool.group_size (3)" in err
    assert "Traceback" not in err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_run_good_recipe_in_process(cli, recipe, tmp_path):
    code, out, err = cli("run", recipe(), f"run_dir={tmp_path / 'run'}",
                         "runtime_monitor.health_check.check_interval=0.5")
    assert code == 0, err
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["global_step"] == 2 and summary["stopped_by"] == "finished"
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert "Traceback" not in err


def _nexrl() -> list[str]:
    exe = shutil.which("nexrl", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "nexrl_core.cli"]


def test_console_script_validate_exit_codes(recipe):
    """The installed ``nexrl`` script (exit 0 on a good recipe is checked in process above)."""
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": ""}
    bad = subprocess.run(_nexrl() + ["validate", recipe(BAD, "bad.yaml"), "trainer.total_train_steps=0"],
                         capture_output=True, text=True, env=env, timeout=60)
    assert bad.returncode == 2
    lines = bad.stderr.splitlines()
    assert "error: weight.validate_frq: unknown key; did you mean 'weight.validate_freq'?" in lines
    assert "error: trainer.total_train_steps: expected a positive integer, got 0" in lines
    assert "Traceback" not in bad.stderr
