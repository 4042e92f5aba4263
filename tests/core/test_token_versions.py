"""Per-token weight versions (issue #47 item 2): each response token carries the version of the
weights that sampled it, from the completion (a backend may report its own, e.g. a completion cut
by a weight update and continued) through the worker, the pool and the trainer's batch to
samples.jsonl and ``nexrl show``; staleness is measured per token (``train/token_staleness_*``)
and the pool bounds a group by its oldest token."""

from __future__ import annotations

import json
import os

import pytest

from nexrl_core import BaseRolloutWorker, CompletionResult, InferenceError, hookimpl, trajectory_token_versions
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.cli.show import render, show
from nexrl_core.rollout_worker import completion_token_versions
from nexrl_core.trajectory_pool import TrajectoryPool
from nexrl_core.types import oldest_version

BOUND = 2


class SpanningClient(MockInferenceClient):
    """The mock model, as if each completion served at version v >= 1 had been cut by the weight
    update to v and continued: its first half sampled by v - 1, the rest by v (per-token versions)."""

    def complete(self, prompt, params):
        result = super().complete(prompt, params)
        v, n = result.model_version, len(result.response_token_ids)
        if v >= 1 and n >= 2:
            result.token_versions = [v - 1] * (n // 2) + [v] * (n - n // 2)
        return result


class SeedStyleWorker(BaseRolloutWorker):
    """The seed's dict-shaped call and a plain-dict trajectory naming only the prompt and reply: the
    base worker fills in the rest from the completion, the per-token versions included."""

    def step(self, task):
        prompt = [{"role": "user", "content": task["prompt"]}]
        answer = self._llm_client.completion(prompt)
        return self._put_trajectory({"prompt": prompt, "response": answer["response"]})


def _plugin():
    class Plugin:
        @hookimpl
        def nexrl_inference_backends(self):
            return {"spanning": SpanningClient}

        @hookimpl
        def nexrl_rollout_workers(self):
            return {"seed_style": SeedStyleWorker}
    return Plugin()


@pytest.mark.parametrize("worker", ["simple", "seed_style"])
def test_per_token_versions_travel_to_the_metrics_samples_and_show(nexrl_run, worker):
    steps = 4
    result = nexrl_run({
        "rollout_worker": {"type": worker, "num_workers": 2, "evaluator": {"type": "exact_match"}},
        # echo: every reply is several tokens long, so every one served at v >= 1 spans an update
        "service": {"inference_service": {"backend": "spanning", "mode": "echo"}},
        "trainer": {"total_train_steps": steps},
        "weight": {"sync_mode": "fully-async", "staleness_threshold": BOUND},
        "logger": {"samples_every": 1, "samples_per_step": 4},
    }, _plugin())
    assert result.summary.stopped_by == "finished" and result.errors == []
    batches = result.controller.trainer.batches
    assert len(batches) == steps
    spanned = 0
    train_rows = [r for r in result.metrics if "train/reward_mean" in r]
    for version, (batch, row) in enumerate(zip(batches, train_rows)):  # the trainer's version before step i
        per_token = []
        for t in batch:
            v, ids, versions = t["model_version"], t["response_token_ids"], t["token_versions"]
            assert len(versions) == len(ids) and max(versions) == v
            assert versions == ([v - 1] * (len(ids) // 2) + [v] * (len(ids) - len(ids) // 2) if v >= 1 and len(ids) >= 2
                                else [v] * len(ids))
            spanned += len(set(versions)) > 1
            per_token += [version - x for x in versions]
            assert 0 <= version - oldest_version(t) <= BOUND  # bounded by the oldest token
        assert row["train/token_staleness_max"] == max(per_token) <= BOUND
        assert row["train/token_staleness_mean"] == pytest.approx(sum(per_token) / len(per_token))
        assert row["train/token_staleness_max"] >= row["train/staleness_max"]
    assert spanned, "no trained sample spanned a weight update"

    samples = [json.loads(x) for x in open(os.path.join(result.run_dir, "samples.jsonl"), encoding="utf-8")]
    assert samples and all(s["token_versions"] and max(s["token_versions"]) == s["model_version"] for s in samples)
    mixed = [s for s in samples if len(set(s["token_versions"])) > 1]
    assert mixed
    text = show(result.run_dir, last=len(samples))
    for s in mixed:
        v, counts = s["model_version"], [s["token_versions"].count(s["model_version"] - 1),
                                         s["token_versions"].count(s["model_version"])]
        assert f"weights v{v - 1}-{v} per token (v{v - 1} ×{counts[0]}, v{v} ×{counts[1]})" in text


def test_show_writes_the_versions_compactly():
    rows = [{"uid": "a", "model_version": 4, "token_versions": [4, 4, 4], "reward": 1.0},
            {"uid": "b", "model_version": 4, "token_versions": [3, 3, 4, 4, 4], "reward": 0.0},
            {"uid": "c", "model_version": 6, "token_versions": [2, 3, 4, 5, 6], "reward": 0.0},
            {"uid": "d", "model_version": 1, "reward": 0.0}]
    heads = [block.splitlines()[0] for block in render(rows, "samples.jsonl", 4).split("\n\n")[1:]]
    assert heads == ["sample a#0 · weights v4 · reward 1",
                     "sample b#0 · weights v3-4 per token (v3 ×2, v4 ×3) · reward 0",
                     "sample c#0 · weights v2-6 per token · reward 0",
                     "sample d#0 · weights v1 · reward 0"]


def test_a_completions_token_versions():
    def result(ids, versions=None):
        return CompletionResult("", "stop", [1], ids, None, 5, token_versions=versions)
    assert completion_token_versions(result(None), 5) is None
    assert completion_token_versions(result([7, 8, 9]), 5) == [5, 5, 5]
    assert completion_token_versions(result([7, 8, 9], [4, 5, 5]), 5) == [4, 5, 5]
    for bad in ([4, 5], [4, 5, -1], [4, 5, True]):
        with pytest.raises(InferenceError, match="token versions for 3 response tokens"):
            completion_token_versions(result([7, 8, 9], bad), 5)


def test_trained_tokens_versions_over_segments_and_masks():
    assert trajectory_token_versions({"model_version": 3, "response_token_ids": [1, 2]}) == [3, 3]
    assert trajectory_token_versions({"model_version": 3, "response_token_ids": [1, 2, 3],
                                      "token_versions": [2, 3, 3], "loss_mask": [1, 0, 1]}) == [2, 3]
    # a list of the wrong length is not the tokens' versions: the sample's version stands for them
    assert trajectory_token_versions({"model_version": 3, "response_token_ids": [1, 2], "token_versions": [1]}) \
        == [3, 3]
    agent = {"model_version": 5, "segments": [
        {"response_token_ids": [1, 2], "token_versions": [4, 4]},
        {"response_token_ids": [3, 4, 5], "loss_mask": [0, 1, 1]},  # no versions of its own: model_version's
    ]}
    assert trajectory_token_versions(agent) == [4, 4, 5, 5] and oldest_version(agent) == 4
    assert trajectory_token_versions({"model_version": 2}) == [] and oldest_version({"model_version": 2}) == 2
    assert oldest_version({"model_version": 2, "response_token_ids": [1], "token_versions": [1]}) == 1


def test_the_pool_bounds_a_group_by_its_oldest_token():
    pool = TrajectoryPool({"batch_size": 2, "group_size": 2, "key_list": ["uid"]})
    pool.set_module_references(None, None)

    def traj(uid, index, versions):
        return {"uid": uid, "sample_index": index, "seq": index, "model_tag": "default", "model_version": 4,
                "reward": float(index), "response_token_ids": [0] * len(versions), "token_versions": versions}
    # one member of group "old" sampled its first tokens at version 2: at min_version 3 the group is stale
    for t in (traj("old", 0, [4, 4]), traj("old", 1, [2, 4]), traj("new", 0, [3, 4]), traj("new", 1, [4, 4])):
        assert pool.put_trajectory(t) == "success"
    batch = pool.get_batch(2, "default", 3)
    assert batch is not None and {t["uid"] for t in batch.trajectories} == {"new"}
    assert pool.counters()["stale_rerolled"] == 2
