"""One trajectory shape from the worker to the trainer: the pool hands out the rows it was given
(no columns, no ``None`` for a key a row lacks), the trainer writes nothing into them, and what a
trainer computes per sample (:class:`~nexrl_core.SampleResult`) reaches samples.jsonl beside them."""

from __future__ import annotations

import copy
import dataclasses
import json
import pickle

import pytest
from omegaconf import OmegaConf

from nexrl_core import (
    EvaluationRunResult,
    Evaluator,
    SampleResult,
    TrainOutput,
    TrajectoryBatch,
    TrajectoryPool,
    hookimpl,
)
from nexrl_core.builtins.mock import MockTrainer
from nexrl_core.controller import RunFailed
from nexrl_core.testing.kit import run_recipe
from nexrl_core.trainer import SAMPLE_FIELDS, SAMPLE_RESULT_FIELDS


def _pool(**section):
    return TrajectoryPool(OmegaConf.create({"batch_size": 4, "group_size": 2, "key_list": ["uid"], **section}))


def _traj(uid, index, **keys):
    return {"uid": uid, "sample_index": index, "seq": ord(uid[0]), "reward": float(index), "model_version": 0,
            "model_tag": "default", **keys}


def test_the_pool_hands_out_the_rows_it_was_given():
    pool = _pool()
    rows = [_traj("a", 0, num_tool_calls=2), _traj("a", 1), _traj("b", 0), _traj("b", 1, extra={"k": [1]})]
    for row in rows:
        pool.put_trajectory(row)
    before = copy.deepcopy(rows)
    batch = pool.get_batch(4, "default")
    assert isinstance(batch, TrajectoryBatch) and isinstance(batch.trajectories, tuple)
    assert all(got is row for got, row in zip(batch.trajectories, rows))  # the same objects, in issue order
    assert list(batch.trajectories) == before  # no key added to a row that lacked it
    assert (len(batch), batch.model_tag, batch.num_groups, batch.dropped_groups) == (4, "default", 2, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        batch.num_groups = 3  # type: ignore[misc]


def test_a_batch_crosses_processes_as_its_rows():
    """What Ray pickles for a get_batch reply: the rows, whole (model tag and groups beside them)."""
    batch = TrajectoryBatch((_traj("a", 0, response_token_ids=[1, 2]), _traj("a", 1)), "policy", 1,
                            ({"domain": None, "rewards": [0.0, 0.0]},))
    assert pickle.loads(pickle.dumps(batch)) == batch


# -- a whole run: per-sample results reach samples.jsonl, the rows stay as the workers made them ---------


class FlakyEvaluator(Evaluator):
    """Exact match, and an error on the rows flagged ``misbehave`` (their samples fail)."""

    def evaluate(self, data, evaluation_target):
        if data.get("misbehave"):
            raise ValueError("cannot score it")
        same = float(evaluation_target.final_answer.strip() == str(data["answer"]))
        return EvaluationRunResult(reward=same, ground_truth=str(data["answer"]))


class ResultTrainer(MockTrainer):
    """Returns an advantage and a log-prob gap for each sample it trains on (by its index), and
    keeps what it was given with a deep copy taken on entry."""

    BAD_INDEX = False

    def train(self, trajectories):
        self.seen = getattr(self, "seen", [])
        self.seen.append((trajectories, copy.deepcopy(trajectories)))
        self.expected = getattr(self, "expected", {})
        samples = {}
        for i, t in enumerate(trajectories):
            advantage = float(len(self.expected))
            self.expected[(t["uid"], t["sample_index"])] = advantage
            samples[i] = SampleResult(advantage=advantage, logprob_gap={"max": 0.25, "position": i})
        if self.BAD_INDEX:
            samples[len(trajectories)] = SampleResult(advantage=0.0)
        return TrainOutput({"train/loss": 0.0}, samples)


class BadIndexTrainer(ResultTrainer):
    BAD_INDEX = True


class Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"results": ResultTrainer, "bad_index": BadIndexTrainer}

    @hookimpl
    def nexrl_evaluators(self):
        return {"flaky": FlakyEvaluator}


def _run(tmp_path, trainer):
    rows = [{"prompt": f"What is {a} + 1?", "answer": str(a + 1), "misbehave": a in (0, 5)} for a in range(8)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    recipe = {"data": {"type": "file", "path": str(tmp_path / "rows.jsonl"), "shuffle": False},
              "rollout_worker": {"num_workers": 2, "evaluator": {"type": "flaky"}},
              "trainer": {"type": trainer, "total_train_steps": 3},
              "logger": {"backend": ["console"], "level": "WARNING", "samples_every": 1, "samples_per_step": 8}}
    return run_recipe(recipe, str(tmp_path / "run"), Plugin())


def test_what_the_trainer_computes_per_sample_reaches_samples_jsonl_and_the_rows_stay_as_they_were(tmp_path):
    result = _run(tmp_path, "results")
    assert result.summary.stopped_by == "finished", result.errors
    trainer = result.controller.trainer
    assert all(given == snapshot for given, snapshot in trainer.seen)  # nothing written into the rows
    assert not any("advantage" in t or "logprob_gap" in t for given, _ in trainer.seen for t in given)
    rows = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    failed = [r for r in rows if r.get("failed")]
    trained = [r for r in rows if not r.get("failed")]
    # a failed sample before a trained one in a step: the result's index is among the trained ones
    assert any(a.get("failed") and not b.get("failed") and a["step"] == b["step"] for a, b in zip(rows, rows[1:]))
    assert all("advantage" not in r and "logprob_gap" not in r for r in failed)
    for row in trained:
        assert row["advantage"] == trainer.expected[(row["uid"], row["sample_index"])]
        assert row["logprob_gap"]["max"] == 0.25
        # samples.jsonl's order of keys, the computed ones among the trajectory's
        assert [k for k in row if k not in ("step", "time")] == [f for f in SAMPLE_FIELDS if f in row]


def test_every_field_of_a_sample_result_is_a_samples_jsonl_field():
    assert SAMPLE_RESULT_FIELDS <= set(SAMPLE_FIELDS)


def test_a_result_for_a_sample_the_trainer_was_not_given_is_named(tmp_path):
    with pytest.raises(RunFailed, match=r"BadIndexTrainer.train returned a SampleResult for sample (\d) of the \1 "
                                        r"it was given \(TrainOutput.samples is keyed by their index\)"):
        _run(tmp_path, "bad_index")
