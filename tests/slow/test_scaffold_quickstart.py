"""A scaffold trains the quickstart when selected (issue 30 item 4): ``nexrl new worker NAME``
writes a package, pip installs it (``--no-deps --target``), and ``nexrl run
recipes/quickstart.yaml rollout_worker.type=NAME`` trains the real SmolLM2-135M-Instruct for a
step with it: the entry point is found in a fresh process, every sampled prompt carries the
worker's instruction, and the step trains (finite loss, on-policy). Skips as
tests/slow/test_quickstart.py does when the model wheel or nexrl-grpo is missing."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import yaml

from nexrl_core.cli import main
from nexrl_core.cli.scaffold import names
from tests.slow.test_quickstart import REPO_ROOT, _nexrl_cmd, _skip_reason
from tests.support.metrics import read_metrics

STEPS = 1  # the entry point, the instruction and an on-policy step show in one
INSTRUCTION = "Reply with the number only. "


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_scaffolded_worker_trains_the_quickstart(tmp_path):
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    n = names("answer-first", "worker")
    assert main(["new", "worker", "answer-first", "--dir", str(tmp_path)]) == 0
    site = tmp_path / "site"
    done = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index",
                           "--no-build-isolation", "--target", str(site), str(tmp_path / n["dist"])],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]

    run_dir = tmp_path / "run"
    overrides = [f"rollout_worker.type={n['name']}", f"+rollout_worker.instruction='{INSTRUCTION}'",
                 f"trainer.total_train_steps={STEPS}", "validate.validate_before_train=false", f"run_dir={run_dir}",
                 "rollout_worker.num_workers=16", "+service.train_service.num_threads=1",
                 "+service.inference_service.num_threads=1"]
    env = {k: v for k, v in os.environ.items() if k not in ("NEXRL_LOAD_PLUGINS", "PYTHONPATH")}
    env.update(PYTHONPATH=str(site), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(_nexrl_cmd() + ["run", "recipes/quickstart.yaml", *overrides], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=780)
    assert proc.returncode == 0, f"nexrl run exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["global_step"] == STEPS and summary["stopped_by"] == "finished", summary

    train = {r["step"]: r for r in read_metrics(run_dir) if "train/reward_mean" in r}
    assert sorted(train) == list(range(1, STEPS + 1))
    for step, row in train.items():
        assert math.isfinite(row["train/loss"]) and math.isfinite(row["train/grad_norm"]), (step, row)
        assert row["train/num_trajectories"] == 16
    assert abs(train[1]["train/ppo_kl"]) < 1e-6  # the scaffold's trajectories carry what the trainer scores
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x.strip()]
    assert samples and all(INSTRUCTION in str(s["prompt"]) for s in samples), samples[:2]
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["rollout_worker"]["type"] == n["name"]
    assert f"{n['dist']} 0.1.0" in proc.stderr + proc.stdout  # the run's header lists the installed plugin
