"""SIGTERM / SIGINT on `nexrl run` (a subprocess): a clean stop with exit code 130, workers
drained, metrics.jsonl made of complete lines, and with ``trainer.save_on_stop`` a final
checkpoint that ``resume.mode=auto`` continues from."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest

from nexrl_core.checkpoint import CORE_STATE_FILE
from nexrl_core.testing import write_recipe
from tests.reliability.helpers import grpo_recipe

pytestmark = pytest.mark.timeout(300)


def train_steps(run_dir: Path, running: bool = False) -> list[int]:
    """Steps of the training rows; every line must be a complete JSON object (``running``: the
    run may be writing the last line right now, ignore it)."""
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    lines = path.read_text().split("\n")
    lines = lines[:-1] if running else lines  # the text after the last newline
    return [json.loads(line)["step"] for line in lines if "train/reward_mean" in line]


def assert_clean_stop(run, run_dir: Path) -> int:
    """Exit 130 after a drained stop; returns the step of the save_on_stop checkpoint."""
    assert run.wait(120) == 130, run.output()[-4000:]
    out = run.output()
    assert "Traceback" not in out and "still running after" not in out, out[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["stopped_by"] == "signal"
    text = (run_dir / "metrics.jsonl").read_text()
    assert text.endswith("\n")
    for line in text.splitlines():
        json.loads(line)  # complete lines only
    steps = train_steps(run_dir)
    assert steps == list(range(1, len(steps) + 1))
    ckpt = run_dir / "checkpoints"
    names = os.listdir(ckpt)
    assert names == [f"global_step_{steps[-1]}"], names  # save_freq 0: only the save-on-stop checkpoint
    assert (ckpt / names[0] / CORE_STATE_FILE).exists()
    return steps[-1]


def test_sigterm_stops_cleanly_and_the_stop_checkpoint_resumes(tiny_model_dir, start_run, tmp_path):
    recipe = grpo_recipe(tmp_path / "run", tiny_model_dir)
    recipe["trainer"].update({"total_train_steps": 200, "save_freq": 0, "save_on_stop": True})
    recipe["validate"]["validate_before_train"] = False
    path = write_recipe(recipe, tmp_path / "recipe.yaml")

    run = start_run(path)
    run.wait_for(lambda: len(train_steps(tmp_path / "run", running=True)) >= 2)
    run.signal(signal.SIGTERM)
    stopped_at = assert_clean_stop(run, tmp_path / "run")
    assert stopped_at < 200

    resumed = start_run(path, "resume.mode=auto", f"trainer.total_train_steps={stopped_at + 2}")
    assert resumed.wait() == 0, resumed.output()[-4000:]
    assert f"resumed from {tmp_path / 'run' / 'checkpoints' / f'global_step_{stopped_at}'} at step {stopped_at}" \
        in resumed.output()
    assert train_steps(tmp_path / "run") == list(range(1, stopped_at + 3))


def _mock_recipe(run_dir: Path, **trainer) -> dict:
    return {
        "run_dir": str(run_dir),
        "data": {"type": "inline", "rows": [{"prompt": f"What is {a} + 1?", "answer": str(a + 1)} for a in range(6)]},
        "rollout_worker": {"num_workers": 2},
        "trajectory_pool": {"batch_size": 4, "group_size": 2, "key_list": ["uid"]},
        "trainer": {"type": "mock", "total_train_steps": 100000, "step_time_s": 0.02, "save_on_stop": True,
                    **trainer},
        "service": {"inference_service": {"backend": "mock", "mode": "sum"}},
        "logger": {"backend": ["console"], "level": "INFO"},
        "runtime_monitor": {"stop_timeout": 10, "exception_handling": {"check_interval": 0.05}},
    }


CORE_ONLY = {"NEXRL_LOAD_PLUGINS": ""}  # nexrl-core alone: no torch import, a fast start


def test_sigint_with_the_mock_trainer_and_auto_resume(start_run, tmp_path):
    path = write_recipe(_mock_recipe(tmp_path / "run"), tmp_path / "recipe.yaml")
    run = start_run(path, env=CORE_ONLY)
    run.wait_for(lambda: len(train_steps(tmp_path / "run", running=True)) >= 3)
    run.signal(signal.SIGINT)
    stopped_at = assert_clean_stop(run, tmp_path / "run")
    state = json.loads((tmp_path / "run" / "checkpoints" / f"global_step_{stopped_at}" / CORE_STATE_FILE).read_text())
    assert state["global_step"] == stopped_at

    resumed = start_run(path, "resume.mode=auto", f"trainer.total_train_steps={stopped_at + 3}", env=CORE_ONLY)
    assert resumed.wait() == 0, resumed.output()[-4000:]
    assert f"at step {stopped_at}" in resumed.output()
    assert train_steps(tmp_path / "run") == list(range(1, stopped_at + 4))


def test_sigterm_during_validation_exits_130(start_run, tmp_path):
    """Stopped before the first step (inside the pre-training validation): still a clean 130,
    no checkpoint (nothing was trained)."""
    recipe = _mock_recipe(tmp_path / "run")
    recipe["rollout_worker"]["num_workers"] = 1
    recipe["service"]["inference_service"]["delay_s"] = 0.2  # 30 samples, one worker: a 6 s validation
    recipe["validate"] = {"validate_before_train": True, "data": {
        "type": "inline", "rows": [{"prompt": f"{a} + 2", "answer": str(a + 2)} for a in range(30)]}}
    path = write_recipe(recipe, tmp_path / "recipe.yaml")
    run = start_run(path, env=CORE_ONLY)
    log = tmp_path / "run" / "run.log"
    run.wait_for(lambda: log.exists() and "validation started" in log.read_text())
    run.signal(signal.SIGTERM)
    assert run.wait(60) == 130, run.output()[-4000:]
    out = run.output()
    assert "Traceback" not in out and "error:" not in out, out[-4000:]
    assert json.loads(out.strip().splitlines()[-1])["stopped_by"] == "signal"
    assert not train_steps(tmp_path / "run")
    assert not (tmp_path / "run" / "checkpoints").exists()
