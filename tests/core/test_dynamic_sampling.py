"""Dynamic sampling in the trajectory pool, with a real data loader and weight-sync controller:
which groups are dropped, what is counted, what the loader and the rollout budget get back."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nexrl_core.builtins.dataloaders import InlineDataLoader
from nexrl_core.trajectory_pool import TrajectoryPool
from nexrl_core.weight_sync import WeightSyncController

GROUP = 2


@pytest.fixture
def parts():
    loader = InlineDataLoader(OmegaConf.create({"rows": [{"prompt": f"p{i}"} for i in range(6)], "group_size": GROUP,
                                                "shuffle": False}))
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync", "backend": "version_only"}),
                               backend=object())
    wsc.set_rollout_budget(4)
    pool = TrajectoryPool(OmegaConf.create({"batch_size": 4, "group_size": GROUP, "key_list": ["uid"],
                                            "dynamic_sampling": {"enabled": True, "max_replacements": 1}}))
    pool.set_module_references(loader, wsc)
    return loader, wsc, pool


def land(loader, wsc, pool, rewards, failed=()):
    """Start a rollout for each of the next tasks and put its trajectory with ``rewards[i]``."""
    out = []
    for i, reward in enumerate(rewards):
        assert wsc.begin_rollout()
        task = loader.get_next_item()
        traj = {"uid": task["uid"], "sample_index": task["sample_index"], "seq": task["seq"], "task": task,
                "reward": reward, "model_version": wsc.get_rollout_model_version(), "domain": task.get("domain"),
                "failed": i in failed}
        assert pool.put_trajectory(traj) == "success"
        wsc.end_rollout()
        out.append(traj)
    return out


def test_a_flat_group_is_dropped_consumed_replaced_and_its_slots_returned(parts):
    loader, wsc, pool = parts
    land(loader, wsc, pool, [1.0, 1.0])  # p0: flat
    assert pool.counters()["dynamic_sampling_dropped_groups"] == 1
    assert pool.instance("default").size() == 0
    assert loader.outstanding() == []  # p0's tasks were consumed, not re-queued
    replacement = land(loader, wsc, pool, [0.0, 1.0])  # the next fresh row takes p0's place
    assert [(t["task"]["prompt"], t["task"]["sampling_attempt"]) for t in replacement] == [("p1", 1)] * 2
    land(loader, wsc, pool, [0.0, 1.0])
    # budget 4, six rollouts started: p0's two slots came back when its group was dropped
    assert pool.get_batch(4) is not None
    assert not wsc.begin_rollout()  # now the batch is ready: rollouts wait for the next weights


def test_after_max_replacements_a_flat_group_is_kept_and_counted(parts):
    loader, wsc, pool = parts
    land(loader, wsc, pool, [0.0, 0.0])  # p0: dropped (attempt 0)
    land(loader, wsc, pool, [0.0, 0.0])  # p1 replaces it (attempt 1 = max_replacements): kept
    counters = pool.counters()
    assert counters["dynamic_sampling_dropped_groups"] == 1
    assert counters["dynamic_sampling_kept_flat_groups"] == 1
    land(loader, wsc, pool, [1.0, 0.0])
    batch = pool.get_batch(4)
    assert [t["task"].get("sampling_attempt", 0) for t in batch.to_trajectories()] == [1, 1, 0, 0]
    assert batch.metadata["dropped_groups"] == [{"domain": None, "rewards": [0.0, 0.0]}]
    wsc.train_worker_notify_step_start("trainer")
    wsc.train_worker_notify_weight_update("trainer")  # the next version: rollouts go on
    land(loader, wsc, pool, [1.0, 0.0, 0.5, 0.0])
    assert pool.get_batch(4, min_version=1).metadata["dropped_groups"] == []  # reported once, with its batch


def test_a_group_with_a_failed_member_is_never_dropped(parts):
    loader, wsc, pool = parts
    land(loader, wsc, pool, [0.0, 0.0], failed=(1,))
    assert pool.counters()["dynamic_sampling_dropped_groups"] == 0
    assert pool.instance("default").size() == 2


def test_off_by_default_and_no_counters():
    pool = TrajectoryPool(OmegaConf.create({"batch_size": 2, "group_size": GROUP, "key_list": ["uid"]}))
    for i in range(2):
        pool.put_trajectory({"uid": "u", "sample_index": i, "seq": i, "reward": 1.0, "model_version": 0})
    batch = pool.get_batch(2)
    assert len(batch) == 2 and "dropped_groups" not in batch.metadata
    assert not any(k.startswith("dynamic_sampling") for k in pool.counters())
