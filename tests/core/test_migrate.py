"""``nexrl migrate`` (issue 30, items 1 and 6): a NexRL or ROLL recipe becomes a nexrl recipe by
the table in nexrl_core/cli/migration_table.py; every key it cannot carry over is listed with the
reason; the result is checked as ``nexrl validate`` checks it; ``nexrl validate`` names nexrl's
key for a seed key and points at ``nexrl migrate``. Core components only (no torch): the
algorithm keys and the developer guide's recipe are tested with nexrl-grpo in
tests/grpo_plugin/test_migrate_seed_recipe.py."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest
import yaml

from nexrl_core.cli import main
from nexrl_core.cli.migrate import import_lines, migrate_recipe
from nexrl_core.cli.migration_table import KEY_RULES, POINTER, SAME_KEYS, seed_key_hint

REPO = Path(__file__).resolve().parents[2]
MIGRATE = f"({POINTER})"


def _migrate(seed, pm):
    m = migrate_recipe(seed, pm)
    return m.recipe, {c.seed: c for c in m.changes}, m.dropped()


# -- keys -------------------------------------------------------------------------------------------

def test_the_validation_guides_sections_move_to_nexrls(core_pm):
    recipe, changes, dropped = _migrate({
        "dataloader": {"type": "torch", "data_config": {"dataset_paths": ["train.jsonl"], "split_type": "train",
                                                        "prompt_key": "question"},
                       "shuffle": True, "batch_size": 1},
        "validate_dataloader": {"type": "torch", "data_config": {"dataset_paths": ["val.jsonl"], "split_type": "none"},
                                "shuffle": False, "batch_size": 1},
        "weight_sync_controller": {"validate_freq": 5, "sync_mode": "batch-async", "staleness_threshold": 1},
        "validator": {"type": "validator"},
    }, core_pm)
    assert recipe == {
        "data": {"type": "file", "shuffle": True, "path": ["train.jsonl"], "prompt_key": "question"},
        "rollout_worker": {"prompt_key": "question"},  # the worker reads the prompt from the row's field
        "weight": {"validate_freq": 5, "sync_mode": "batch-async", "staleness_threshold": 1},
        "validate": {"data": {"type": "file", "path": ["val.jsonl"]}},
    }
    assert changes["rollout_worker.prompt_key"].why.startswith("data.prompt_key")
    assert changes["dataloader"].nexrl == "data" and changes["validate_dataloader"].nexrl == "validate.data"
    assert changes["weight_sync_controller"].nexrl == "weight"
    assert changes["data.data_config.dataset_paths"].nexrl == "data.path"
    assert changes["data.data_config"].nexrl == "data.prompt_key"  # the file loader declares it: moved up
    assert changes["data.type: torch"].nexrl == "file"
    assert set(dropped) == {"data.batch_size", "data.data_config.split_type", "validate.data.shuffle",
                            "validate.data.batch_size", "validate.data.data_config.split_type", "validator (type)"}
    assert dropped["validate.data.shuffle"] == "a validation pass goes through the rows in order"
    assert "keep training and validation rows in their own files" in dropped["data.data_config.split_type"]
    assert dropped["validator (type)"].startswith("nexrl has one validator")


def test_a_key_without_a_counterpart_goes_only_where_nexrl_rejects_it(core_pm):
    """validate.data.seed has no home with the file loader; the arithmetic loader (NexRL's mock
    loader's stand-in) generates its rows from it."""
    recipe, changes, dropped = _migrate({"validate_dataloader": {"type": "mock", "seed": 3},
                                         "dataloader": {"type": "torch", "seed": 3, "data_files": "a.jsonl"},
                                         "validate": {"data": None}}, core_pm)
    assert recipe["validate"]["data"] == {"type": "arithmetic", "seed": 3}
    assert changes["validate.data.type: mock"].nexrl == "arithmetic"
    assert recipe["data"] == {"type": "file", "seed": 3, "path": "a.jsonl"}  # data.seed is a core key
    assert dropped == {}


def test_the_seeds_weight_and_service_keys(core_pm):
    recipe, changes, dropped = _migrate({
        "trainer": {"type": "mock", "total_train_steps": 3, "sync_weight_path": "/shared/sync"},
        "weight": {"type": "default", "sync_mode": "sync", "checkpoint_manager": {"type": "dcp"}},
        "trajectory_pool": {"type": "default", "batch_size": 4, "group_size": 2},
        "service": {"inference_service": {"backend": "mock", "model_tag": "default",
                                          "freeze_for_weight_sync": True}},
    }, core_pm)
    assert recipe == {"trajectory_pool": {"batch_size": 4, "group_size": 2},
                      "trainer": {"type": "mock", "total_train_steps": 3}, "weight": {"sync_mode": "sync"},
                      "service": {"inference_service": {"backend": "mock", "model_tag": "default"}}}
    assert dropped["trainer.sync_weight_path"] == ("only weight.backend vllm_disk passes weights through files "
                                                   "(this recipe's weight.backend: version_only)")
    assert dropped["weight.type"].startswith("the weight-sync backend is weight.backend")
    assert dropped["weight.checkpoint_manager (type)"].startswith("checkpoints are the trainer's")
    assert dropped["trajectory_pool.type"] == "nexrl has one trajectory pool"
    assert "weight.pause_mode" in dropped["service.inference_service.freeze_for_weight_sync"]


def test_sync_weight_path_becomes_the_disk_backends_folder(core_pm):
    recipe, changes, _ = _migrate({"trainer": {"sync_weight_path": "/shared/sync"},
                                   "weight": {"backend": "vllm_disk"}}, core_pm)
    assert recipe["weight"] == {"backend": "vllm_disk", "sync_dir": "/shared/sync"}
    assert changes["trainer.sync_weight_path"].nexrl == "weight.sync_dir"


def test_evaluator_module_path_becomes_the_python_evaluator_with_its_class(core_pm):
    recipe, changes, dropped = _migrate({"rollout_worker": {
        "type": "simple", "num_workers": 2, "evaluator_module_path": "recipe/t/agent_workspace/evaluator.py:MyEval"}},
        core_pm)
    assert recipe["rollout_worker"] == {"type": "simple", "num_workers": 2, "evaluator": {
        "type": "python", "path": "recipe/t/agent_workspace/evaluator.py", "class": "MyEval"}}
    _, _, dropped = _migrate({"rollout_worker": {"evaluator_module_path": "evaluator.py"}}, core_pm)
    assert dropped == {"rollout_worker.evaluator_module_path": "expected 'path/to/file.py:ClassName', "
                                                              "got 'evaluator.py'"}


def test_a_custom_worker_becomes_a_worker_class_loaded_from_its_file(core_pm):
    recipe, _, dropped = _migrate({"rollout_worker": {
        "type": "simple", "custom_rollout_worker_module_path": "ws/my_worker.py",
        "custom_rollout_worker_class_name": "MyWorker"}}, core_pm)
    assert recipe == {"rollout_worker": {"type": "python", "path": "ws/my_worker.py", "class": "MyWorker"}}
    assert dropped == {}
    _, _, dropped = _migrate({"rollout_worker": {"custom_rollout_worker_module_path": "ws/my_worker.py"}}, core_pm)
    assert dropped == {"rollout_worker.custom_rollout_worker_module_path": "custom_rollout_worker_class_name is "
                                                                           "missing"}


def test_single_turn_math_is_the_simple_worker_with_a_math_evaluator(core_pm):
    recipe, changes, _ = _migrate({"rollout_worker": {"type": "single_turn_math", "num_workers": 2}}, core_pm)
    # nexrl-rewards (math_rule) is not installed here: the core's numeric_answer, on NexRL's answer field
    assert recipe == {"rollout_worker": {"type": "simple", "num_workers": 2,
                                         "evaluator": {"type": "numeric_answer",
                                                       "answer_key": "reward_model.ground_truth"}}}
    assert changes["rollout_worker.type: single_turn_math"].nexrl == "simple"
    # it does not score as NexRL did: the line says so, and what does
    assert changes["rollout_worker.evaluator"].text().startswith(
        "rollout_worker.evaluator -> numeric_answer, answer_key reward_model.ground_truth (rollout_worker.type "
        "single_turn_math: the reply's last number, not NexRL's scoring (the last \\boxed{} of the reply")
    assert "math_rule of nexrl-rewards does (pip install nexrl-rewards, migrate again)" in \
        changes["rollout_worker.evaluator"].why
    recipe, _, _ = _migrate({"rollout_worker": {"type": "single_turn_math", "evaluator": {"type": "exact_match"}}},
                            core_pm)
    assert recipe["rollout_worker"]["evaluator"] == {"type": "exact_match"}  # the recipe's own wins


def test_nexrls_simple_worker_scores_its_answer_tag_as_nexrl_did(core_pm):
    """NexRL's simple worker scored the reply's <answer>...</answer> against the row's
    reward_model.ground_truth: exact_match with extract_pattern does the same on the same rows."""
    from nexrl_core import BaseEvaluationTarget

    recipe, changes, _ = _migrate({"rollout_worker": {"type": "simple", "num_workers": 2}}, core_pm)
    options = recipe["rollout_worker"]["evaluator"]
    assert options == {"type": "exact_match", "answer_key": "reward_model.ground_truth",
                       "extract_pattern": "<answer>(.*?)</answer>"}
    assert changes["rollout_worker.evaluator"].why.startswith("rollout_worker.type simple: NexRL scored the first `"
                                                              "<answer>...</answer>` of the reply")
    evaluator = core_pm.components("evaluator")["exact_match"].cls(**{k: v for k, v in options.items() if k != "type"})
    row = {"uid": "0:0", "prompt": [{"role": "user", "content": "2 + 3?"}],
           "reward_model": {"style": "rule", "ground_truth": "5"}}

    def reward(reply: str) -> float:
        return evaluator.evaluate(row, BaseEvaluationTarget(reply)).reward

    assert reward("It is <answer> 5\n</answer>, surely.") == 1.0
    assert reward("<answer>5</answer> then <answer>6</answer>") == 1.0  # the first tag, as NexRL's re.search
    assert reward("It is <answer>6</answer>.") == 0.0
    assert reward("5") == 0.0  # no tag: NexRL's empty answer
    with pytest.raises(Exception, match="extract_pattern: '<answer>\\(' is not a regular expression"):
        core_pm.components("evaluator")["exact_match"].cls(extract_pattern="<answer>(")
    from nexrl_core.launch.recipe import check_config

    assert "rollout_worker.evaluator.extract_pattern: '<answer>(' is not a regular expression (missing ), " \
           "unterminated subpattern at position 8)" in \
        check_config({"rollout_worker": {"evaluator": {"type": "exact_match", "extract_pattern": "<answer>("}}}, core_pm)


def test_roll_pipeline_keys(core_pm):
    recipe, changes, dropped = _migrate({
        "exp_name": "rlvr", "seed": 7, "max_steps": 20, "save_steps": 5, "eval_steps": 10, "output_dir": "out",
        "rollout_batch_size": 4, "num_return_sequences_in_group": 8, "val_n_sample": 4, "val_greedy": True,
        "track_with": "stdout", "max_ckpt_to_keep": 1, "resume_from_checkpoint": "out/global_step_5",
        "rpc_timeout": 600, "trainer": {"type": "mock"},
        "actor_train": {"model_args": {"dtype": "bf16"}}, "reference": {"device_mapping": [0]},
    }, core_pm)
    assert recipe == {
        "experiment_name": "rlvr", "run_dir": "out", "seed": 7,
        "trajectory_pool": {"batch_size": 32, "group_size": 8},
        "trainer": {"type": "mock", "total_train_steps": 20, "save_freq": 5, "remove_previous_ckpt": True},
        "weight": {"validate_freq": 10},
        "resume": {"mode": "from_path", "resume_path": "out/global_step_5"},
        "logger": {"backend": ["console"]}, "ray": {"call_timeout": 600},
    }
    assert changes["rollout_batch_size"].why.startswith("times num_return_sequences_in_group")
    # the validation keys act only with a validation set, which this recipe does not name
    assert set(dropped) == {"actor_train (model_args.dtype)", "reference (device_mapping)",
                            "val_greedy (as rollout_worker.validate_temperature)", "val_n_sample (as validate.n_samples)"}
    assert dropped["val_n_sample (as validate.n_samples)"] == "does nothing without validate.data: true (set that, or " \
        "delete validate.n_samples)"
    assert dropped["reference (device_mapping)"].startswith("ROLL's worker clusters")
    _, _, dropped = _migrate({"max_ckpt_to_keep": 3, "track_with": "swanlab"}, core_pm)
    assert dropped == {"max_ckpt_to_keep": "nexrl keeps every checkpoint or only the newest "
                                           "(trainer.remove_previous_ckpt), not 3",
                       "track_with": "no metrics sink for 'swanlab' (console, wandb and tensorboard are built in)"}


def test_references_follow_the_keys_they_name(core_pm):
    recipe, _, dropped = _migrate({
        "dataloader": {"type": "torch", "batch_size": 8, "seed": 5, "data_files": "${oc.env:DATA}/train.jsonl"},
        "trajectory_pool": {"batch_size": "${dataloader.batch_size}", "group_size": 4},
        "weight": {"validate_freq": "${validate.eval.validate_freq}"},
        "validate": {"eval": {"type": "default", "validate_freq": 3}},
        "rollout_worker": {"seed": "${dataloader.seed}"},
    }, core_pm)
    assert recipe["trajectory_pool"] == {"batch_size": 8, "group_size": 4}  # data.batch_size had no home: its value
    assert recipe["weight"] == {"validate_freq": 3}
    assert recipe["rollout_worker"] == {"seed": "${data.seed}"}
    assert recipe["data"]["path"] == "${oc.env:DATA}/train.jsonl"  # a resolver is not a key
    assert "validate" not in recipe and "validate.eval (type)" in dropped


def test_nexrls_own_key_wins_over_the_seeds_and_the_clash_is_listed(core_pm):
    recipe, _, dropped = _migrate({"data": {"type": "file", "path": "mine.jsonl"},
                                   "dataloader": {"data_config": {"dataset_paths": ["theirs.jsonl"]}}}, core_pm)
    assert recipe == {"data": {"type": "file", "path": "mine.jsonl"}}
    assert dropped == {"data.data_config.dataset_paths": "data.path is already 'mine.jsonl' (kept)"}


def test_keys_nexrl_does_not_know_are_listed_with_the_checks_words(core_pm):
    recipe, _, dropped = _migrate({"data": {"type": "file", "path": "a.jsonl", "cache_rows": 4},
                                   "multi_model": "false", "environment": {"setup_script": ""}, "service": None,
                                   "trainer": {"type": "mock", "algorithm": None}}, core_pm)
    assert dropped == {"data.cache_rows": "unknown key in nexrl (data loader 'file' accepts: path, "
                                          "dataset_paths, prompt_key)",
                       "multi_model": "one policy per run",
                       "environment.setup_script": "NexRL's launcher sourced it before the run; nexrl reads the "
                                                   "environment it is started in (nexrl migrate names the script "
                                                   "and what it exports)",
                       "service": "null: nexrl's defaults apply",
                       "trainer.algorithm (as algorithm)": "null: nexrl's defaults apply"}
    assert recipe == {"data": {"type": "file", "path": "a.jsonl"}, "trainer": {"type": "mock"}}


def test_every_plain_move_and_every_unchanged_key_is_a_key_nexrl_documents():
    """The table cannot send a value to a key nexrl does not have (docs/recipe.md lists every key
    of the core and of the plugins in this repository; it is checked current elsewhere)."""
    rows = {line.split("`")[1]: line for line in (REPO / "docs" / "recipe.md").read_text().splitlines()
            if line.startswith("| `")}

    def documented(key: str) -> bool:
        if key.startswith("validate.data."):  # a data loader's keys are listed once, as data.<key>
            key = "data." + key[len("validate.data."):]
        if key == "service.train_service.backend":  # the train service's own keys depend on the trainer
            return "backend (a registered train service)" in rows["service.train_service"]
        return key in rows

    targets = [r.nexrl for r in KEY_RULES if r.convert is None and r.nexrl is not None]
    assert [t for t in targets + list(SAME_KEYS) if not documented(t)] == []
    assert [r.seed for r in KEY_RULES if r.seed in rows] == []  # a seed key nexrl accepts needs no rule


# -- files and the command ----------------------------------------------------------------------------

SEED = {
    "defaults": ["common", "_self_"],
    "experiment_name": "migrated",
    "dataloader": {"type": "torch", "data_config": {"dataset_paths": ["data/train.jsonl"]}},
    "rollout_worker": {"type": "simple", "num_workers": 2, "evaluator_module_path": "ws/evaluator.py:MyEval"},
    "trajectory_pool": {"type": "default", "batch_size": 4, "group_size": 2},
    "trainer": {"type": "mock", "total_train_steps": 2},
    "weight": {"type": "default"},
}
COMMON = {"project_name": "seed-project", "service": {"inference_service": {"backend": "mock", "mode": "echo"}},
          "logger": {"backend": ["console"]}}
EVALUATOR = textwrap.dedent('''
    from nexrl.rollout_worker import Evaluator, EvaluationRunResult, NexAUEvaluationTarget
    from nexrl.data_loader import TorchDataLoader
    import nexrl.utils


    class MyEval(Evaluator):
        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult(reward=float(evaluation_target.final_answer == data["prompt"]))
''')


@pytest.fixture
def seed_dir(tmp_path):
    root = tmp_path / "recipe"
    (root / "data").mkdir(parents=True)
    (root / "ws").mkdir()
    (root / "data" / "train.jsonl").write_text('{"prompt": "hi"}\n{"prompt": "yo"}\n')
    (root / "ws" / "evaluator.py").write_text(EVALUATOR)
    (root / "common.yaml").write_text(yaml.safe_dump(COMMON))
    (root / "seed.yaml").write_text(yaml.safe_dump(SEED, sort_keys=False))
    return root


@pytest.fixture
def cli(core_pm, capfd, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)

    def call(*argv):
        code = main(list(argv))
        out, err = capfd.readouterr()
        return code, out, err
    return call


def test_migrate_composes_places_paths_lists_imports_and_validates(seed_dir, cli, tmp_path):
    out = tmp_path / "elsewhere" / "new.yaml"
    code, stdout, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(out))
    recipe = yaml.safe_load(out.read_text())
    assert out.read_text().startswith("# migrated from seed.yaml by nexrl migrate (docs/migrating.md)\n")
    assert recipe["project_name"] == "seed-project" and recipe["service"]["inference_service"]["mode"] == "echo"
    assert recipe["data"] == {"type": "file", "path": ["../recipe/data/train.jsonl"]}  # for the new file's folder
    # the evaluator imports NexRL: the recipe uses a copy beside it, its imports rewritten where nexrl has the names
    assert recipe["rollout_worker"]["evaluator"] == {"type": "python", "path": "new_workspace/ws/evaluator.py",
                                                     "class": "MyEval"}
    assert (seed_dir / "ws" / "evaluator.py").read_text() == EVALUATOR
    assert "  dataloader -> data\n" in err and "  trajectory_pool.type: nexrl has one trajectory pool\n" in err
    shown = "../recipe/ws/evaluator.py"
    assert (f"  {shown}:2: from nexrl.rollout_worker import Evaluator -> from nexrl_core import Evaluator\n" in err)
    assert (f"  {shown}:2: from nexrl.rollout_worker import NexAUEvaluationTarget -> from nexrl_nexau import "
            f"NexAUEvaluationTarget\n") in err
    assert (f"  {shown}:3: from nexrl.data_loader import TorchDataLoader -> from nexrl_core import FileDataLoader "
            f"as TorchDataLoader (data.type file)\n") in err
    assert f"  {shown}:4: import nexrl.utils -> the names it uses, from nexrl_core" in err
    # `import nexrl.utils` is left to the user (in the copy): the result does not pass yet, and the command says why
    assert "left to rewrite:\n  elsewhere/new_workspace/ws/evaluator.py:4: import nexrl.utils: change what is used " \
           "through it to nexrl's names" in err
    assert code == 2
    assert f"nexrl validate {out}: 1 problem:\nerror: rollout_worker.evaluator.path: importing " in err
    assert "No module named 'nexrl'" in err
    # with the imports changed as listed, it passes
    (seed_dir / "ws" / "evaluator.py").write_text(EVALUATOR.replace("from nexrl.rollout_worker import",
                                                                    "from nexrl_core import")
                                                  .replace("from nexrl.data_loader import TorchDataLoader\n", "")
                                                  .replace("import nexrl.utils\n", "")
                                                  .replace(", NexAUEvaluationTarget", ""))
    code, _, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(out), "--force")
    assert code == 0, err
    assert err.rstrip().endswith(f"nexrl validate {out}: ok") and "imports of NexRL" not in err
    code, _, err = cli("validate", str(out))
    assert code == 0, err
    code, _, err = cli("run", str(out), f"run_dir={tmp_path / 'run'}")
    assert code == 0, err
    assert (tmp_path / "run" / "metrics.jsonl").exists()


def test_paths_named_relative_to_nexrl_path_are_found(seed_dir, cli, tmp_path, monkeypatch):
    """NexRL resolved a relative path against $NEXRL_PATH."""
    seed = dict(SEED, rollout_worker={"evaluator_module_path": "recipe/ws/evaluator.py:MyEval"})
    (seed_dir / "seed.yaml").write_text(yaml.safe_dump(seed))
    monkeypatch.setenv("NEXRL_PATH", str(tmp_path))
    code, stdout, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(seed_dir / "new.yaml"))
    evaluator = yaml.safe_load((seed_dir / "new.yaml").read_text())["rollout_worker"]["evaluator"]
    assert evaluator["path"] == "new_workspace/ws/evaluator.py"  # a copy of recipe/ws, found by $NEXRL_PATH
    assert "ws/evaluator.py:2: from nexrl.rollout_worker import Evaluator" in err


def test_a_file_not_beside_the_recipe_is_not_copied_and_the_command_is_named(seed_dir, cli, tmp_path, monkeypatch):
    """A file found under $NEXRL_PATH, outside the recipe's folder: no copy (its folder may be
    anything), the --code command still to run is named, and the exit is 2 until it is run."""
    shared = tmp_path / "shared" / "ws"
    shared.mkdir(parents=True)
    (shared / "evaluator.py").write_text(EVALUATOR.replace("import nexrl.utils\n", ""))
    (seed_dir / "seed.yaml").write_text(yaml.safe_dump(dict(SEED, rollout_worker={
        "evaluator_module_path": "shared/ws/evaluator.py:MyEval"})))
    monkeypatch.setenv("NEXRL_PATH", str(tmp_path))
    out = tmp_path / "new.yaml"
    code, _, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(out))
    assert code == 2 and not (tmp_path / "new_workspace").exists()
    assert yaml.safe_load(out.read_text())["rollout_worker"]["evaluator"]["path"] == "shared/ws/evaluator.py"
    assert "left to rewrite:\n  nexrl migrate --code shared/ws --write  (rewrites the files there in place; they " \
           "are not beside the recipe, so no copy is made)\n" in err
    assert main(["migrate", "--code", "shared/ws", "--write"]) == 0
    code, _, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(out), "--force")
    assert code == 0, err


def test_the_nexau_workspace_is_placed_and_its_imports_listed(seed_dir, cli, tmp_path):
    (seed_dir / "ws" / "my_worker.py").write_text("from nexrl.rollout_worker import BaseNexAURolloutWorker\n")
    (seed_dir / "ws" / "agent.yaml").write_text("name: a\n")
    seed = dict(SEED, rollout_worker={"type": "nexau", "nexau_agent_workspace": "ws",
                                      "nexau_agent_config_path": "ws/agent.yaml",
                                      "evaluator_module_path": "ws/evaluator.py:MyEval"})
    (seed_dir / "seed.yaml").write_text(yaml.safe_dump(seed))
    code, stdout, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(tmp_path / "new.yaml"))
    worker = yaml.safe_load((tmp_path / "new.yaml").read_text())["rollout_worker"]
    # the worker reads them from the current folder: next to the recipe (the workspace's copy: it imports NexRL)
    assert worker["nexau_agent_workspace"] == "${recipe_dir}/new_workspace/ws"
    assert worker["nexau_agent_config_path"] == "${recipe_dir}/new_workspace/ws/agent.yaml"
    assert ("  recipe/ws/my_worker.py:1: from nexrl.rollout_worker import BaseNexAURolloutWorker -> from nexrl_nexau "
            "import BaseNexAURolloutWorker (it runs the agent itself; a subclass overrides format_task_query") in err
    assert err.count("recipe/ws/evaluator.py:2: from nexrl.rollout_worker import Evaluator ->") == 1  # listed once


def test_without_out_the_recipe_goes_to_stdout(seed_dir, cli):
    code, stdout, err = cli("migrate", str(seed_dir / "seed.yaml"))
    assert yaml.safe_load(stdout)["data"]["type"] == "file"
    assert err.startswith(f"{seed_dir / 'seed.yaml'} -> stdout\n")


def test_migrate_help_names_the_workspace_copies(capfd):
    with pytest.raises(SystemExit) as exit_:
        main(["migrate", "--help"])
    assert exit_.value.code == 0
    text = " ".join(capfd.readouterr().out.split())
    assert "copied to NEW_workspace/ next to NEW.yaml with those imports rewritten" in text
    assert "the workspace copies go to OUT's folder as <OUT name>_workspace/" in text


def test_migrate_refuses_to_overwrite(seed_dir, cli):
    existing = seed_dir / "taken.yaml"
    existing.write_text("x: 1\n")
    code, _, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(existing))
    assert code == 2 and err == f"error: -o: '{existing}' exists (--force replaces it)\n"
    assert existing.read_text() == "x: 1\n"
    code, _, err = cli("migrate", str(seed_dir / "seed.yaml"), "-o", str(seed_dir / "seed.yaml"), "--force")
    assert code == 2 and "is the recipe being migrated" in err
    code, _, err = cli("migrate", str(seed_dir / "nope.yaml"))
    assert code == 2 and err == f"error: {seed_dir / 'nope.yaml'}: recipe file not found\n"


def test_import_lines_name_each_replacement(tmp_path):
    path = tmp_path / "worker.py"
    path.write_text("from nexrl import BaseRolloutWorker\nfrom nexrl.rollout_worker import AgentRolloutWorker\n"
                    "from nexrl.trainer import SelfHostedTrainer, Unheard\nfrom nexrl_core import Batch\n")
    assert import_lines(str(path), str(tmp_path)) == [
        "worker.py:1: from nexrl import BaseRolloutWorker -> from nexrl_core import BaseRolloutWorker",
        "worker.py:2: from nexrl.rollout_worker import AgentRolloutWorker -> none: rollout_worker.type nexau runs "
        "tool-using agents (nexrl-nexau)",
        "worker.py:3: from nexrl.trainer import SelfHostedTrainer -> from nexrl_grpo.trainers import "
        "SelfHostedTrainer",
        "worker.py:3: from nexrl.trainer import Unheard -> no counterpart known "
        "(docs/migrating.md#imports-and-classes)",
    ]


# -- the hint of validate and run --------------------------------------------------------------------

GOOD = {"data": {"type": "inline", "rows": [{"prompt": "a", "answer": "a"}]},
        "trainer": {"type": "mock", "total_train_steps": 1},
        "service": {"inference_service": {"backend": "mock"}},
        "trajectory_pool": {"batch_size": 2, "group_size": 2}, "rollout_worker": {"num_workers": 1},
        "logger": {"backend": ["console"]}}


@pytest.mark.parametrize("extra, line", [
    ({"adv_estimator": "grpo"}, f"error: adv_estimator: unknown key; ROLL's name for algorithm.type {MIGRATE}"),
    ({"max_steps": 5}, f"error: max_steps: unknown key; ROLL's name for trainer.total_train_steps {MIGRATE}"),
    ({"validate_dataloader": {"type": "torch"}},
     f"error: validate_dataloader: unknown key; NexRL's name for validate.data {MIGRATE}"),
    ({"weight_sync_controller": {"validate_freq": 2}},
     f"error: weight_sync_controller: unknown key; NexRL's name for weight {MIGRATE}"),
    ({"trainer": {"type": "mock", "sync_weight_path": "/x"}},
     f"error: trainer.sync_weight_path: unknown key; NexRL's name for weight.sync_dir {MIGRATE}"),
    ({"service": {"inference_service": {"backend": "mock", "freeze_for_weight_sync": True}}},
     "error: service.inference_service.freeze_for_weight_sync: unknown key; a NexRL key nexrl has no counterpart "
     "for: the weight-sync backend (weight.backend) decides how requests wait for a weight push (with the vllm "
     f"backends, weight.pause_mode) {MIGRATE}"),
    ({"trajectory_pool": {"type": "default", "batch_size": 2, "group_size": 2}},
     f"error: trajectory_pool.type: no longer a recipe key: nexrl has one trajectory pool; delete "
     f"trajectory_pool.type {MIGRATE}"),
])
def test_validate_and_run_name_nexrls_key_in_one_line(extra, line, tmp_path, cli):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**GOOD, **extra, "run_dir": str(tmp_path / "run")}))
    for command in ("validate", "run"):
        code, _, err = cli(command, str(recipe))
        errors = [e for e in err.splitlines() if e.startswith("error: ")]
        assert code == 2 and errors == [line], err


def test_a_seed_section_names_the_keys_inside_it():
    assert seed_key_hint("data.data_config") == f"unknown key; a NexRL section: dataset_paths -> data.path {MIGRATE}"
    assert seed_key_hint("dataloader") == f"unknown key; NexRL's name for data {MIGRATE}"
    assert seed_key_hint("not_a_seed_key") is None
