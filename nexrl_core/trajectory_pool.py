"""TrajectoryPool: collects trajectories, keeps groups whole and hands out batches.

Invariants (see docs/evaluation.md and tests/core/test_properties_pool.py):
- a group is released only when it holds ``group_size`` trajectories of ONE model
  version; a member from a newer version evicts the older members, whose tasks are
  re-rolled (never trained on, never lost);
- a batch is made of whole groups;
- a group older than the weight-sync staleness bound (by its oldest trained token's version) is
  not handed to the trainer: its tasks go back to the data loader for a re-rollout and are counted;
- dynamic sampling (``trajectory_pool.dynamic_sampling``): a finished group whose rewards are
  all equal (no failed member) is dropped, its tasks consumed, and the data loader draws a fresh
  row in its place (:meth:`~nexrl_core.BaseDataLoader.add_replacement`); after
  ``max_replacements`` drops in a row for one slot the flat group is kept. Both are counted.
- a batch is ordered, and chosen, by issue order, never by completion order: whole groups
  sorted by (version, first ``seq``), members by ``seq``. In sync mode the pool first waits
  until every admitted rollout has landed, so a step trains on the earliest-issued groups of the
  served version and the extras are re-rolled before the next version's rollouts start
  (docs/reliability.md, "Reproducibility").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any, Callable

from .config.schema import TrajectoryPoolSettings
from .errors import ConfigError
from .protocols import TaskSource, WeightSyncHandle, wired
from .runtime.execute import execute
from .runtime.module import NexRLModule
from .types import DEFAULT_MODEL_TAG, ModelTag, Trajectory, TrajectoryBatch, oldest_version, trajectory_reward


def _version(traj: Trajectory) -> int:
    return int(traj.get("model_version", 0))


def _group_version(group: list[Trajectory]) -> int:
    """The oldest weight version among the group's trained tokens (a trajectory whose tokens span
    a weight update counts by its oldest): what the staleness bound and the issue order read."""
    return min(oldest_version(t) for t in group)


def _sampling_attempt(group: list[Trajectory]) -> int:
    return max(int((t.get("task") or {}).get("sampling_attempt") or 0) for t in group)


def is_flat_group(group: list[Trajectory]) -> bool:
    """All rewards equal and no member failed (a failed member is recorded when the trainer
    consumes it, so such a group is never dropped)."""
    if any(t.get("failed") for t in group):
        return False
    return len({trajectory_reward(t) for t in group}) == 1


def _seq(traj: Trajectory) -> int:
    seq = traj.get("seq")
    return -1 if seq is None else int(seq)


def _issue_order(group: list[Trajectory]) -> tuple[int, int]:
    return _group_version(group), min(_seq(t) for t in group)


class SimpleTrajectoryStore:
    """No grouping: every trajectory is a finished group of one."""

    def __init__(self, group_size: int = 1):
        self.group_size = 1
        self.finished: list[list[Trajectory]] = []

    def add(self, traj: Trajectory) -> list[Trajectory]:
        self.finished.append([traj])
        return []

    def partial_groups(self) -> list[list[Trajectory]]:
        return []

    def drop_partial(self, keep: Callable[[list[Trajectory]], bool]) -> list[Trajectory]:
        return []


class GroupedTrajectoryStore:
    """Groups by the value of one key; a group is released at ``group_size`` members."""

    def __init__(self, key: str, group_size: int):
        self.key = key
        self.group_size = group_size
        self.finished: list[list[Trajectory]] = []
        self._partial: dict[Any, list[Trajectory]] = {}

    def _group_key(self, traj: Trajectory) -> Any:
        if self.key not in traj:
            raise KeyError(f"trajectory has no grouping key '{self.key}' (trajectory_pool.key_list)")
        return traj[self.key]  # type: ignore[literal-required]  # a recipe's key_list names any key

    def add(self, traj: Trajectory) -> list[Trajectory]:
        """Add ``traj``; returns older-version members it evicted."""
        key = self._group_key(traj)
        group = self._partial.setdefault(key, [])
        evicted: list[Trajectory] = []
        if group and _version(group[0]) != _version(traj):
            if _version(traj) > _version(group[0]):
                evicted, group[:] = list(group), []
            else:
                return [traj]  # an older straggler never joins a newer group
        group.append(traj)
        if len(group) >= self.group_size:
            self.finished.append(self._partial.pop(key))
        return evicted

    def partial_groups(self) -> list[list[Trajectory]]:
        return list(self._partial.values())

    def drop_partial(self, keep: Callable[[list[Trajectory]], bool]) -> list[Trajectory]:
        dropped: list[Trajectory] = []
        for key in list(self._partial):
            if not keep(self._partial[key]):
                dropped.extend(self._partial.pop(key))
        return dropped


class HierarchicalTrajectoryStore(GroupedTrajectoryStore):
    """Multi-level grouping (``key_list`` of several keys): leaf groups are released whole."""

    def __init__(self, keys: list[str], group_size: int):
        super().__init__(keys[0], group_size)
        self.keys = list(keys)

    def _group_key(self, traj: Trajectory) -> Any:
        missing = [k for k in self.keys if k not in traj]
        if missing:
            raise KeyError(f"trajectory has no grouping key(s) {missing} (trajectory_pool.key_list)")
        return tuple(traj[k] for k in self.keys)  # type: ignore[literal-required]


def make_store(key_list: list[str], group_size: int):
    if not key_list:
        return SimpleTrajectoryStore()
    if len(key_list) == 1:
        return GroupedTrajectoryStore(key_list[0], group_size)
    return HierarchicalTrajectoryStore(key_list, group_size)


class TrajectoryPoolInstance:
    """One model's trajectories, with weight-sync locking and staleness enforcement."""

    def __init__(self, settings: TrajectoryPoolSettings, model_tag: ModelTag):
        self.model_tag = model_tag
        self._batch_size = settings.batch_size
        self._check_fn = settings.check_batch_ready_function
        self._store = make_store(list(settings.key_list), settings.group_size)
        self._cond = threading.Condition()
        # Trajectories in finished groups, by group version: "is a batch ready?" is asked on every
        # put, and counting the whole pool there made a step O(batch^2).
        self._finished_by_version: dict[int, int] = {}
        self._locked = False
        self._dataloader: TaskSource | None = None
        self._weight_sync_controller: WeightSyncHandle | None = None
        self._activity_tracker: Any = None
        self.counters = {"stale_rerolled": 0, "group_evicted": 0, "rerollout_while_locked": 0}
        self._dynamic_sampling = settings.dynamic_sampling.enabled
        self._max_replacements = settings.dynamic_sampling.max_replacements
        # Dropped groups since the last batch: their domain and rewards go with the next batch (metrics).
        self._dropped_since_batch: list[dict[str, Any]] = []
        # Sync mode: dropped groups whose replacements wait until every admitted rollout has landed.
        self._set_aside: list[list[Trajectory]] = []
        if self._dynamic_sampling:
            self.counters.update(dynamic_sampling_dropped_groups=0, dynamic_sampling_kept_flat_groups=0)

    def set_module_references(self, dataloader: Any, weight_sync_controller: Any, activity_tracker: Any) -> None:
        self._dataloader = dataloader
        self._weight_sync_controller = weight_sync_controller
        self._activity_tracker = activity_tracker

    # -- producer side ----------------------------------------------------------
    def put_trajectory(self, trajectory: Trajectory) -> str:
        # Only groups the trainer would accept count towards "batch ready": stale groups are
        # re-rolled by get_batch, and counting them would block sync-mode rollouts for a batch
        # that never comes (a deadlock).
        wsc = self._weight_sync_controller
        min_version = None if wsc is None else execute(wsc.min_trainable_version, self.model_tag)
        with self._cond:
            if self._locked:
                self.counters["rerollout_while_locked"] += 1
                return "re-rollout"
            finished_before = len(self._store.finished)
            evicted = self._store.add(trajectory)
            self.counters["group_evicted"] += len(evicted)
            dropped = self._drop_flat_locked(finished_before) if self._dynamic_sampling else []
            for group in self._store.finished[finished_before:]:
                self._count_finished_locked(group, +1)
            ready = self._is_batch_ready_locked(min_version)
            if len(self._store.finished) != finished_before or self._check_fn != "batch_size":
                # Waiters (get_batch) only care about finished groups: waking them on every
                # trajectory made the trainer thread re-count the pool on every put.
                self._cond.notify_all()
        self._requeue(evicted)
        if dropped and wsc is not None and execute(wsc.hold_rollouts, self.model_tag):
            with self._cond:
                self._set_aside.extend(dropped)
                self._cond.notify_all()
        else:
            self._replace(dropped)
        if ready and wsc is not None:
            execute(wsc.trajectory_pool_notify_batch_ready, self.model_tag, min_version)
        return "success"

    def notify_weight_sync_starting(self) -> None:
        with self._cond:
            self._locked = True

    def unlock_for_weight_sync(self) -> None:
        with self._cond:
            self._locked = False
            self._cond.notify_all()

    # -- consumer side ----------------------------------------------------------
    def get_batch(self, batch_size: int | None = None, min_version: int | None = None,
                  timeout: float = 0.0) -> TrajectoryBatch | None:
        """Whole groups with at least ``batch_size`` trajectories, or None.

        Groups older than ``min_version`` are re-rolled instead of returned, and so are, once a
        batch is taken, the groups that will be too old for the next step (``min_version + 1``).
        Waits up to ``timeout`` seconds for enough trajectories (and, in sync mode, for the
        rollouts still in flight).
        """
        want = batch_size or self._batch_size
        deadline = time.monotonic() + timeout
        wsc, groups, stale = self._weight_sync_controller, None, []
        while True:
            with self._cond:
                stale += self._drop_stale_locked(min_version)
                if not self._enough_locked(want) and not self._set_aside:
                    self._cond.wait_for(lambda: self._enough_locked(want) or bool(self._set_aside),
                                        max(0.0, deadline - time.monotonic()))
                    stale += self._drop_stale_locked(min_version)
                enough, held = self._enough_locked(want), bool(self._set_aside)
            if not held:
                break
            # Sync-mode dynamic sampling: once the round has landed, the dropped groups are
            # replaced in issue order; then wait for the replacements.
            if execute(wired(wsc, "weight-sync controller").wait_rollouts_landed, self.model_tag, max(0.0, deadline - time.monotonic())):
                self._replace_set_aside()
            if enough or time.monotonic() >= deadline:
                break
        if enough and wsc is not None:
            enough = execute(wsc.wait_rollouts_landed, self.model_tag, max(0.0, deadline - time.monotonic()))
        if enough:
            with self._cond:
                stale += self._drop_stale_locked(min_version)
                if self._enough_locked(want):
                    groups = self._take_locked(want)
                    if min_version is not None:
                        stale += self._drop_stale_locked(min_version + 1)
        self._requeue(stale)
        if not groups:
            return None
        if wsc is not None:  # weight.rollouts_ahead counts them no more
            execute(wsc.rollouts_settled, self.model_tag, sum(len(g) for g in groups))
        trajs = tuple(t for g in groups for t in sorted(g, key=_seq))
        dropped = None
        if self._dynamic_sampling:
            with self._cond:
                dropped, self._dropped_since_batch = tuple(self._dropped_since_batch), []
        return TrajectoryBatch(trajs, self.model_tag, len(groups), dropped)

    # -- dynamic sampling --------------------------------------------------------------------
    def _drop_flat_locked(self, finished_before: int) -> list[list[Trajectory]]:
        """Take the flat groups among those finished since ``finished_before`` out of the pool."""
        kept, dropped = [], []
        for group in self._store.finished[finished_before:]:
            if not is_flat_group(group):
                kept.append(group)
            elif _sampling_attempt(group) >= self._max_replacements:
                self.counters["dynamic_sampling_kept_flat_groups"] += 1
                kept.append(group)
            else:
                dropped.append(group)
                self.counters["dynamic_sampling_dropped_groups"] += 1
                self._dropped_since_batch.append({"domain": group[0].get("domain"),
                                                  "rewards": [trajectory_reward(t) for t in group]})
        self._store.finished[finished_before:] = kept
        return dropped

    def _replace(self, dropped: list[list[Trajectory]], released: int = 0) -> None:
        """A dropped group's tasks are consumed and a fresh row takes its place; then (sync mode)
        its rollout slots are given back, so the replacement can start at once, and ``released``
        held groups let rollouts start again."""
        if not dropped:
            return
        for group in dropped:
            task = next((t["task"] for t in group if t.get("task") is not None), None)
            if self._dataloader is not None and task is not None:
                execute(self._dataloader.add_replacement, task, [t["seq"] for t in group if t.get("seq") is not None])
        wsc = self._weight_sync_controller
        if wsc is not None:
            execute(wsc.return_rollout_slots, self.model_tag, sum(len(g) for g in dropped), released)

    def _replace_set_aside(self) -> None:
        with self._cond:
            dropped, self._set_aside = sorted(self._set_aside, key=_issue_order), []
        self._replace(dropped, released=len(dropped))

    def _count_finished_locked(self, group: list[Trajectory], sign: int) -> None:
        version = _group_version(group)
        left = self._finished_by_version.get(version, 0) + sign * len(group)
        if left:
            self._finished_by_version[version] = left
        else:
            self._finished_by_version.pop(version, None)

    def _enough_locked(self, want: int, min_version: int | None = None) -> bool:
        have = sum(n for v, n in self._finished_by_version.items() if min_version is None or v >= min_version)
        if have >= want:
            return True
        if have and self._check_fn in ("loaded_batch_finished", "batch_size_or_loaded_batch_finished"):
            return self._loaded_batch_finished()
        return False

    def _take_locked(self, want: int) -> list[list[Trajectory]]:
        self._store.finished.sort(key=_issue_order)
        taken, n = [], 0
        while self._store.finished and n < want:
            group = self._store.finished.pop(0)
            self._count_finished_locked(group, -1)
            taken.append(group)
            n += len(group)
        return taken

    def _drop_stale_locked(self, min_version: int | None) -> list[Trajectory]:
        if min_version is None:
            return []
        fresh: list[list[Trajectory]] = []
        stale: list[list[Trajectory]] = []
        for group in self._store.finished:
            (fresh if _group_version(group) >= min_version else stale).append(group)
        self._store.finished = fresh
        for group in stale:
            self._count_finished_locked(group, -1)
        dropped = [t for g in stale for t in g]
        dropped += self._store.drop_partial(lambda g: _group_version(g) >= min_version)
        self.counters["stale_rerolled"] += len(dropped)
        return dropped

    def _is_batch_ready_locked(self, min_version: int | None = None) -> bool:
        return self._enough_locked(self._batch_size, min_version)

    def _loaded_batch_finished(self) -> bool:
        if self._dataloader is None:
            return False
        if execute(self._dataloader.can_return_item):
            return False
        return self._activity_tracker is None or self._activity_tracker.is_rollout_worker_quiescent()

    def _requeue(self, trajectories: list[Trajectory]) -> None:
        """Send the tasks behind dropped trajectories back for a re-rollout."""
        if trajectories and self._weight_sync_controller is not None:
            execute(self._weight_sync_controller.rollouts_settled, self.model_tag, len(trajectories))
        if not trajectories or self._dataloader is None:
            return
        for traj in trajectories:  # the loader serves re-queued tasks in seq order
            task = traj.get("task")
            if task is not None:
                execute(self._dataloader.add_item_front, task)

    # -- inspection -------------------------------------------------------------
    def is_empty(self) -> bool:
        with self._cond:
            return not self._store.finished and not self._store.partial_groups()

    def size(self) -> int:
        with self._cond:
            return sum(len(g) for g in self._store.finished) + sum(len(g) for g in self._store.partial_groups())


class TrajectoryPool(NexRLModule):
    """One :class:`TrajectoryPoolInstance` per model tag."""

    def __init__(self, settings: TrajectoryPoolSettings | Mapping[str, Any]):
        """``settings``: the run's (a mapping, as a test writes one, is read as the recipe's section)."""
        super().__init__()
        self._settings = settings = TrajectoryPoolSettings.of(settings, "trajectory_pool")
        batch_size, group_size = settings.batch_size, settings.group_size
        if batch_size % group_size:
            raise ConfigError(f"trajectory_pool.batch_size ({batch_size}) must be a multiple of "
                              f"trajectory_pool.group_size ({group_size}) so GRPO groups are never split")
        self._instances: dict[ModelTag, TrajectoryPoolInstance] = {}
        self._lock = threading.Lock()
        self._refs: tuple[Any, Any, Any] = (None, None, None)

    def _health_locks(self) -> dict[str, Any]:
        with self._lock:
            instances = dict(self._instances)
        return {"pool": self._lock, **{f"{tag} pool": inst._cond for tag, inst in instances.items()}}

    def set_module_references(self, dataloader: Any, weight_sync_controller: Any) -> None:
        self._refs = (dataloader, weight_sync_controller, self._activity_tracker)
        for inst in self._instances.values():
            inst.set_module_references(*self._refs)

    def _instance(self, model_tag: ModelTag) -> TrajectoryPoolInstance:
        inst = self._instances.get(model_tag)  # fast path without the lock: instances are never removed
        if inst is not None:
            return inst
        with self._lock:
            inst = self._instances.get(model_tag)
            if inst is None:
                inst = self._instances[model_tag] = TrajectoryPoolInstance(self._settings, model_tag)
                inst.set_module_references(*self._refs)
            return inst

    def put_trajectory(self, trajectory: Trajectory) -> str:
        return self._instance(trajectory.get("model_tag") or DEFAULT_MODEL_TAG).put_trajectory(trajectory)

    def put_trajectories(self, trajectories: list[Trajectory]) -> list[str]:
        """:meth:`put_trajectory` for each, in order (one call for several)."""
        return [self.put_trajectory(t) for t in trajectories]

    def get_batch(self, batch_size: int | None = None, model_tag: ModelTag | None = None,
                  min_version: int | None = None, timeout: float = 0.0) -> TrajectoryBatch | None:
        if model_tag is None:
            return self.get_batch_any(batch_size)
        with self._lock:
            inst = self._instances.get(model_tag)
        if inst is None:
            return None
        return inst.get_batch(batch_size, min_version, timeout)

    def get_batch_any(self, batch_size: int | None = None) -> TrajectoryBatch | None:
        for tag in self.get_model_tags():
            batch = self._instance(tag).get_batch(batch_size)
            if batch is not None:
                return batch
        return None

    def instance(self, model_tag: ModelTag) -> TrajectoryPoolInstance:
        return self._instance(model_tag)

    def is_empty(self, model_tag: ModelTag | None = None) -> bool:
        with self._lock:
            insts = list(self._instances.values()) if model_tag is None else [self._instances.get(model_tag)]
        return all(i is None or i.is_empty() for i in insts)

    def get_model_tags(self) -> list[ModelTag]:
        with self._lock:
            return list(self._instances)

    def notify_weight_sync_starting(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        self._instance(model_tag).notify_weight_sync_starting()

    def unlock_for_weight_sync(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        self._instance(model_tag).unlock_for_weight_sync()

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        with self._lock:
            insts = list(self._instances.values())
        for inst in insts:
            for k, v in inst.counters.items():
                total[k] = total.get(k, 0) + v
        return total

    def state_dict(self) -> dict[str, Any]:
        """The counters (they feed ``pool/*`` metrics); the trajectories are not saved: their
        tasks are outstanding in the data loader and are rolled again after a resume."""
        with self._lock:
            insts = dict(self._instances)
        return {"counters": {tag: dict(inst.counters) for tag, inst in insts.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for tag, counters in state.get("counters", {}).items():
            self._instance(tag).counters.update({k: int(v) for k, v in counters.items()})
