"""Weight-sync modes and GRPO algorithm variants through the real controller with the installed
nexrl-grpo plugin on the tiny Llama.

- ``sync``, ``batch-async`` (staleness_threshold 1) and ``fully-async`` (staleness_threshold 1),
  each with several rollout workers: the run finishes; ``train/staleness_max`` never exceeds
  the mode's bound (0 in sync mode) and no batch holds data older than the bound; weights are
  pushed to the engine after every step (NexRL's fully-async never pushed), so at the end the
  engine serves version == global_step with the trainer's tensors.
- ``algorithm.loss_agg_mode`` (seq-mean-token-mean, token-mean, seq-mean-token-sum-norm) and
  ``use_kl_in_reward`` with a fixed and an adaptive ``kl_ctrl``: each trains without error and
  logs finite metrics; the KL coefficient stays put (fixed) or moves (adaptive).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from tests.support.letters import grpo_plugin_manager
from tests.support.torch_fixtures import TINY_RUN_MONITOR, tiny_services

PROMPTS = ["the quick", "what is", "count: one", "hello world", "jumps over", "two plus"]
GROUP = 4
BATCH = 2 * GROUP




def recipe(run_dir: Path, model_dir: str, steps: int, sync_mode: str = "sync", staleness: int = 0,
           num_workers: int = 4, algorithm: dict | None = None) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 3,
        "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": p} for p in PROMPTS]},
        "rollout_worker": {"num_workers": num_workers, "sampling": {"max_tokens": 5, "temperature": 1.0},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": BATCH, "group_size": GROUP, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": steps},
        "algorithm": algorithm or {},
        "weight": {"sync_mode": sync_mode, "staleness_threshold": staleness, "backend": "in_process"},
        "service": tiny_services(model_dir),
        "runtime_monitor": TINY_RUN_MONITOR,
    }


class Run:
    """A real controller; the engine's version changes and each batch's data versions are recorded."""

    def __init__(self, tmp_path: Path, cfg: dict):
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(cfg, sort_keys=False))
        self.c = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
        self.pushed: list[int] = []
        self.batches: list[tuple[int, list[int]]] = []  # (train version before the step, data versions)
        engine, trainer = self.c.inference_client, self.c.trainer
        set_version = engine.set_model_version

        def record_push(version):  # load_weights ends with set_model_version; version 0 calls it directly
            set_version(version)
            self.pushed.append(version)
        engine.set_model_version = record_push

        train = trainer.train

        def record_batch(trajectories):
            self.batches.append((trainer.global_step, [int(t["model_version"]) for t in trajectories]))
            return train(trajectories)
        trainer.train = record_batch

        self.summary = self.c.run()
        self.run_dir = Path(cfg["run_dir"])
        rows = [json.loads(x) for x in (self.run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
        self.train_rows = [r for r in rows if "train/reward_mean" in r]


@pytest.mark.parametrize("mode,staleness", [("sync", 0), ("batch-async", 1), ("fully-async", 1)])
def test_weight_sync_modes(tiny_model_dir, tmp_path, mode, staleness):
    steps = 4
    run = Run(tmp_path, recipe(tmp_path / "run", tiny_model_dir, steps, mode, staleness, num_workers=6))
    c = run.c
    assert run.summary.stopped_by == "finished" and run.summary.global_step == steps, run.summary
    assert run.summary.errors == []
    assert c.weight_sync_controller.sync_mode == mode
    bound = 0 if mode == "sync" else staleness

    assert [r["step"] for r in run.train_rows] == list(range(1, steps + 1))
    for row in run.train_rows:
        assert row["train/staleness_max"] <= bound, f"{mode}: step {row['step']} staleness {row['train/staleness_max']}"
        assert row["train/num_trajectories"] == BATCH
    for version_before, data_versions in run.batches:
        assert all(version_before - bound <= v <= version_before for v in data_versions), \
            f"{mode}: step {version_before + 1} trained on versions {data_versions}"
    if mode == "sync":
        assert all(set(v) == {before} for before, v in run.batches)

    # Weights pushed after every step, in order, and the engine ends on the trainer's weights.
    assert run.pushed == list(range(steps + 1)), f"{mode}: pushed versions {run.pushed}"
    engine, trainer = c.inference_client, c.trainer
    assert engine.model_version() == trainer.global_step == steps
    served, trained = engine.model.state_dict(), trainer.train_service.model.state_dict()
    assert all(torch.equal(served[k], trained[k]) for k in trained)
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    assert any(not torch.equal(initial[k], trained[k]) for k in initial), f"{mode}: training never moved the weights"


def _assert_finite(rows: list[dict]) -> None:
    for row in rows:
        for key, value in row.items():
            if isinstance(value, (int, float)):
                assert math.isfinite(value), f"step {row['step']}: {key}={value}"


@pytest.mark.parametrize("loss_agg_mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_loss_agg_modes(tiny_model_dir, tmp_path, loss_agg_mode):
    run = Run(tmp_path, recipe(tmp_path / "run", tiny_model_dir, 1, algorithm={"loss_agg_mode": loss_agg_mode}))
    assert run.summary.stopped_by == "finished" and run.summary.global_step == 1
    assert run.c.trainer.selection.options["loss_agg_mode"] == loss_agg_mode
    (row,) = run.train_rows
    _assert_finite([row])
    for key in ("train/loss", "train/grad_norm", "train/ppo_kl", "train/pg_clipfrac", "train/reward_mean"):
        assert key in row
    assert abs(row["train/ppo_kl"]) < 1e-3


@pytest.mark.parametrize("kl_ctrl", [{"type": "fixed", "kl_coef": 0.05},
                                     {"type": "adaptive", "kl_coef": 0.05, "target_kl": 0.1, "horizon": 100}],
                         ids=["fixed", "adaptive"])
def test_kl_in_reward(tiny_model_dir, tmp_path, kl_ctrl):
    algorithm = {"use_kl_in_reward": True, "kl_penalty": "kl", "kl_ctrl": kl_ctrl}
    run = Run(tmp_path, recipe(tmp_path / "run", tiny_model_dir, 2, algorithm=algorithm))
    assert run.summary.stopped_by == "finished" and run.summary.global_step == 2
    rows = run.train_rows
    assert [r["step"] for r in rows] == [1, 2]
    _assert_finite(rows)
    kl = [r["train/kl_penalty"] for r in rows]
    coef = [r["train/kl_coef"] for r in rows]
    # Step 1 samples from the reference weights: no KL yet; step 2's rollouts come from v1.
    assert abs(kl[0]) < 1e-4 and kl[1] > 0, kl
    assert coef[0] == pytest.approx(0.05)
    if kl_ctrl["type"] == "fixed":
        assert coef[1] == pytest.approx(0.05)
    else:  # KL 0 < target: the coefficient shrinks by the clipped proportional error
        assert coef[1] == pytest.approx(0.05 * (1 - 0.2 * BATCH / 100))
    state = run.c.trainer.algorithm_state()
    assert math.isfinite(state["kl_coef"])
