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
from pathlib import Path

import pytest

from nexrl_core.cli import main
from nexrl_core.config import load_recipe
from nexrl_core.controller import NexRLController
from nexrl_core.plugins import PluginManager

CORPUS = Path(__file__).resolve().parents[1] / "bad_inputs"
RECIPES = CORPUS / "recipes"

# recipe -> (command, exit code, text the output must contain). `validate` exits 2 and lists
# every problem; `run` exits 1 with one "error: ..." line. Data files are read by `run`.
CASES: dict[str, tuple[str, int, list[str]]] = {
    "malformed_yaml": ("validate", 2, ["recipes/malformed_yaml.yaml:7: not valid YAML (mapping values are not "
                                       "allowed here)"]),
    "not_a_mapping": ("validate", 2, ["recipes/not_a_mapping.yaml: a recipe must be a mapping of keys, got list"]),
    "bad_interpolation": ("validate", 2, ["trainer.total_train_steps: cannot resolve interpolation (Interpolation "
                                          "key 'trainer.steps' not found)"]),
    "unknown_top_level_key": ("validate", 2, ["- trainner: unknown key; did you mean 'trainer'?"]),
    "typo_trainer_key": ("validate", 2, ["- trainer.total_train_step: unknown key; did you mean "
                                         "'trainer.total_train_steps'?"]),
    "typo_pool_key": ("validate", 2, ["- trajectory_pool.groupsize: unknown key; did you mean "
                                      "'trajectory_pool.group_size'?"]),
    "typo_weight_key": ("validate", 2, ["- weight.validate_frequency: unknown key; did you mean "
                                        "'weight.validate_freq'?"]),
    "wrong_type": ("validate", 2, ["- trajectory_pool.batch_size: expected an integer, got a string ('four')"]),
    "wrong_type_bool": ("validate", 2, ["- validate.validate_before_train: expected a boolean, got a string "
                                        "('sometimes')"]),
    "unknown_trainer": ("validate", 2, ["- trainer.type: unknown trainer 'self_hosted_grop'.",
                                        "Available: 'mock' (nexrl-core)"]),
    "unknown_evaluator": ("validate", 2, ["- rollout_worker.evaluator.type: unknown evaluator 'exact_matchh'. "
                                          "Did you mean 'exact_match'?", "'numeric_answer' (nexrl-core)"]),
    "batch_not_divisible": ("validate", 2, ["- trajectory_pool.batch_size (6) must be a multiple of "
                                            "trajectory_pool.group_size (4)"]),
    "resume_from_path_without_path": ("validate", 2, ["- resume.resume_path: required when resume.mode is "
                                                      "'from_path'"]),
    "missing_data_file": ("run", 1, ["error: data/no_such_file.jsonl: data file not found"]),
    "missing_val_file": ("run", 1, ["error: data/no_such_val.jsonl: data file not found"]),
    "data_without_path": ("run", 1, ["error: data.path: the file data loader needs a path"]),
    "empty_data_file": ("run", 1, ["error: data/empty.jsonl: the file holds no rows"]),
    "blank_data_file": ("run", 1, ["error: data/blank_lines.jsonl: the file holds no rows"]),
    "bad_json_line": ("run", 1, ["error: data/bad_json.jsonl:3: not valid JSON"]),
    "json_not_object": ("run", 1, ["error: data/not_an_object.jsonl:2: each line must be a JSON object, got list"]),
    "missing_prompt": ("run", 1, ["error: data/missing_prompt.jsonl:3: the row has no 'prompt' field"]),
    "empty_prompt": ("run", 1, ["error: data/empty_prompt.jsonl:2: the row has no 'prompt' field"]),
    "not_parquet": ("run", 1, ["error: data/not_parquet.parquet: not a readable Parquet file"]),
    "resume_from_bad_path": ("run", 1, ["error: resume.resume_path: 'data' is not a complete checkpoint folder"]),
}
# recipes exercised by the plugin tests below
PLUGIN_RECIPES = {"good", "uses_bad_class", "evaluator_wrong_result_type", "evaluator_raises_on_some",
                  "evaluator_nan_reward"}


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
    assert {p.stem for p in RECIPES.glob("*.yaml")} == set(CASES) | PLUGIN_RECIPES


def test_good_recipe_validates(cli):
    code, out, err = cli("validate", "recipes/good.yaml")
    assert code == 0, err
    assert "Traceback" not in err


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_recipe(name, cli, tmp_path):
    command, exit_code, expected = CASES[name]
    argv = [command, f"recipes/{name}.yaml"]
    if command == "run":
        argv.append(f"run_dir={tmp_path / 'run'}")
    code, out, err = cli(*argv)
    assert code == exit_code, err
    for text in expected:
        assert text in err, f"{name}: {text!r} not in:\n{err}"
    assert "Traceback" not in err and "Traceback" not in out
    if command == "run":
        assert not (tmp_path / "run" / "metrics.jsonl").exists()  # refused before training


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
    assert "- trainer.type: unknown trainer 'not_a_trainer'. Available: 'mock' (nexrl-core)." in err
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
