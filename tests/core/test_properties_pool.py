"""Properties of the trajectory pool under random interleavings (docs/evaluation.md §Grouped pool,
§Staleness, §Weight-sync modes).

A hypothesis state machine drives the real classes: an ``inline`` data loader (a real
BaseDataLoader subclass), a TrajectoryPool and a WeightSyncController that pushes weights to a
mock inference client. Its rules are the moves of the real system in any order: a rollout
worker starts a task (only when the controller lets it, capturing the served version), finishes
one of its in-flight tasks in random order (possibly as a failure, possibly while weights are
being pushed), the trainer asks for a batch with ``min_version`` from the controller, and the
trainer finishes its step (which pushes weights). After every move it checks:

- staleness never exceeds the mode's bound (0 in sync);
- every batch is whole groups of ``group_size`` of one version, each sample index once;
- every task the loader handed out is in exactly one place (trained, in the pool, in flight,
  back in the loader) - none lost, none duplicated - and every re-queue is counted;
- weights are pushed after every step (served version == trainer version == steps);
- no deadlock: rollouts are blocked only while the trainer is training or has a batch it
  would accept waiting for it.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule
from loguru import logger

from nexrl_core.builtins.dataloaders import InlineDataLoader
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.trajectory_pool import GroupedTrajectoryStore, TrajectoryPool
from nexrl_core.weight_sync import WeightSyncController

pytestmark = pytest.mark.timeout(120)  # a deadlock fails the test instead of hanging the suite

@pytest.fixture(autouse=True, scope="module")
def _quiet():
    logger.disable("nexrl_core")  # per-step debug lines would dominate the run time
    yield
    logger.enable("nexrl_core")


ROWS = [{"prompt": f"{i} + 1", "answer": str(i + 1)} for i in range(5)]


class CountingLoader(InlineDataLoader):
    """The inline loader, counting tasks sent back for a re-rollout."""

    def __init__(self, config, is_validate=False):
        self.front_adds = 0
        super().__init__(config, is_validate)

    def add_item_front(self, item):
        self.front_adds += 1
        super().add_item_front(item)


def group_by_uid(trajs):
    groups = {}
    for t in trajs:
        groups.setdefault(t["uid"], []).append(t)
    return groups


class PoolMachine(RuleBasedStateMachine):
    MODE = "sync"

    @initialize(threshold=st.integers(0, 2), group_size=st.integers(1, 3), groups_per_batch=st.integers(1, 2),
                seed=st.integers(0, 3))
    def setup(self, threshold, group_size, groups_per_batch, seed):
        mode = self.mode = self.MODE
        self.bound = 0 if mode == "sync" else threshold
        self.G, self.B = group_size, group_size * groups_per_batch
        self.dl = CountingLoader({"rows": ROWS, "group_size": group_size, "shuffle": True, "seed": seed})
        self.wsc = WeightSyncController({"sync_mode": mode, "staleness_threshold": threshold})
        self.client = MockInferenceClient({"mode": "echo"})
        self.pool = TrajectoryPool({"batch_size": self.B, "group_size": self.G,
                                    "key_list": ["uid"] if self.G > 1 else []})
        self.pool.set_module_references(self.dl, self.wsc)
        self.wsc.set_module_references(self.dl, self.pool, None, self.client)
        self.wsc.sync_weight_to_rollout_service()  # the controller's start-up push (version 0)
        self.in_flight: list[tuple[dict, int]] = []
        self.consumed: list[int] = []
        self.training = False
        self.steps = 0

    # -- rollout workers ----------------------------------------------------------------
    @rule()
    def start_rollout(self):
        if self.wsc.check_rollout_service_status() == "block":
            assert self.mode != "fully-async", "fully-async must never block rollouts"
            return
        task = self.dl.get_next_item()
        if task is not None:
            self.in_flight.append((task, self.client.model_version()))

    def _finish(self, index, failed, during_push):
        task, version = self.in_flight.pop(index)
        traj = {"uid": task["uid"], "sample_index": task["sample_index"], "seq": task["seq"], "task": task,
                "model_tag": "default", "model_version": version, "reward": 0.0 if failed else 1.0}
        if failed:
            traj.update(failed=True, error="boom")
        if during_push:
            self.pool.notify_weight_sync_starting()
        try:
            result = self.pool.put_trajectory(traj)
        finally:
            if during_push:
                self.pool.unlock_for_weight_sync()
        if during_push:
            assert result == "re-rollout"
        if result == "re-rollout":
            self.dl.add_item_front(task)  # what BaseRolloutWorker does with "re-rollout"
        else:
            assert result == "success"

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data(), failed=st.booleans())
    def finish_rollout(self, data, failed):
        self._finish(data.draw(st.integers(0, len(self.in_flight) - 1)), failed and data.draw(st.booleans()),
                     during_push=False)

    @precondition(lambda self: self.in_flight)
    @rule(data=st.data())
    def finish_rollout_during_weight_push(self, data):
        self._finish(data.draw(st.integers(0, len(self.in_flight) - 1)), False, during_push=True)

    # -- trainer -----------------------------------------------------------------------------
    @precondition(lambda self: not self.training)
    @rule()
    def trainer_get_batch(self):
        min_version = self.wsc.min_trainable_version()
        batch = self.pool.get_batch(self.B, "default", min_version, 0.0)
        if batch is None:
            return
        trajs = batch.trajectories
        version = self.wsc.get_train_model_version()
        assert len(trajs) == self.B
        for uid, group in group_by_uid(trajs).items():
            assert len(group) == self.G, f"group {uid} split: {len(group)} of {self.G}"
            assert len({t["model_version"] for t in group}) == 1, f"group {uid} mixes versions"
            assert sorted(t["sample_index"] for t in group) == list(range(self.G))
        for t in trajs:
            assert 0 <= version - t["model_version"] <= self.bound, (self.mode, version, t["model_version"])
        seqs = [t["seq"] for t in trajs]
        self.consumed += seqs
        self.wsc.train_worker_notify_step_start("trainer")
        self.dl.mark_done(seqs)
        self.training = True

    @precondition(lambda self: self.training)
    @rule()
    def trainer_finish_step(self):
        self.wsc.train_worker_notify_weight_update("trainer")
        self.training = False
        self.steps += 1
        assert self.wsc.get_train_model_version() == self.steps
        assert self.client.model_version() == self.steps, "weights must be pushed after every step"
        assert self.wsc.sync_count == self.steps + 1

    # -- invariants ------------------------------------------------------------------------------
    def _pool_trajs(self):
        store = self.pool.instance("default")._store
        return [t for g in list(store.finished) + store.partial_groups() for t in g]

    @invariant()
    def nothing_lost_or_duplicated(self):
        state = self.dl.state_dict()
        outstanding = Counter(t["seq"] for t in self.dl.outstanding())
        queue = Counter(t["seq"] for t in state["requeued"]) - outstanding
        pending = Counter(t["seq"] for t in state["pending"])
        pool = Counter(t["seq"] for t in self._pool_trajs())
        flight = Counter(t["seq"] for t, _ in self.in_flight)
        everywhere = Counter(self.consumed) + queue + pending + pool + flight
        assert everywhere == Counter(range(state["next_seq"])), "a task was lost or duplicated"
        assert outstanding == pool + flight

    @invariant()
    def every_requeue_is_counted(self):
        counters = self.pool.counters()
        assert self.dl.front_adds == counters["stale_rerolled"] + counters["group_evicted"] + \
            counters["rerollout_while_locked"]

    @invariant()
    def blocking_is_justified(self):
        # No deadlock: rollouts are blocked only while the trainer is busy or has a trainable
        # batch waiting for it (never for a batch it would re-roll as stale).
        if self.training or self.wsc.check_rollout_service_status() == "continue":
            return
        min_version = self.wsc.min_trainable_version()
        store = self.pool.instance("default")._store
        trainable = sum(len(g) for g in store.finished if min(t["model_version"] for t in g) >= min_version)
        assert trainable >= self.B, "rollouts blocked while the trainer has no batch it would accept"


class BatchAsyncMachine(PoolMachine):
    MODE = "batch-async"


class FullyAsyncMachine(PoolMachine):
    MODE = "fully-async"


_SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None,
                     suppress_health_check=[HealthCheck.too_slow])
for _machine in (BatchAsyncMachine, FullyAsyncMachine):
    _machine.TestCase.settings = _SETTINGS
PoolMachine.TestCase.settings = settings(_SETTINGS, max_examples=100)  # sync: the mode that can deadlock
TestSyncInterleavings = PoolMachine.TestCase
TestBatchAsyncInterleavings = BatchAsyncMachine.TestCase
TestFullyAsyncInterleavings = FullyAsyncMachine.TestCase


# -- the eviction rule on its own (docs/evaluation.md §Grouped pool) ---------------------------

def test_newer_member_evicts_older_members_and_older_straggler_evicts_itself():
    store = GroupedTrajectoryStore("uid", 3)
    a0 = {"uid": "u", "sample_index": 0, "model_version": 0}
    a1 = {"uid": "u", "sample_index": 1, "model_version": 0}
    assert store.add(a0) == [] and store.add(a1) == []
    b2 = {"uid": "u", "sample_index": 2, "model_version": 1}
    assert store.add(b2) == [a0, a1]  # a newer member evicts the older ones
    late = {"uid": "u", "sample_index": 0, "model_version": 0}
    assert store.add(late) == [late]  # an older straggler never joins a newer group
    store.add({"uid": "u", "sample_index": 0, "model_version": 1})
    store.add({"uid": "u", "sample_index": 1, "model_version": 1})
    assert len(store.finished) == 1 and {t["model_version"] for t in store.finished[0]} == {1}


def test_sync_mode_stale_leftovers_do_not_block_rollouts():
    """Regression: trajectories of the old version finishing after a push used to count as a
    ready batch; sync mode then blocked rollouts for a batch the trainer re-rolls (deadlock)."""
    m = PoolMachine()
    m.setup(threshold=0, group_size=1, groups_per_batch=1, seed=0)
    m.start_rollout()
    m.start_rollout()  # two tasks in flight at version 0
    m._finish(0, failed=False, during_push=False)  # a batch is ready: sync mode blocks rollouts
    assert m.wsc.check_rollout_service_status() == "block"
    m.trainer_get_batch()
    m.trainer_finish_step()  # version 1 is served
    m._finish(0, failed=False, during_push=False)  # the version-0 straggler lands in the pool
    assert m.wsc.check_rollout_service_status() == "continue"
    m.blocking_is_justified()
    m.nothing_lost_or_duplicated()
    assert m.pool.get_batch(1, "default", m.wsc.min_trainable_version()) is None  # re-rolled, not trained
    assert m.pool.counters()["stale_rerolled"] == 1 and m.dl.front_adds == 1
