"""The bad-input corpus (tests/bad_inputs/): every broken recipe, data file and plugin gives a
message that names the key or ``file:line``, the documented exit code, and never a traceback.

Layout (paths in the recipes are relative to tests/bad_inputs/, the working directory here):
- ``recipes/``: one defect per file (``good.yaml`` is the baseline they break);
- ``data/``: the data files the recipes point at;
- ``plugins/<case>/``: installed-style plugin distributions (``*.dist-info`` + module), put on
  the path only by the tests that want them.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from nexrl_core.cli import main
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager

CORPUS = Path(__file__).resolve().parents[1] / "bad_inputs"
RECIPES = CORPUS / "recipes"



@dataclass(frozen=True)
class Case:
    """A bad input: ``recipe`` (under recipes/) with ``overrides``; both ``nexrl validate`` and
    ``nexrl run`` must exit 2 and print every text of ``expected`` (``run_dir`` is set to a fresh
    folder unless ``own_run_dir``)."""

    expected: tuple[str, ...]
    recipe: str = ""
    overrides: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    own_run_dir: bool = False


def case(*expected: str, recipe: str = "", overrides: tuple[str, ...] = (), load: str | None = None,
         own_run_dir: bool = False) -> Case:
    env = (("NEXRL_LOAD_PLUGINS", load),) if load is not None else ()
    return Case(tuple(expected), recipe, overrides, env, own_run_dir)


GOOD = "good"
CASES: dict[str, Case] = {
    # the recipe file
    "malformed_yaml": case("error: recipes/malformed_yaml.yaml:7: not valid YAML (mapping values are not allowed "
                           "here)"),
    "unclosed_quote": case("error: recipes/unclosed_quote.yaml:5: not valid YAML (a quoted string opens here, "
                           "column 15, and is never closed)"),
    "duplicate_section": case("error: recipes/duplicate_section.yaml:10: duplicate key 'trainer' (first on line 5)"),
    "not_a_mapping": case("error: recipes/not_a_mapping.yaml: a recipe must be a mapping of keys, got list"),
    "empty_recipe": case("error: recipes/empty_recipe.yaml: the recipe is empty"),
    "missing_recipe": case("error: recipes/no_such_recipe.yaml: recipe file not found", recipe="no_such_recipe"),
    "bad_interpolation": case("error: trainer.total_train_steps: cannot resolve interpolation (Interpolation key "
                              "'trainer.steps' not found)"),
    # keys
    "unknown_top_level_key": case("error: trainner: unknown key; did you mean 'trainer'?"),
    "typo_trainer_key": case("error: trainer.total_train_step: unknown key; did you mean "
                             "'trainer.total_train_steps'?"),
    "typo_pool_key": case("error: trajectory_pool.groupsize: unknown key; did you mean 'trajectory_pool.group_size'?"),
    "typo_weight_key": case("error: weight.validate_frequency: unknown key; did you mean 'weight.validate_freq'?"),
    "sampling_typos": case("error: rollout_worker.sampling.max_token: unknown key; did you mean "
                           "'rollout_worker.sampling.max_tokens'?",
                           "error: rollout_worker.sampling.temprature: unknown key; did you mean "
                           "'rollout_worker.sampling.temperature'?"),
    "ignored_selector_keys": case("error: trajectory_pool.type: no longer a recipe key: nexrl has one trajectory pool",
                                  "error: weight.type: no longer a recipe key: the weight-sync backend is chosen "
                                  "with weight.backend",
                                  "error: validate.eval: no longer a recipe key"),
    "list_for_mapping": case("error: trajectory_pool: expected a mapping, got a list"),
    "string_for_section": case("error: trainer: expected a mapping, got a string ('mock'); to choose a trainer "
                               "write trainer: {type: mock}"),
    # values
    "wrong_type": case("error: trajectory_pool.batch_size: expected an integer, got a string ('four')"),
    "wrong_type_bool": case("error: validate.validate_before_train: expected a boolean, got a string ('sometimes')"),
    "unknown_log_level": case("error: logger.level: 'info' is not one of TRACE, DEBUG, INFO, SUCCESS, WARNING, "
                              "ERROR, CRITICAL; did you mean 'INFO'?", recipe=GOOD, overrides=("logger.level=info",)),
    "negative_temperature": case("error: rollout_worker.sampling.temperature: expected a non-negative number, got "
                                 "-0.5", recipe=GOOD, overrides=("+rollout_worker.sampling.temperature=-0.5",)),
    "top_p_above_1": case("error: rollout_worker.sampling.top_p: expected a number > 0 and <= 1, got 1.5",
                          recipe=GOOD, overrides=("+rollout_worker.sampling.top_p=1.5",)),
    "max_tokens_zero": case("error: rollout_worker.sampling.max_tokens: expected a positive integer, got 0",
                            recipe=GOOD, overrides=("+rollout_worker.sampling.max_tokens=0",)),
    "nan_timeout": case("error: runtime_monitor.stop_timeout: expected a finite number, got nan", recipe=GOOD,
                        overrides=("runtime_monitor.stop_timeout=nan",)),
    "negative_save_freq": case("error: trainer.save_freq: expected a non-negative integer, got -1", recipe=GOOD,
                               overrides=("trainer.save_freq=-1",)),
    "zero_validation_samples": case("error: validate.n_samples: expected a positive integer, got 0", recipe=GOOD,
                                    overrides=("validate.n_samples=0",)),
    "zero_steps": case("error: trainer.total_train_steps: expected a positive integer, got 0", recipe=GOOD,
                       overrides=("trainer.total_train_steps=0",)),
    "evaluator_bad_option": case("error: rollout_worker.evaluator.extract: 'middle' is not one of first, last",
                                 recipe=GOOD, overrides=("rollout_worker.evaluator.type=numeric_answer",
                                                         "+rollout_worker.evaluator.extract=middle")),
    "evaluator_unknown_option": case("error: rollout_worker.evaluator.answer_kye: unknown key; did you mean "
                                     "'rollout_worker.evaluator.answer_key'?", recipe=GOOD,
                                     overrides=("+rollout_worker.evaluator.answer_kye=x",)),
    # launch_mode: ray (checked whether or not Ray is installed, and before any cluster starts)
    "ray_negative_call_timeout": case("error: ray.call_timeout: expected a positive number, got -1", recipe=GOOD,
                                      overrides=("launch_mode=ray", "ray.call_timeout=-1")),
    "ray_typo_resource": case("error: ray.resources.trainer.num_gpu: unknown key; did you mean "
                              "'ray.resources.trainer.num_gpus'?", recipe=GOOD,
                              overrides=("launch_mode=ray", "+ray.resources.trainer.num_gpu=1")),
    "ray_workers_in_the_control_actor": case("error: ray.colocation: rollout workers spread over "
                                             "rollout_worker.num_actors actors of their own; group 'control' also "
                                             "names activity_tracker", recipe=GOOD,
                                             overrides=("launch_mode=ray", "ray.colocation.rollout_worker=control")),
    "more_worker_actors_than_workers": case("error: rollout_worker.num_actors (3) exceeds rollout_worker.num_workers "
                                            "(2): every actor hosts at least one worker", recipe=GOOD,
                                            overrides=("launch_mode=ray", "rollout_worker.num_actors=3")),
    "zero_tasks_per_call": case("error: rollout_worker.tasks_per_call: expected a positive integer, got 0",
                                recipe=GOOD, overrides=("rollout_worker.tasks_per_call=0",)),
    # overrides
    "group_override_without_group": case("error: override 'trainer=grpo': 'trainer' is a section, not a value, and "
                                         "there is no config group 'trainer'", "e.g. trainer.type=grpo",
                                         recipe=GOOD, overrides=("trainer=grpo",)),
    "group_override_unknown_option": case("error: override '+weight=fast': config group 'weight' has no option "
                                          "'fast' (available: batch_async, fully_async, sync)", recipe=GOOD,
                                          overrides=("+weight=fast",)),
    # a key the recipe leaves at its default (one it sets is deleted as Hydra deletes: its default applies)
    "delete_a_needed_key": case("error: override '~trainer.save_freq': trainer.save_freq is needed by every run",
                                "set it instead, e.g. trainer.save_freq=0", recipe=GOOD,
                                overrides=("~trainer.save_freq",)),
    "delete_a_needed_section": case("error: override '~trajectory_pool': trajectory_pool is needed by every run",
                                    recipe=GOOD, overrides=("~trajectory_pool",)),
    "override_missing_key": case("error: override 'trainer.save_frequency=2': key 'trainer.save_frequency' does not "
                                 "exist (did you mean 'trainer.save_freq'?)", recipe=GOOD,
                                 overrides=("trainer.save_frequency=2",)),
    # components
    "unknown_trainer": case("error: trainer.type: unknown trainer 'self_hosted_grop'.",
                            "Available: 'mock' (nexrl-core)"),
    "unknown_evaluator": case("error: rollout_worker.evaluator.type: unknown evaluator 'exact_matchh'. Did you mean "
                              "'exact_match'?", "'numeric_answer' (nexrl-core)"),
    "unknown_backend_with_its_keys": case("error: service.inference_service.backend: unknown inference backend "
                                          "'vlm'.", recipe=GOOD,
                                          overrides=("service.inference_service.backend=vlm",
                                                     "+service.inference_service.gpu_memory_utilization=0.5",
                                                     "+service.inference_service.tensor_parallel_size=2")),
    "unknown_weight_backend_with_its_keys": case("error: weight.backend: unknown weight sync backend 'nccl'",
                                                 recipe=GOOD, overrides=("weight.backend=nccl",
                                                                         "+weight.bucket_size_mb=64")),
    "missing_plugin_named_in_filter": case("error: trainer.type: unknown trainer 'self_hosted_grpo'.",
                                           "NEXRL_LOAD_PLUGINS=nexrl-grop restricts plugin loading; it names "
                                           "'nexrl-grop', which no installed plugin has", recipe=GOOD,
                                           overrides=("trainer.type=self_hosted_grpo",), load="nexrl-grop"),
    # cross-key rules
    "batch_not_divisible": case("error: trajectory_pool.batch_size (6) must be a multiple of "
                                "trajectory_pool.group_size (4)"),
    "resume_from_path_without_path": case("error: resume.resume_path: required when resume.mode is 'from_path'"),
    "validation_without_data": case("error: validate.validate_before_train: validation is requested but "
                                    "validate.data is not set"),
    "validate_freq_without_data": case("error: weight.validate_freq: validation every 2 steps is requested but "
                                       "validate.data is not set", recipe=GOOD, overrides=("weight.validate_freq=2",)),
    # files
    "missing_data_file": case("error: data.path: 'data/no_such_file.jsonl': data file not found"),
    "missing_val_file": case("error: validate.data.path: 'data/no_such_val.jsonl': data file not found"),
    "misspelled_data_file": case("error: data.path: 'data/mixd.jsonl': data file not found; did you mean "
                                 "'data/mixed.jsonl'?", recipe="missing_data_file", overrides=("data.path=data/mixd.jsonl",)),
    "data_without_path": case("error: data.path: required (a JSONL or Parquet file, or a list of them)"),
    "empty_data_file": case("error: data/empty.jsonl: the file holds no rows"),
    "blank_data_file": case("error: data/blank_lines.jsonl: the file holds no rows"),
    "bad_json_line": case("error: data/bad_json.jsonl:3: not valid JSON"),
    "json_not_object": case("error: data/not_an_object.jsonl:2: each line must be a JSON object, got list"),
    "missing_prompt": case("error: data/missing_prompt.jsonl:3: the row has no 'prompt' field"),
    "empty_prompt": case("error: data/empty_prompt.jsonl:2: the row has no 'prompt' field"),
    "not_parquet": case("error: data/not_parquet.parquet: not a readable Parquet file"),
    "binary_data_file": case("error: data/binary.jsonl:2: binary data (a NUL byte), not JSON lines"),
    "not_utf8_data_file": case("error: data/latin1.jsonl:2: not UTF-8 text (byte 0xe9 at column 16)"),
    "data_is_directory": case("error: data: is a folder, not a data file"),
    "run_dir_is_file": case("error: run_dir: 'data/train.jsonl' is a file, not a folder", own_run_dir=True),
    "run_dir_under_a_file": case("error: run_dir: cannot create 'data/train.jsonl/run': ", "data/train.jsonl' is a "
                                 "file", own_run_dir=True),
    # output paths that cannot be written: one line naming the key, before anything is built
    "run_dir_under_proc": case("error: run_dir: cannot create '/proc/nexrl-test/run': '/proc' does not take new "
                               "folders", recipe=GOOD, overrides=("run_dir=/proc/nexrl-test/run",), own_run_dir=True),
    "run_dir_under_sys": case("error: run_dir: cannot create '/sys/nexrl-test': '/sys' does not take new folders",
                              recipe=GOOD, overrides=("run_dir=/sys/nexrl-test",), own_run_dir=True),
    "checkpoint_path_under_proc": case("error: trainer.checkpoint_path: cannot create '/proc/nexrl-test/ckpt': "
                                       "'/proc' does not take new folders", recipe=GOOD,
                                       overrides=("trainer.checkpoint_path=/proc/nexrl-test/ckpt",)),
    "resume_from_bad_path": case("error: resume.resume_path: 'data' is not a complete checkpoint folder"),
    "truncated_resume_state": case("error: checkpoints/truncated/global_step_3/nexrl_state.json:1: not valid JSON",
                                   "the checkpoint is damaged (truncated?)"),
}
# cases whose input has one defect that must give exactly one line (no follow-on complaints)
ONE_LINE = ("run_dir_under_proc", "run_dir_under_sys", "checkpoint_path_under_proc", "delete_a_needed_key",
            "delete_a_needed_section", "unknown_backend_with_its_keys", "unknown_weight_backend_with_its_keys",
            "unknown_trainer", "run_dir_under_a_file", "missing_data_file", "misspelled_data_file")
# recipes exercised by the plugin tests below
PLUGIN_RECIPES = {"good", "uses_bad_class", "evaluator_wrong_result_type", "evaluator_raises_on_some",
                  "evaluator_nan_reward", "evaluator_option_wrong_type", "evaluator_always_raises"}


@pytest.fixture
def in_corpus(monkeypatch):
    monkeypatch.chdir(CORPUS)


@pytest.fixture
def cli(core_pm, in_corpus, capfd, reset_loguru):
    def call(*argv: str):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


def test_every_corpus_recipe_has_a_case():
    used = {c.recipe or name for name, c in CASES.items()}
    assert {p.stem for p in RECIPES.glob("*.yaml")} == (used | PLUGIN_RECIPES) - {"no_such_recipe"}


def test_good_recipe_validates(cli):
    code, out, err = cli("validate", "recipes/good.yaml")
    assert code == 0, err
    assert "Traceback" not in err


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("name", sorted(CASES))
def test_validate_and_run_give_the_same_message(name, cli, tmp_path, monkeypatch):
    """Each bad input: one short message naming the key or file:line, no traceback, exit 2, and
    the same lines from `nexrl validate` and `nexrl run` (run writes nothing)."""
    c = CASES[name]
    if c.env:
        import nexrl_core.plugins as plugins

        for key, value in c.env:
            monkeypatch.setenv(key, value)
        monkeypatch.setattr(plugins, "_DEFAULT", PluginManager())
    argv = [f"recipes/{c.recipe or name}.yaml", *c.overrides]
    if not c.own_run_dir:
        argv.append(f"run_dir={tmp_path / 'run'}")
    results = {command: cli(command, *argv) for command in ("validate", "run")}
    for command, (code, out, err) in results.items():
        assert code == 2, f"{command}: {err}"
        for text in c.expected:
            assert text in err, f"{command} {name}: {text!r} not in:\n{err}"
        assert "Traceback" not in err and "Traceback" not in out
        assert _errors(err), err
    # run stops at the first failing step; every line it prints, validate prints too
    assert set(_errors(results["run"][2])) <= set(_errors(results["validate"][2]))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


@pytest.mark.parametrize("name", ONE_LINE)
def test_one_defect_is_one_line_and_nothing_is_created(name, cli, tmp_path):
    """An unwritable output path, a deleted key a run needs, an unknown backend with the keys it
    would have taken: one `error:` line, and `nexrl run` stops before it creates anything (no run
    directory, no run.log: no component, no model was built)."""
    c = CASES[name]
    argv = [f"recipes/{c.recipe or name}.yaml", *c.overrides]
    if not c.own_run_dir:
        argv.append(f"run_dir={tmp_path / 'run'}")
    for command in ("validate", "run"):
        code, out, err = cli(command, *argv)
        assert code == 2 and len(_errors(err)) == 1 and err.strip() == _errors(err)[0], f"{command}: {err}"
        assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- plugins


def _env(*plugin_dirs: str, load: str) -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(CORPUS / "plugins" / d) for d in plugin_dirs]
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    env["NEXRL_LOAD_PLUGINS"] = load
    return env


def _nexrl(*args: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "nexrl_core.cli", *args], capture_output=True, text=True,
                          cwd=CORPUS, env=env, timeout=120)


def test_plugin_that_fails_to_import_does_not_stop_a_run(tmp_path):
    proc = _nexrl("run", "recipes/good.yaml", f"run_dir={tmp_path / 'run'}",
                  env=_env("broken_import", load="nexrl-bad-broken"))
    assert proc.returncode == 0, proc.stderr
    assert "plugin 'broken' from nexrl-bad-broken failed to import and is skipped: ModuleNotFoundError: " \
           "No module named 'nexrl_bad_missing_dependency'" in proc.stderr
    assert "Traceback" not in proc.stderr
    steps = [json.loads(line)["step"] for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["global_step"] == 2


def test_plugins_command_shows_failed_and_bad_registrations():
    proc = _nexrl("plugins", env=_env("broken_import", "bad_class", load="nexrl-bad-broken,nexrl-bad-class"))
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "FAILED nexrl-bad-broken (plugin 'broken'): ModuleNotFoundError: No module named " \
           "'nexrl_bad_missing_dependency'" in lines
    bad = [line for line in lines if line.startswith("BAD ")]
    assert len(bad) == 3
    assert any("registers trainer 'not_a_trainer' as <class 'nexrl_bad_class.NotATrainer'>, which is not a "
               "subclass of BaseTrainer" in line for line in bad)
    assert any("registers trainer 'an_instance'" in line for line in bad)
    assert any("registers evaluator 'a_string'" in line for line in bad)
    assert all("(nexrl-bad-class)" in line for line in bad)
    assert "nexrl-bad-class 0.1.0 (plugin 'bad_class')" in lines
    assert "Traceback" not in proc.stderr


def _corpus_pm(monkeypatch, plugin_dir: str, dist: str) -> PluginManager:
    monkeypatch.syspath_prepend(str(CORPUS / "plugins" / plugin_dir))
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", dist)
    return PluginManager()


def test_recipe_using_a_badly_registered_class_is_refused(monkeypatch, in_corpus, capfd, reset_loguru):
    import nexrl_core.plugins as plugins

    pm = _corpus_pm(monkeypatch, "bad_class", "nexrl-bad-class")
    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    assert "not_a_trainer" not in pm.components("trainer")  # skipped, not registered
    code = main(["validate", "recipes/uses_bad_class.yaml"])
    _, err = capfd.readouterr()
    assert code == 2
    assert "error: trainer.type: unknown trainer 'not_a_trainer'. Available: 'mock' (nexrl-core)." in err
    assert "Skipped: plugin 'bad_class' (nexrl-bad-class) registers trainer 'not_a_trainer'" in err
    assert "Traceback" not in err
    # the good recipe still validates with that plugin installed
    assert main(["validate", "recipes/good.yaml"]) == 0


# ----------------------------------------------------------------------------- misbehaving evaluators

MISBEHAVING = {  # recipe -> (errors.jsonl cause, text in its message)
    "evaluator_wrong_result_type": ("evaluator_bad_result", "WrongResultType.evaluate returned dict, expected "
                                                            "EvaluationRunResult"),
    "evaluator_raises_on_some": ("evaluator_exception", "ValueError: cannot score"),
    "evaluator_nan_reward": ("bad_reward", "returned reward nan"),
}


@pytest.mark.parametrize("name", sorted(MISBEHAVING))
def test_misbehaving_evaluator_items_are_recorded_one_by_one_and_the_rest_trains(
        name, monkeypatch, in_corpus, tmp_path, capfd, reset_loguru):
    cause, text = MISBEHAVING[name]
    pm = _corpus_pm(monkeypatch, "evaluators", "nexrl-bad-evaluators")
    run_dir = tmp_path / "run"
    cfg = load_recipe(f"recipes/{name}.yaml", [f"run_dir={run_dir}", "runtime_monitor.stop_timeout=10"])
    controller = NexRLController(cfg, plugin_manager=pm)
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == 4

    errors = [json.loads(line) for line in (run_dir / "errors.jsonl").read_text().splitlines()]
    assert errors, "the misbehaving items were not recorded"
    for row in errors:
        assert row["cause"] == cause
        assert text in row["message"]
        assert row["item"]["misbehave"] is True  # only the flagged rows fail
    train_errors = [r for r in errors if not r["validation"]]
    val_errors = [r for r in errors if r["validation"]]
    assert {r["item"]["prompt"] for r in val_errors} == {"What is 2 + 3?"}

    # item-by-item accounting: every task the trainer consumed was trained on or recorded as lost
    trained = [t for batch in controller.trainer.batches for t in batch]
    trained_seqs = {t["seq"] for t in trained}
    assert len(trained_seqs) == len(trained)  # nothing trained twice
    assert not any(t["task"].get("misbehave") for t in trained)
    error_seqs = {r["seq"] for r in train_errors}
    assert not trained_seqs & error_seqs
    state = controller.dataloader.state_dict()
    waiting = {t["seq"] for t in state["requeued"]} | {t["seq"] for t in state["pending"]}
    consumed = set(range(state["next_seq"])) - waiting
    assert len(consumed) == 4 * 4  # 4 steps x batch 4
    assert consumed == trained_seqs | (consumed & error_seqs)
    assert consumed & error_seqs, "no failed item reached a batch"

    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    train_rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train_rows] == [1, 2, 3, 4]
    for row, batch in zip(train_rows, controller.trainer.batches):
        assert row["train/num_trajectories"] + row["train/num_failed"] == 4
        assert row["train/num_trajectories"] == len(batch)
        rewards = [t["reward"] for t in batch]
        assert isinstance(row["train/reward_mean"], float) and math.isfinite(row["train/reward_mean"])
        assert row["train/reward_mean"] == pytest.approx(sum(rewards) / len(rewards) if rewards else 0.0)
    assert sum(r["train/num_failed"] for r in train_rows) == len(consumed & error_seqs)

    val = summary.validation[0]
    assert val["val/num_samples"] == 3.0 and val["val/num_failed"] == 1.0 and val["val/num_missing"] == 0.0
    assert all(math.isfinite(v) for v in val.values())
    out, err = capfd.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    assert f"failed ({cause})" in err  # each failure is also logged, as one line


def test_evaluator_options_are_checked_from_its_annotated_signature(monkeypatch, in_corpus, tmp_path, capfd,
                                                                   reset_loguru):
    """An evaluator that declares no OPTIONS: its __init__ annotations type its options, and
    validate and run refuse `target_chars: abc` with the same line (no traceback at run time)."""
    import nexrl_core.plugins as plugins

    monkeypatch.setattr(plugins, "_DEFAULT", _corpus_pm(monkeypatch, "evaluators", "nexrl-bad-evaluators"))
    expected = "error: rollout_worker.evaluator.target_chars: expected an integer, got a string ('abc')"
    for command in ("validate", "run"):
        code = main([command, "recipes/evaluator_option_wrong_type.yaml", f"run_dir={tmp_path / 'run'}"])
        out, err = capfd.readouterr()
        assert code == 2 and _errors(err) == [expected], err
        assert "Traceback" not in err
    # the declared name of a parameter that is not annotated nor typo'd passes; a typo does not
    assert main(["validate", "recipes/evaluator_option_wrong_type.yaml", "rollout_worker.evaluator.target_chars=4",
                 "+rollout_worker.evaluator.letter=b"]) == 0
    assert main(["validate", "recipes/evaluator_option_wrong_type.yaml", "rollout_worker.evaluator.target_chars=4",
                 "+rollout_worker.evaluator.leter=b"]) == 2
    assert "did you mean 'rollout_worker.evaluator.letter'?" in capfd.readouterr().err


def test_a_run_whose_samples_all_fail_stops_with_exit_1_naming_the_evaluator(monkeypatch, in_corpus, tmp_path,
                                                                             capfd, reset_loguru):
    """An evaluator that raises on every sample: the run used to end `finished` with exit 0 while
    training on nothing. It now stops at the first step with exit 1 and says why."""
    import nexrl_core.plugins as plugins

    monkeypatch.setattr(plugins, "_DEFAULT", _corpus_pm(monkeypatch, "evaluators", "nexrl-bad-evaluators"))
    run_dir = tmp_path / "run"
    code = main(["run", "recipes/evaluator_always_raises.yaml", f"run_dir={run_dir}",
                 "runtime_monitor.stop_timeout=10"])
    out, err = capfd.readouterr()
    assert code == 1, err
    [line] = _errors(err)
    assert line.startswith("error: 4 of the last 4 training samples failed (more than "
                           "runtime_monitor.failed_samples.max_fraction=0.5)")
    assert "rollout_worker.evaluator: evaluator 'always_raises'" in line
    assert "most common error: evaluator_exception (4 of 4): evaluator 'always_raises' (nexrl-bad-evaluators) " \
           "raised KeyError: 'expected_answer' (plugins/evaluators/nexrl_bad_evaluators.py:44 in evaluate)" in line
    assert "Traceback" not in err and out == ""
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert rows and all(r["train/num_trajectories"] == 0 for r in rows)  # it trained on nothing
    # the threshold is a recipe key: raised to 1.0 the same run trains to the end on nothing
    code = main(["run", "recipes/evaluator_always_raises.yaml", f"run_dir={tmp_path / 'run2'}",
                 "runtime_monitor.failed_samples.max_fraction=1.0", "runtime_monitor.stop_timeout=10"])
    out, err = capfd.readouterr()
    assert code == 0, err
    assert json.loads(out.strip().splitlines()[-1])["global_step"] == 6
