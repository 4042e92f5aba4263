"""Seed features: model_update_frequency, experiment_logger_post(backend, ...) with text posts,
validation grouped by tag with success_rate, and nexrl_core.run(config) as a library call."""

from __future__ import annotations

import json

import pytest

import nexrl_core
from nexrl_core import execute
from nexrl_core.cli import main
from nexrl_core.runtime.eval_core import EvalState, SampleRecord, add_sample, summarize
from nexrl_core.runtime.run_log import RunRecorder
from nexrl_core.testing import make_recipe, write_recipe

MOCK = make_recipe(service={"inference_service": {"learn_steps": 3}}, trainer={"total_train_steps": 4})


# -- model_update_frequency ------------------------------------------------------------------------

def test_weights_are_pushed_every_n_steps(run_local):
    recipe = make_recipe(MOCK, weight={"sync_mode": "batch-async", "staleness_threshold": 2,
                                       "model_update_frequency": 2})
    controller, summary = run_local(recipe)
    assert summary.stopped_by == "finished" and summary.global_step == 4
    assert controller.weight_sync_controller.sync_count == 1 + 2  # the initial weights', then after steps 2, 4
    assert controller.inference_client.model_version() == 4
    versions = sorted({t["model_version"] for batch in controller.trainer.batches for t in batch})
    assert set(versions) <= {0, 2}  # rollouts only ever sampled pushed weights


def test_every_step_by_default(run_local):
    controller, summary = run_local(MOCK)
    assert controller.weight_sync_controller.sync_count == 1 + 4


@pytest.mark.parametrize("weight, expected", [
    ({"model_update_frequency": 2}, "weight.model_update_frequency: pushing weights every 2 steps lets rollouts lag "
                                    "2 versions behind the trainer: it needs weight.sync_mode batch-async or "
                                    "fully-async with weight.staleness_threshold >= 2 (now: sync, 0)"),
    ({"model_update_frequency": 0}, "weight.model_update_frequency: 0 is below the minimum 1"),
])
def test_a_frequency_the_sync_mode_cannot_honour_is_refused(weight, expected, tmp_path, core_pm, capfd, monkeypatch):
    monkeypatch.chdir(tmp_path)
    write_recipe(make_recipe(MOCK, weight=weight, run_dir=str(tmp_path / "run")), tmp_path / "r.yaml")
    assert main(["validate", "r.yaml"]) == 2
    err = capfd.readouterr().err
    assert expected.split(":")[0] in err and (expected in err or "model_update_frequency" in err), err


# -- experiment_logger_post ------------------------------------------------------------------------

class _Sink:
    def __init__(self):
        self.rows, self.texts = [], []

    def log(self, metrics, step):
        self.rows.append((step, metrics))

    def log_text(self, title, content, step):
        self.texts.append((step, title, content))


def test_a_post_goes_to_the_named_backend_and_texts_are_recorded(tmp_path):
    console, wandb, hook_calls = _Sink(), _Sink(), []
    recorder = RunRecorder(str(tmp_path), [console, wandb], sink_names=["console", "wandb"],
                           step_end_hook=lambda step, metrics: hook_calls.append(step))
    recorder.post("metrics", data={"train/num_trajectories": 4.0, "train/reward_mean": 0.5}, step=1)  # the trainer's
    recorder.post("wandb", data={"train/custom": 2.0}, step=1)  # a user's post: no second step-end call
    recorder.post("wandb", content="the model says hi", title="sample", step=1)
    recorder.post("all", title="note", content="both", step=2)
    assert hook_calls == [1]
    assert [r for _, r in console.rows] == [{"train/num_trajectories": 4.0, "train/reward_mean": 0.5}]
    assert [r for _, r in wandb.rows] == [{"train/num_trajectories": 4.0, "train/reward_mean": 0.5},
                                          {"train/custom": 2.0}]
    assert wandb.texts == [(1, "sample", "the model says hi"), (2, "note", "both")] and console.texts == [
        (2, "note", "both")]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r.get("train/custom") for r in rows] == [None, 2.0]  # every data post is a row of the run's record
    texts = [json.loads(line) for line in (tmp_path / "texts.jsonl").read_text().splitlines()]
    assert [(t["step"], t["title"], t["content"]) for t in texts] == [(1, "sample", "the model says hi"),
                                                                     (2, "note", "both")]


def test_a_post_to_a_backend_the_recipe_does_not_log_to_is_said_once(tmp_path, capfd, reset_loguru):
    sink = _Sink()
    recorder = RunRecorder(str(tmp_path), [sink], sink_names=["console"])
    for step in (1, 2):
        recorder.post("wandb", data={"x": 1.0}, step=step)
    assert sink.rows == []
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
    err = capfd.readouterr().err
    said = [line for line in err.splitlines()
            if "experiment_logger_post: backend 'wandb' is not in logger.backend (console)" in line]
    # once as a warning; a DEBUG sink another test of this process left may show the repeat as DEBUG
    assert [line for line in said if "WARNING" in line or "DEBUG" not in line] == said[:1] and said


# -- validation grouped by tag ---------------------------------------------------------------------

def _record(uid, reward, tag=None, failed=False):
    traj = {"uid": uid, "sample_index": 0, "score": {"reward": reward}, "failed": failed, "task": {"tag": tag}}
    return SampleRecord.from_trajectory(traj)


def test_validation_metrics_per_tag_with_success_rate():
    state = EvalState()
    for record in (_record("a", 1.0, "easy"), _record("b", 0.0, "easy"), _record("c", 1.0, "hard"),
                   _record("d", 1.0, "hard", failed=True), _record("e", 0.5)):
        state = add_sample(state, record)
    m = summarize(state)
    assert m["val/success_rate"] == pytest.approx(2 / 5)  # failed samples count, at reward 0
    assert m["val/easy/success_rate"] == 0.5 and m["val/easy/num_samples"] == 2.0
    assert m["val/hard/success_rate"] == 0.5 and m["val/hard/reward"] == 0.5
    assert m["val/none/success_rate"] == 0.0 and m["val/none/reward"] == 0.5
    untagged = add_sample(EvalState(), _record("a", 1.0))
    assert [k for k in summarize(untagged) if "success_rate" in k] == ["val/success_rate"]  # no per-tag ones


def test_every_validation_reports_its_success_rate_at_the_threshold():
    state = EvalState()
    for uid, reward, failed in (("a", 1.0, False), ("b", 0.75, False), ("c", 0.5, False), ("d", 1.0, True)):
        state = add_sample(state, _record(uid, 0.0 if failed else reward, failed=failed))
    assert summarize(state)["val/success_rate"] == 0.25  # the default threshold 1.0; a failed sample counts 0
    assert summarize(state, success_threshold=0.75)["val/success_rate"] == 0.5
    assert summarize(state, success_threshold=0.5)["val/success_rate"] == 0.75
    assert summarize(EvalState())["val/success_rate"] == 0.0


def test_an_untagged_validation_run_reports_its_success_rate(run_local, tmp_path):
    rows = [{"prompt": f"What is {a} + 1?", "answer": a + 1} for a in range(4)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(MOCK, trainer={"total_train_steps": 1},
                         validate={"validate_before_train": True, "success_threshold": 0.5,
                                   "data": {"type": "file", "path": "val.jsonl"}})
    controller, summary = run_local(recipe)
    first = summary.validation[0]
    assert [k for k in first if "success_rate" in k] == ["val/success_rate"]
    # the same number the validator's own samples give at the recipe's threshold
    rewards = [t["score"]["reward"] for t in execute(controller.validator.trajectories)]
    assert len(rewards) == 4 and first["val/success_rate"] == sum(r >= 0.5 for r in rewards) / 4


def test_a_validation_run_reports_each_tag(run_local, tmp_path):
    rows = [{"prompt": f"What is {a} + 1?", "answer": a + 1, "tag": "small" if a < 3 else "large"} for a in range(6)]
    (tmp_path / "val.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = make_recipe(MOCK, trainer={"total_train_steps": 1},
                         validate={"validate_before_train": True, "data": {"type": "file", "path": "val.jsonl"}})
    controller, summary = run_local(recipe)
    first = summary.validation[0] if isinstance(summary.validation, list) else summary.validation
    assert first["val/small/num_samples"] == 3.0 and first["val/large/num_samples"] == 3.0
    assert 0.0 <= first["val/success_rate"] <= 1.0


# -- nexrl_core.run --------------------------------------------------------------------------------

def test_the_controller_as_a_library_call(tmp_path, core_pm, reset_loguru, monkeypatch):
    monkeypatch.chdir(tmp_path)
    recipe = make_recipe(MOCK, run_dir=str(tmp_path / "run"), logger={"backend": [], "level": "WARNING"})
    summary = nexrl_core.run(recipe, ["trainer.total_train_steps=2"])
    assert summary.stopped_by == "finished" and summary.global_step == 2
    run = json.loads((tmp_path / "run" / "run.json").read_text())
    assert run["exit_status"] == "finished" and run["global_step"] == 2
    assert (tmp_path / "run" / "run.log").exists() and (tmp_path / "run" / "config.yaml").exists()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/reward_mean" in r] == [1, 2]
    with pytest.raises(nexrl_core.ConfigError, match="trainer.total_train_stepz: unknown key"):
        nexrl_core.run(make_recipe(recipe, trainer={"type": "mock", "total_train_stepz": 2}))
