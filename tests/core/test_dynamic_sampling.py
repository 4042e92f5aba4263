"""Dynamic sampling in the trajectory pool, with a real data loader and weight-sync controller:
which groups are dropped, what is counted, what the loader and the rollout budget get back."""

from __future__ import annotations

import pytest
from omegaconf import OmegaConf

from nexrl_core.builtins.dataloaders import InlineDataLoader, MultiDomainDataLoader
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


def draw(loader, wsc, count):
    """Start ``count`` rollouts: admitted by the controller, each takes the loader's next task."""
    tasks = []
    for _ in range(count):
        assert wsc.begin_rollout()
        tasks.append(loader.get_next_item())
    return tasks


def put(wsc, pool, tasks, rewards, failed=()):
    """Land the rollouts of ``tasks`` (in the order given) with ``rewards[i]``."""
    out = []
    for i, (task, reward) in enumerate(zip(tasks, rewards)):
        traj = {"uid": task["uid"], "sample_index": task["sample_index"], "seq": task["seq"], "task": task,
                "reward": reward, "model_version": wsc.get_rollout_model_version(), "domain": task.get("domain"),
                "failed": i in failed}
        assert pool.put_trajectory(traj) == "success"
        wsc.end_rollout()
        out.append(traj)
    return out


def land(loader, wsc, pool, rewards, failed=()):
    return put(wsc, pool, draw(loader, wsc, len(rewards)), rewards, failed)


def test_a_flat_group_is_dropped_consumed_replaced_and_its_slots_returned(parts):
    loader, wsc, pool = parts
    land(loader, wsc, pool, [1.0, 1.0])  # p0: flat
    assert pool.counters()["dynamic_sampling_dropped_groups"] == 1
    assert pool.instance("default").size() == 0
    # Sync mode: the replacement waits for the round to land; meanwhile no rollout starts.
    assert not wsc.begin_rollout()
    assert [t["prompt"] for t in loader.outstanding()] == ["p0", "p0"]
    assert pool.get_batch(4, timeout=0.0) is None  # everything landed: the replacement is asked for
    assert loader.outstanding() == []  # p0's tasks were consumed, not re-queued
    replacement = land(loader, wsc, pool, [0.0, 1.0])  # the next fresh row takes p0's place
    assert [(t["task"]["prompt"], t["task"]["sampling_attempt"]) for t in replacement] == [("p1", 1)] * 2
    land(loader, wsc, pool, [0.0, 1.0])
    # budget 4, six rollouts started: p0's two slots came back when its replacement was asked for
    assert pool.get_batch(4) is not None
    assert not wsc.begin_rollout()  # now the batch is ready: rollouts wait for the next weights


def test_async_modes_replace_at_once():
    loader = InlineDataLoader(OmegaConf.create({"rows": [{"prompt": f"p{i}"} for i in range(6)], "group_size": GROUP,
                                                "shuffle": False}))
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "fully-async", "backend": "version_only"}),
                               backend=object())
    pool = TrajectoryPool(OmegaConf.create({"batch_size": 4, "group_size": GROUP, "key_list": ["uid"],
                                            "dynamic_sampling": {"enabled": True}}))
    pool.set_module_references(loader, wsc)
    first = draw(loader, wsc, 3)  # p0 and one task of p1 in flight
    put(wsc, pool, first[:2], [1.0, 1.0])  # p0 flat: dropped, replaced while p1 is still running
    assert loader.outstanding() == [first[2]]
    assert [(t["prompt"], t.get("sampling_attempt", 0)) for t in draw(loader, wsc, 3)] == \
        [("p1", 0), ("p2", 1), ("p2", 1)]


def _served_after_two_drops(landing_order):
    """Two domains, one group each, both flat, landing in ``landing_order``; what the loader
    serves next (domain, seq, attempt)."""
    loader = MultiDomainDataLoader(OmegaConf.create({
        "domains": {"a": {"type": "inline", "rows": [{"prompt": f"a{i}"} for i in range(4)]},
                    "b": {"type": "inline", "rows": [{"prompt": f"b{i}"} for i in range(4)]}},
        "domain_interleave_probs": {"a": 1, "b": 1}, "group_size": GROUP, "batch_groups": 2, "shuffle": False}))
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync", "backend": "version_only"}),
                               backend=object())
    wsc.set_rollout_budget(4)
    pool = TrajectoryPool(OmegaConf.create({"batch_size": 4, "group_size": GROUP, "key_list": ["uid"],
                                            "dynamic_sampling": {"enabled": True}}))
    pool.set_module_references(loader, wsc)
    tasks = draw(loader, wsc, 4)
    assert [t["domain"] for t in tasks] == ["a", "a", "b", "b"]
    put(wsc, pool, [tasks[i] for i in landing_order], [0.0] * 4)
    assert pool.get_batch(4, timeout=0.0) is None
    return [(t["domain"], t["prompt"], t["seq"], t["sampling_attempt"]) for t in draw(loader, wsc, 4)]


def test_sync_mode_replacements_do_not_depend_on_landing_order():
    a_first = _served_after_two_drops([0, 1, 2, 3])
    assert a_first == [("a", "a1", 4, 1), ("a", "a1", 5, 1), ("b", "b1", 6, 1), ("b", "b1", 7, 1)]
    assert _served_after_two_drops([3, 2, 1, 0]) == a_first  # b's group landed (and was dropped) first


def test_after_max_replacements_a_flat_group_is_kept_and_counted(parts):
    loader, wsc, pool = parts
    land(loader, wsc, pool, [0.0, 0.0])  # p0: dropped (attempt 0)
    assert pool.get_batch(4, timeout=0.0) is None  # the round landed: its replacement is asked for
    land(loader, wsc, pool, [0.0, 0.0])  # p1 replaces it (attempt 1 = max_replacements): kept
    counters = pool.counters()
    assert counters["dynamic_sampling_dropped_groups"] == 1
    assert counters["dynamic_sampling_kept_flat_groups"] == 1
    land(loader, wsc, pool, [1.0, 0.0])
    batch = pool.get_batch(4)
    assert [t["task"].get("sampling_attempt", 0) for t in batch.trajectories] == [1, 1, 0, 0]
    assert batch.dropped_groups == ({"domain": None, "rewards": [0.0, 0.0]},)
    wsc.train_worker_notify_step_start("trainer")
    wsc.train_worker_notify_weight_update("trainer")  # the next version: rollouts go on
    land(loader, wsc, pool, [1.0, 0.0, 0.5, 0.0])
    assert pool.get_batch(4, min_version=1).dropped_groups == ()  # reported once, with its batch


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
    assert len(batch) == 2 and batch.dropped_groups is None
    assert not any(k.startswith("dynamic_sampling") for k in pool.counters())
