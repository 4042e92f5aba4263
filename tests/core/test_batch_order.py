"""Which trajectories make a batch, and in which order (docs/reliability.md §Reproducibility):
issue order, never completion order; in sync mode the pool waits for every admitted rollout of the
served version and re-rolls the extras before the next version's rollouts start."""

from __future__ import annotations

import threading

from nexrl_core.builtins.dataloaders import InlineDataLoader
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.trajectory_pool import TrajectoryPool
from nexrl_core.weight_sync import WeightSyncController

ROWS = [{"prompt": f"row {i}"} for i in range(6)]


def system(mode="sync", batch_size=4, group_size=2, budget=None):
    dl = InlineDataLoader({"rows": ROWS, "group_size": group_size, "shuffle": False})
    wsc = WeightSyncController({"sync_mode": mode, "staleness_threshold": 1})
    pool = TrajectoryPool({"batch_size": batch_size, "group_size": group_size, "key_list": ["uid"]})
    pool.set_module_references(dl, wsc)
    wsc.set_module_references(dl, pool, None, MockInferenceClient({"mode": "echo"}))
    wsc.set_rollout_budget(budget)
    wsc.sync_weight_to_rollout_service()
    return dl, wsc, pool


def start(dl, wsc, n):
    tasks = []
    for _ in range(n):
        assert wsc.begin_rollout()
        tasks.append(dl.get_next_item())
    return tasks


def land(pool, wsc, task, version=0):
    traj = {"uid": task["uid"], "sample_index": task["sample_index"], "seq": task["seq"], "task": task,
            "model_version": version, "reward": float(task["seq"])}
    assert pool.put_trajectory(traj) == "success"
    wsc.end_rollout()


def test_a_batch_is_ordered_by_issue_not_by_completion():
    for completion in ([3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]):
        dl, wsc, pool = system()
        tasks = start(dl, wsc, 4)
        for i in completion:
            land(pool, wsc, tasks[i])
        batch = pool.get_batch(4, "default", 0, 1.0)
        assert [t["seq"] for t in batch.trajectories] == [0, 1, 2, 3], completion


def test_sync_mode_waits_for_rollouts_in_flight_and_takes_the_earliest_groups():
    """No rollout limit: six tasks run, the last two groups finish first; the batch is still the
    first two groups, and the third is re-rolled at once (before any rollout of the next version)."""
    dl, wsc, pool = system()
    tasks = start(dl, wsc, 6)
    for i in (5, 4, 3, 2):  # groups 2 and 1 complete: enough for a batch, group 0 still running
        land(pool, wsc, tasks[i])
    assert wsc.check_rollout_service_status() == "block"
    assert pool.get_batch(4, "default", 0, 0.05) is None  # group 0 is in flight: wait for it
    got = []
    taker = threading.Thread(target=lambda: got.append(pool.get_batch(4, "default", 0, 10.0)))
    taker.start()
    land(pool, wsc, tasks[1])
    land(pool, wsc, tasks[0])
    taker.join(10)
    assert [t["seq"] for t in got[0].trajectories] == [0, 1, 2, 3]
    assert pool.is_empty() and pool.counters()["stale_rerolled"] == 2
    assert [dl[i]["seq"] for i in range(2)] == [4, 5]  # group 2 is next in the loader, in order


def test_with_a_rollout_budget_the_wave_is_the_batch():
    dl, wsc, pool = system(budget=4)
    tasks = start(dl, wsc, 4)
    assert not wsc.begin_rollout()  # the budget: one batch of rollouts per version
    for i in (2, 0, 3, 1):
        land(pool, wsc, tasks[i])
    batch = pool.get_batch(4, "default", 0, 1.0)
    assert [t["seq"] for t in batch.trajectories] == [0, 1, 2, 3]
    assert pool.counters()["stale_rerolled"] == 0


def test_async_modes_do_not_wait_for_stragglers():
    dl, wsc, pool = system(mode="batch-async")
    tasks = start(dl, wsc, 6)
    for i in (5, 4, 3, 2):
        land(pool, wsc, tasks[i])
    batch = pool.get_batch(4, "default", 0, 0.0)  # group 0 still running: not waited for
    assert [t["seq"] for t in batch.trajectories] == [2, 3, 4, 5]
