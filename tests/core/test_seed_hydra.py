"""The seed guide's way of starting a run: a ``@hydra.main`` script that hands its DictConfig to
``NexRLController(config)`` and calls ``.run()``. The config is seed-shaped (no resume, logger,
runtime_monitor ... sections): the controller composes nexrl's defaults into it as
``nexrl_core.run(config)`` does, checks it as ``nexrl validate`` does and records the run."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

from nexrl_core import ConfigError
from nexrl_core.controller import NexRLController
from nexrl_core.launch.prologue import is_loaded
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.testing import write_recipe

# The seed's main configuration keys only: no resume, logger, runtime_monitor, ray, run_dir.
SEED_CONFIG = """\
launch_mode: ray
project_name: seed_hydra
experiment_name: hydra_mock
data:
  type: arithmetic
  num_rows: 16
  max_value: 9
rollout_worker:
  type: simple
  num_workers: 2
  evaluator:
    type: numeric_answer
trajectory_pool:
  batch_size: 4
  group_size: 2
trainer:
  type: mock
  total_train_steps: 2
weight:
  sync_mode: sync
service:
  inference_service:
    backend: mock
    mode: sum
    learn_steps: 2
validate:
  validate_before_train: true
  data:
    type: arithmetic
    num_rows: 4
    max_value: 9
"""

# The seed guide's "Basic Local Usage", with nexrl's package name.
TRAIN_PY = """\
import json

import hydra
from omegaconf import DictConfig

from nexrl_core import NexRLController


@hydra.main(version_base=None, config_path="config", config_name="rl_train")
def main(config: DictConfig):
    config.launch_mode = "local"
    controller = NexRLController(config)
    summary = controller.run()
    print("SUMMARY " + json.dumps({"global_step": summary.global_step, "stopped_by": summary.stopped_by,
                                   "validation": summary.validation}))


if __name__ == "__main__":
    main()
"""


def _script(tmp_path):
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "rl_train.yaml").write_text(SEED_CONFIG)
    (tmp_path / "train.py").write_text(TRAIN_PY)
    return tmp_path / "train.py"


def _run_script(tmp_path, *overrides):
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "", "HYDRA_FULL_ERROR": "1"}
    return subprocess.run([sys.executable, str(_script(tmp_path)), *overrides], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=240)


def test_a_hydra_main_trains_through_the_controller_and_records_the_run(tmp_path):
    done = _run_script(tmp_path, "trainer.total_train_steps=3")
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("SUMMARY "))[8:])
    assert summary["stopped_by"] == "finished" and summary["global_step"] == 3  # the command line's override
    assert summary["validation"] and 0.0 <= summary["validation"][0]["val/success_rate"] <= 1.0

    run_dir = tmp_path / "runs" / "hydra_mock"  # run_dir's default, runs/${experiment_name}, in the start folder
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2, 3]
    assert any("val/num_samples" in r for r in rows)
    run = json.loads((run_dir / "run.json").read_text())
    assert run["exit_status"] == "finished" and run["exit_code"] == 0 and run["global_step"] == 3
    assert run["recipe"] == str(tmp_path / "config" / "rl_train.yaml")
    assert run["overrides"] == ["trainer.total_train_steps=3"] and run["launch_mode"] == "local"
    assert (run_dir / "run.log").exists()
    config = (run_dir / "config.yaml").read_text()  # the composed recipe: nexrl's defaults filled in
    for section in ("resume:", "logger:", "runtime_monitor:"):
        assert f"\n{section}" in config


def test_a_hydra_main_with_a_bad_key_stops_with_what_validate_says(tmp_path):
    done = _run_script(tmp_path, "+trainer.total_train_stepz=3")
    assert done.returncode != 0
    assert "trainer.total_train_stepz: unknown key" in done.stderr and "total_train_steps" in done.stderr
    assert "Missing key" not in done.stderr
    assert not (tmp_path / "runs" / "hydra_mock" / "metrics.jsonl").exists()  # refused before anything ran


# -- in-process: which configs are composed ---------------------------------------------------------

def _seed_config(tmp_path, **changes):
    cfg = OmegaConf.create(SEED_CONFIG)
    cfg.launch_mode = "local"
    cfg.run_dir = str(tmp_path / "run")
    OmegaConf.set_struct(cfg, True)  # as Hydra hands it over
    for key, value in changes.items():
        OmegaConf.update(cfg, key, value, force_add=True)
    return cfg


def test_a_seed_shaped_dictconfig_is_composed_and_a_loaded_one_kept(tmp_path, core_pm, reset_loguru, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _seed_config(tmp_path)
    assert not is_loaded(cfg)
    loaded = load_recipe(write_recipe(OmegaConf.to_container(cfg), tmp_path / "recipe.yaml"))
    assert is_loaded(loaded)

    controller = NexRLController(cfg, plugin_manager=core_pm)
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == 2
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["recipe"] == "<NexRLController>" and run["exit_status"] == "finished"
    assert "resume" not in cfg  # the caller's config is left as it was


def test_a_seed_shaped_config_is_checked_as_validate_checks_it(tmp_path, core_pm, reset_loguru, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as info:
        NexRLController(_seed_config(tmp_path, **{"trainer.total_train_stepz": 2, "resume.mode": "sometimes"}),
                        plugin_manager=core_pm)
    message = str(info.value)
    assert "trainer.total_train_stepz: unknown key" in message and "resume.mode" in message
    assert not (tmp_path / "run").exists()  # nothing written for a recipe that does not pass


def test_run_json_records_how_a_seed_style_run_ended(tmp_path, core_pm, reset_loguru, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _seed_config(tmp_path)
    controller = NexRLController(cfg, plugin_manager=core_pm)
    controller.request_stop("SIGTERM")
    summary = controller.run()
    assert summary.stopped_by == "signal"
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["exit_status"] == "signal" and run["exit_code"] == 0
