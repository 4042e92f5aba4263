"""Checkpoints by default (issue #45 item 5): a finished run keeps its last step whatever
``save_freq`` says, unless ``trainer.save_final: false``; a long run of a trainer with weights that
keeps nothing is warned about by ``nexrl validate`` and ``nexrl run`` alike."""

from __future__ import annotations

import json

import pytest
import yaml

from nexrl_core import hookimpl
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.checkpoint import CORE_STATE_FILE
from nexrl_core.cli import main
from nexrl_core.testing import use_plugins

RECIPE = {
    "data": {"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "2 + 2", "answer": "4"}]},
    "rollout_worker": {"num_workers": 1, "evaluator": {"type": "numeric_answer"}},
    "trajectory_pool": {"batch_size": 2, "group_size": 2},
    "trainer": {"type": "mock", "total_train_steps": 3},
    "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
    "logger": {"level": "WARNING"},
}


class WeightedTrainer(MockTrainer):
    """A trainer whose checkpoints hold weights (what a lost final step costs)."""

    NO_MODEL_STATE = False

    def save_model_state(self, folder: str) -> None:
        with open(f"{folder}/weights.json", "w") as f:
            json.dump({"step": self.global_step}, f)

    def load_model_state(self, folder: str) -> None:
        pass


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"weighted": WeightedTrainer}


@pytest.fixture
def nexrl(tmp_path, capfd, reset_loguru, monkeypatch):
    """``nexrl(*argv)`` -> (exit code, stdout and stderr)."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE}))

    def call(*argv: str):
        with use_plugins(Plugin()):
            code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return code, out + err
    return call


def _saved(tmp_path):
    folder = tmp_path / "run" / "checkpoints"
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_a_run_without_save_freq_keeps_its_last_step(nexrl, tmp_path):
    code, err = nexrl("run", "recipe.yaml", "trainer.type=weighted")
    assert code == 0, err
    assert _saved(tmp_path) == ["global_step_3"]  # the last step only: save_freq is 0
    step = tmp_path / "run" / "checkpoints" / "global_step_3"
    assert json.loads((step / "weights.json").read_text()) == {"step": 3}
    assert (step / CORE_STATE_FILE).is_file()
    assert "checkpoint at the end" in err  # the header's schedule says it
    assert str(step) in err.split("finished:")[1]  # the footer names it
    assert "warning: trainer.save_final" not in err


def test_save_freq_still_saves_on_its_steps_and_the_last(nexrl, tmp_path):
    code, err = nexrl("run", "recipe.yaml", "trainer.type=weighted", "trainer.save_freq=2")
    assert code == 0, err
    assert _saved(tmp_path) == ["global_step_2", "global_step_3"]


def test_save_final_false_keeps_nothing_and_the_footer_says_why(nexrl, tmp_path):
    code, err = nexrl("run", "recipe.yaml", "trainer.type=weighted", "trainer.save_final=false")
    assert code == 0, err
    assert _saved(tmp_path) == []
    assert "none saved (trainer.save_freq: 0, trainer.save_final: false)" in err


@pytest.mark.parametrize("command", ["validate", "run"])
def test_a_long_run_that_keeps_no_weights_is_warned_by_validate_and_run(nexrl, tmp_path, command):
    keep_nothing = ["trainer.type=weighted", "trainer.save_final=false", "trainer.total_train_steps=10"]
    code, err = nexrl(command, "recipe.yaml", *keep_nothing)
    assert code == 0, err
    warnings = [line for line in err.splitlines() if line.startswith("warning: trainer.save_final")]
    assert warnings == ["warning: trainer.save_final: false and trainer.save_freq: 0: this run of 10 steps keeps "
                        "no checkpoint, so its trained weights are gone when it ends (nothing to export or to "
                        "train on from); drop save_final: false, or set trainer.save_freq"]


@pytest.mark.parametrize("overrides", [
    ["trainer.type=weighted", "trainer.save_final=false", "trainer.total_train_steps=9"],  # a short run
    ["trainer.type=weighted", "trainer.save_final=false", "trainer.total_train_steps=10", "trainer.save_freq=5"],
    ["trainer.type=mock", "trainer.save_final=false", "trainer.total_train_steps=10"],  # no weights to lose
    ["trainer.type=weighted", "trainer.total_train_steps=10"],  # the default keeps the last step
])
def test_no_warning_when_nothing_is_lost(nexrl, overrides):
    code, err = nexrl("validate", "recipe.yaml", *overrides)
    assert code == 0 and "warning: trainer.save_final" not in err, err


# -- trainer.num_train_epochs (issue #45 item 4) ---------------------------------------------------

SIX_ROWS = {"type": "inline", "rows": [{"prompt": f"{a} + 1", "answer": str(a + 1)} for a in range(6)]}


def _six_rows(tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE,
                                                          "data": SIX_ROWS}))


def test_num_train_epochs_sets_the_steps(nexrl, tmp_path):
    """6 rows, 2 prompts a step (batch 4, group 2), 2 epochs: 6 steps; validate and run agree."""
    _six_rows(tmp_path)
    overrides = ["trainer.num_train_epochs=2", "trajectory_pool.batch_size=4"]
    code, err = nexrl("validate", "recipe.yaml", *overrides)
    assert code == 0 and "note: trainer.num_train_epochs=2: 6 training steps" in err, err
    code, err = nexrl("run", "recipe.yaml", *overrides)
    assert code == 0, err
    assert "6 steps of 4 samples (2 per prompt, 2 epochs)" in err
    summary = next(line for line in err.splitlines() if line.startswith('{"global_step"'))
    assert json.loads(summary)["global_step"] == 6
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert max(r["step"] for r in rows) == 6
    # training on doubles the epochs (a step count would be replaced by what the epochs give)
    train_on = "nexrl run recipe.yaml trajectory_pool.batch_size=4 resume.mode=auto trainer.num_train_epochs=4"
    assert train_on in err
    code, err = nexrl("run", "recipe.yaml", *train_on.split()[3:])
    assert code == 0, err
    assert '"global_step": 12' in err and "resuming from" in err


@pytest.mark.parametrize("epochs, steps", [(0.5, 2), (1, 3), (2.5, 8)])
def test_num_train_epochs_rounds_a_part_step_up(nexrl, tmp_path, epochs, steps):
    _six_rows(tmp_path)
    code, err = nexrl("validate", "recipe.yaml", f"trainer.num_train_epochs={epochs}", "trajectory_pool.batch_size=4")
    assert code == 0 and f"{steps} training steps" in err, err


def test_num_train_epochs_on_a_missing_data_file_is_the_data_error_from_both(nexrl, tmp_path):
    (tmp_path / "recipe.yaml").write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE,
                                                          "data": {"type": "file", "path": "nowhere.jsonl"}}))
    results = {c: nexrl(c, "recipe.yaml", "trainer.num_train_epochs=1") for c in ("validate", "run")}
    for command, (code, err) in results.items():
        assert code == 2 and "data.path" in err and "Traceback" not in err, f"{command}: {err}"
    assert not (tmp_path / "run").exists()
