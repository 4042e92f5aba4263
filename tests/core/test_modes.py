"""The three weight-sync modes end to end through NexRLController with mock components
(docs/evaluation.md §Weight-sync modes, §Staleness, §Grouped pool, §Weight version).

For each mode, with several rollout workers: the run finishes; ``train/staleness_max`` in
metrics.jsonl never exceeds the mode's bound (exactly 0 in sync mode); weights are pushed after
every train step (the regression test for NexRL's fully-async mode, which never pushed); every
batch is whole groups of one version; every validation sees one weight version and is logged
under it. Fully-async never blocks a rollout and keeps generating while the trainer trains.
"""

from __future__ import annotations

import json
import os

import pytest
import yaml
from loguru import logger

from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager
from nexrl_core.testing import make_recipe

pytestmark = pytest.mark.timeout(120)  # a deadlock fails the test instead of hanging the suite

TRAIN_ROWS = [{"prompt": f"{a} + {b}", "answer": str(a + b)} for a, b in
              [(1, 2), (3, 4), (5, 6), (7, 8), (2, 9), (4, 4), (6, 1), (8, 3)]]
VAL_ROWS = [{"prompt": f"{a} + {b}", "answer": str(a + b), "data_source": src} for a, b, src in
            [(1, 1, "easy"), (2, 3, "easy"), (9, 9, "hard"), (7, 6, "hard")]]
STEPS = 6


@pytest.fixture(autouse=True, scope="module")
def _quiet():
    logger.disable("nexrl_core")
    yield
    logger.enable("nexrl_core")


def recipe(tmp_path, mode, threshold, validate_freq=3, validate_before_train=True, step_time=0.02):
    return make_recipe(
        run_dir=str(tmp_path / "run"), logger={"backend": []},
        data={"type": "inline", "rows": TRAIN_ROWS},
        validate={"validate_before_train": validate_before_train, "n_samples": 2,
                  "data": {"type": "inline", "rows": VAL_ROWS}},
        rollout_worker={"num_workers": 4, "evaluator": {"type": "exact_match"}},
        trajectory_pool={"key_list": ["uid"]},
        trainer={"total_train_steps": STEPS, "step_time_s": step_time},
        weight={"sync_mode": mode, "staleness_threshold": threshold, "validate_freq": validate_freq},
        service={"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 4, "delay_s": 0.003}})


class Instrumented:
    """A real controller whose seams record what happened (pushes, blocks, validations)."""

    def __init__(self, tmp_path, cfg_dict):
        path = tmp_path / "recipe.yaml"
        path.write_text(yaml.safe_dump(cfg_dict))
        self.c = NexRLController(load_recipe(str(path)), plugin_manager=PluginManager(load_entrypoints=False))
        self.pushed: list[int] = []
        self.statuses: list[str] = []
        self.validations: list[tuple[int | None, set[int], int]] = []
        self.calls_during_train: list[int] = []
        client, wsc, validator, trainer = self.c.inference_client, self.c.weight_sync_controller, \
            self.c.validator, self.c.trainer

        set_version = client.set_model_version

        def record_push(version):
            self.pushed.append(version)
            set_version(version)
        client.set_model_version = record_push

        check = wsc.check_rollout_service_status

        def record_status(*a, **k):
            status = check(*a, **k)
            self.statuses.append(status)
            return status
        wsc.check_rollout_service_status = record_status

        compute = validator.compute_and_log_metrics

        def record_validation(step=None):
            trajs = validator.trajectories()
            self.validations.append((step, {t["model_version"] for t in trajs}, len(trajs)))
            return compute(step)
        validator.compute_and_log_metrics = record_validation

        train = trainer.train

        def record_train(trajectories):
            before = client.calls
            out = train(trajectories)
            self.calls_during_train.append(client.calls - before)
            return out
        trainer.train = record_train

    def run(self):
        summary = self.c.run()
        path = os.path.join(str(self.c._config.run_dir), "metrics.jsonl")
        with open(path, encoding="utf-8") as f:
            rows = [json.loads(line) for line in f]
        return summary, rows


MODES = [("sync", 0), ("batch-async", 0), ("batch-async", 1), ("fully-async", 1), ("fully-async", 2)]


@pytest.mark.parametrize("mode,threshold", MODES)
def test_mode_end_to_end(tmp_path, mode, threshold):
    run = Instrumented(tmp_path, recipe(tmp_path, mode, threshold))
    summary, rows = run.run()
    c = run.c
    bound = 0 if mode == "sync" else threshold

    # the run finishes
    assert summary.stopped_by == "finished" and summary.global_step == STEPS

    # docs/evaluation.md §Staleness: train/staleness_max never exceeds the bound (0 in sync)
    train_rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    for r in train_rows:
        assert 0 <= r["train/staleness_mean"] <= r["train/staleness_max"] <= bound, r
        if mode == "sync":
            assert r["train/staleness_max"] == 0

    # docs/evaluation.md §Weight-sync modes: weights pushed at start-up and after every step, in every mode
    assert run.pushed == list(range(STEPS + 1))
    assert c.weight_sync_controller.sync_count == STEPS + 1
    assert c.inference_client.model_version() == c.trainer.global_step == STEPS

    # docs/evaluation.md §Grouped pool and §Staleness, checked on what the trainer actually got:
    # step i trains with weights version i - 1
    assert len(c.trainer.batches) == STEPS
    for i, batch in enumerate(c.trainer.batches, 1):
        groups: dict[str, list[dict]] = {}
        for t in batch:
            groups.setdefault(t["uid"], []).append(t)
        for uid, group in groups.items():
            assert sorted(t["sample_index"] for t in group) == [0, 1], (i, uid)
            assert len({t["model_version"] for t in group}) == 1, (i, uid)
        assert all(0 <= (i - 1) - t["model_version"] <= bound for t in batch), i

    # docs/evaluation.md §Weight version: each validation on one version, logged under it
    assert [step for step, _, _ in run.validations] == [0, 3, 6]
    for step, versions, count in run.validations:
        assert versions == {step} and count == len(VAL_ROWS) * 2
    val_rows = [r for r in rows if "val/num_samples" in r]
    assert [r["step"] for r in val_rows] == [0, 3, 6]
    assert all(r["val/num_samples"] == 8 and r["val/num_missing"] == 0 for r in val_rows)

    if mode == "sync":
        assert "block" in run.statuses  # sync mode does hold rollouts back while a batch is pending


def test_fully_async_never_blocks_rollouts(tmp_path):
    # docs/evaluation.md §Weight-sync modes: fully-async never blocks (no validation in this run)
    run = Instrumented(tmp_path, recipe(tmp_path, "fully-async", 1, validate_freq=0, validate_before_train=False,
                                        step_time=0.05))
    summary, rows = run.run()
    assert summary.stopped_by == "finished"
    assert run.statuses and set(run.statuses) == {"continue"}
    assert sum(run.calls_during_train) > 0  # rollouts kept generating while the trainer trained
    assert run.pushed == list(range(STEPS + 1))
    assert max(r["train/staleness_max"] for r in rows if "train/staleness_max" in r) <= 1
