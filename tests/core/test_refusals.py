"""What nexrl refuses rather than do wrongly (issue #29 items 5, 6, 8; docs/reliability.md):

- an output folder that cannot be written (a read-only folder; /proc and /sys are in the
  bad-input corpus) and an eval samples file that cannot be written: one `error:` line naming
  the key, before anything is built;
- a resume that cannot be exact: a checkpoint whose trainer saved no weights, one its trainer
  cannot load, one another trainer wrote;
- an evaluation that lost samples, or whose failed share is above the run's threshold.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from nexrl_core import BaseTrainer, hookimpl
from nexrl_core.builtins.evaluators import NumericAnswerEvaluator
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.builtins.workers import SimpleRolloutWorker
from nexrl_core.cli import main
from nexrl_core.testing import use_plugins

REPO = Path(__file__).resolve().parents[2]
BUILT: list[str] = []  # trainers constructed: none may be, when a run is refused


class ForgetfulTrainer(BaseTrainer):
    """Has weights (a number that training changes) and saves none: the base save_model_state."""

    def __init__(self, config: Any):
        super().__init__(config)
        BUILT.append(type(self).__name__)
        self.weights = 0.0

    def train(self, trajectories):
        self.weights += 1.0
        return {"train/loss": 0.0}

    def export_weights(self):
        return {}


class WriteOnlyTrainer(ForgetfulTrainer):
    """Saves its weights but cannot load them back (the base load_model_state)."""

    def save_model_state(self, folder: str) -> None:
        with open(os.path.join(folder, "weights.json"), "w", encoding="utf-8") as f:
            f.write(f'{{"weights": {self.weights}}}')


class RecordingMock(MockTrainer):
    def __init__(self, config: Any):
        super().__init__(config)
        BUILT.append(type(self).__name__)


class RecordingEvaluator(NumericAnswerEvaluator):
    def __init__(self, **options: Any):
        super().__init__(**options)
        BUILT.append(type(self).__name__)


class SameIndexWorker(SimpleRolloutWorker):
    """A buggy worker: every sample of a task goes in as sample 0, so the validator counts each
    prompt once and the others' samples are lost."""

    def _put_trajectory(self, trajectory):
        return super()._put_trajectory({**trajectory, "sample_index": 0})


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"forgetful": ForgetfulTrainer, "write_only": WriteOnlyTrainer, "recording_mock": RecordingMock}

    @hookimpl
    def nexrl_rollout_workers(self):
        return {"same_index": SameIndexWorker}

    @hookimpl
    def nexrl_evaluators(self):
        return {"recording": RecordingEvaluator}


# trainers declare "trainer:state_dict" like the mock so the version_only weight sync fits
ForgetfulTrainer.CAPABILITIES = MockTrainer.CAPABILITIES

RECIPE = {
    "data": {"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "2 + 2", "answer": "4"}]},
    "rollout_worker": {"num_workers": 2, "evaluator": {"type": "numeric_answer"}},
    "trajectory_pool": {"batch_size": 4, "group_size": 2},
    "trainer": {"type": "forgetful", "total_train_steps": 2, "save_freq": 1},
    "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
    "logger": {"level": "WARNING"},
    "runtime_monitor": {"stop_timeout": 10, "health_check": {"check_interval": 0.5},
                        "exception_handling": {"check_interval": 0.05}},
}


@pytest.fixture
def nexrl(tmp_path, capfd, reset_loguru, monkeypatch):
    """``nexrl(*argv)`` -> (exit code, stdout, stderr), with this file's plugin registered."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    BUILT.clear()

    def call(*argv: str):
        with use_plugins(Plugin()):
            code = main([str(a) for a in argv])
        out, err = capfd.readouterr()
        return code, out, err
    return call


def write_recipe(tmp_path: Path, **sections) -> Path:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **RECIPE, **sections}, sort_keys=False))
    return path


def errors(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("error: ")]


# -- resume that cannot be exact ---------------------------------------------------------------------

@pytest.mark.parametrize("trainer, why", [
    ("forgetful", "holds no model state (trainer 'forgetful' saved no weights: its save_model_state wrote "
                  "nothing), so a resumed run would go on from fresh weights"),
    ("write_only", "trainer 'write_only' cannot restore the weights of the checkpoint"),
])
def test_a_checkpoint_that_cannot_restore_the_weights_is_not_resumed(nexrl, tmp_path, trainer, why):
    recipe = write_recipe(tmp_path)
    code, _, err = nexrl("run", recipe, f"trainer.type={trainer}")
    assert code == 0, err
    latest = tmp_path / "run" / "checkpoints" / "global_step_2"
    assert latest.is_dir()
    for mode in (["resume.mode=auto"], ["resume.mode=from_path", f"resume.resume_path={latest}"]):
        key = "resume.mode" if mode == ["resume.mode=auto"] else "resume.resume_path"
        for command in ("validate", "run"):
            BUILT.clear()
            code, _, err = nexrl(command, recipe, f"trainer.type={trainer}", "trainer.total_train_steps=3", *mode)
            assert code == 2, err
            assert len(errors(err)) == 1 and errors(err)[0].startswith(f"error: {key}: "), err
            assert why in err and str(latest) in err
            assert BUILT == []  # refused before any component was built
    assert [p.name for p in sorted((tmp_path / "run" / "checkpoints").iterdir())] == ["global_step_1", "global_step_2"]


def test_a_trainer_with_nothing_to_save_resumes_and_another_trainers_checkpoint_is_refused(nexrl, tmp_path):
    """The mock trainer keeps nothing between steps (NO_MODEL_STATE): its checkpoints resume. A
    checkpoint written by another trainer is refused."""
    recipe = write_recipe(tmp_path, trainer={"type": "recording_mock", "total_train_steps": 2, "save_freq": 1})
    assert nexrl("run", recipe)[0] == 0
    code, out, err = nexrl("run", recipe, "resume.mode=auto", "trainer.total_train_steps=3")
    assert code == 0, err
    assert '"global_step": 3' in out.splitlines()[-1]
    for command in ("validate", "run"):
        code, _, err = nexrl(command, recipe, "resume.mode=auto", "trainer.type=forgetful")
        assert code == 2 and len(errors(err)) == 1, err
        assert "was written by trainer 'recording_mock', and this recipe's trainer.type is 'forgetful'" in err


# -- output paths --------------------------------------------------------------------------------------

def _without_root_file_powers() -> None:
    """In the child, before exec: drop CAP_DAC_OVERRIDE and CAP_DAC_READ_SEARCH from the bounding
    set, so that root, too, is held to a folder's permissions."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    for cap in (1, 2):
        if libc.prctl(24, cap, 0, 0, 0) != 0:  # PR_CAPBSET_DROP
            raise OSError(ctypes.get_errno(), "prctl(PR_CAPBSET_DROP)")


def test_a_read_only_run_dir_is_one_line_before_anything_is_built(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o555)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({**RECIPE, "trainer": {"type": "mock", "total_train_steps": 1}}))
    env = dict(os.environ, NEXRL_LOAD_PLUGINS="", PYTHONPATH=str(REPO))
    script = Path(sys.executable).parent / "nexrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nexrl_core.cli"]
    try:
        for command in ("validate", "run"):
            proc = subprocess.run([*cmd, command, str(recipe), f"run_dir={ro / 'run'}"], capture_output=True,
                                  text=True, env=env, cwd=tmp_path, timeout=120,
                                  preexec_fn=_without_root_file_powers if os.geteuid() == 0 else None)
            assert proc.returncode == 2, proc.stderr
            assert proc.stderr.strip() == (f"error: run_dir: cannot create '{ro / 'run'}': '{ro}' does not take new "
                                           f"folders (permission denied)")
    except subprocess.SubprocessError as exc:  # root that may not drop its powers (no CAP_SETPCAP)
        pytest.skip(f"cannot make a folder read-only for root here: {exc}")
    finally:
        ro.chmod(0o755)
    assert list(ro.iterdir()) == []


def test_an_unwritable_tensorboard_folder_is_one_line(nexrl, tmp_path):
    pytest.importorskip("tensorboardX")
    recipe = write_recipe(tmp_path, trainer={"type": "recording_mock", "total_train_steps": 1})
    for command in ("validate", "run"):
        code, _, err = nexrl(command, recipe, "logger.backend=[tensorboard]",
                             "+logger.tensorboard.log_dir=/sys/nexrl-tb")
        assert code == 2 and len(err.strip().splitlines()) == 1, err
        assert err.startswith("error: logger.tensorboard.log_dir: cannot create '/sys/nexrl-tb': '/sys' does not take "
                              "new folders")
        assert BUILT == [] and not (tmp_path / "run").exists()


@pytest.mark.parametrize("option, where, message", [
    ("--samples-out", "/proc/nexrl-test/samples.jsonl", "error: --samples-out: cannot create '/proc/nexrl-test': "
                                                        "'/proc' does not take new folders"),
    ("--samples-out", "{tmp}", "error: --samples-out: '{tmp}' is a folder; give a file name"),
    ("--out", "/sys/nexrl-test", "error: --out: cannot create '/sys/nexrl-test': '/sys' does not take new folders"),
])
def test_an_eval_samples_file_that_cannot_be_written_is_refused_before_the_evaluation(nexrl, tmp_path, option,
                                                                                       where, message):
    recipe = write_recipe(tmp_path, rollout_worker={"num_workers": 2, "evaluator": {"type": "recording"}},
                          validate={"data": {"type": "inline", "rows": [{"prompt": "1 + 1", "answer": "2"}]}})
    assert nexrl("eval", recipe)[0] == 0 and BUILT  # the evaluation builds the evaluator
    BUILT.clear()
    where, message = where.format(tmp=tmp_path), message.format(tmp=tmp_path)
    code, out, err = nexrl("eval", recipe, option, where)
    assert code == 2 and err.strip().startswith(message) and len(errors(err)) == 1, err
    assert out == "" and BUILT == []


# -- nexrl eval: an evaluation that does not count -------------------------------------------------------

VAL = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a, b in [(1, 1), (2, 3), (4, 0), (9, 9)]]
FAILING = {"prompt": "", "answer": "0"}  # no prompt: a failed sample


def _eval_recipe(tmp_path: Path, rows: list[dict], **rollout) -> Path:
    return write_recipe(tmp_path, trainer={"type": "recording_mock", "total_train_steps": 1},
                        validate={"n_samples": 2, "data": {"type": "inline", "rows": rows}},
                        rollout_worker={"num_workers": 2, "evaluator": {"type": "numeric_answer"}, **rollout})


def test_eval_exits_1_when_more_samples_failed_than_a_run_accepts(nexrl, tmp_path):
    recipe = _eval_recipe(tmp_path, VAL[:1] + [FAILING] * 3)  # 6 of 8 samples fail
    code, out, err = nexrl("eval", recipe, "--out", tmp_path / "eval")
    assert code == 1
    assert errors(err) == ["error: 6 of 8 samples failed (more than runtime_monitor.failed_samples.max_fraction=0.5); "
                           "most common error: " + errors(err)[0].split("most common error: ")[1]]
    assert '"val/num_failed": 6.0' in out  # the summary is printed and written all the same
    assert (tmp_path / "eval" / "metrics.json").is_file() and (tmp_path / "eval" / "samples.jsonl").is_file()
    # the run's own threshold decides: raised, or the check turned off, the same evaluation counts
    for setting in ("runtime_monitor.failed_samples.max_fraction=0.8", "runtime_monitor.failed_samples.enabled=false"):
        code, _, err = nexrl("eval", recipe, setting)
        assert code == 0, err
    code, _, err = nexrl("eval", _eval_recipe(tmp_path, VAL[:3] + [FAILING]))  # 2 of 8: within the threshold
    assert code == 0, err


def test_eval_exits_1_when_samples_are_missing(nexrl, tmp_path):
    recipe = _eval_recipe(tmp_path, VAL, type="same_index")
    code, out, err = nexrl("eval", recipe)
    assert code == 1
    assert errors(err) == ["error: 4 of 8 expected samples are missing (validate.data rows x validate.n_samples): a "
                           "rollout worker lost them; the metrics cover only the others"]
    assert '"val/num_missing": 4.0' in out
    code, _, err = nexrl("eval", _eval_recipe(tmp_path, VAL))  # the same with a sound worker
    assert code == 0, err
