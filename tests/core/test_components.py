"""The seed's components one by one, with real objects: data loaders (JSONL, Parquet), the
trajectory pool, the weight-sync controller in sync mode, the activity tracker and error
reporter, and the validator's metric names."""

from __future__ import annotations

import json
import threading
import time

import pytest
from omegaconf import OmegaConf

from nexrl_core.builtins.dataloaders import FileDataLoader
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.builtins.weight_sync import VersionOnlyWeightSync
from nexrl_core.errors import ErrorReporter, ErrorSeverity
from nexrl_core.runtime.activity import ActivityTracker, ActivityTrackerProxy
from nexrl_core.runtime.run_log import RunRecorder
from nexrl_core.trajectory_pool import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    TrajectoryPool,
)
from nexrl_core.validator import Validator
from nexrl_core.weight_sync import WeightSyncController

ROWS = [{"prompt": f"question {i}", "answer": str(i), "data_source": "even" if i % 2 == 0 else "odd"}
        for i in range(12)]


@pytest.fixture
def jsonl(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return str(path)


def loader(path, is_validate=False, **extra):
    cfg = OmegaConf.create({"path": path, "seed": 7, **extra})
    return FileDataLoader(cfg, is_validate=is_validate)


def take(dl, n):
    items = [dl.get_next_item() for _ in range(n)]
    assert all(item is not None for item in items)
    return items


def prompts(items):
    return [i["prompt"] for i in items]


# ----------------------------------------------------------------------------- data loader


def test_training_loader_shuffles_with_seed_and_reshuffles_every_epoch(jsonl):
    dl = loader(jsonl)
    epoch1, epoch2, epoch3 = (prompts(take(dl, len(ROWS))) for _ in range(3))
    every = sorted(r["prompt"] for r in ROWS)
    for epoch in (epoch1, epoch2, epoch3):
        assert sorted(epoch) == every  # each epoch is one full pass
    assert epoch1 != [r["prompt"] for r in ROWS]  # shuffled
    assert epoch1 != epoch2 and epoch2 != epoch3  # reshuffled each epoch
    assert not dl.is_finished() and dl.can_return_item()  # training data cycles
    # same seed -> same order; another seed -> another order
    assert prompts(take(loader(jsonl), len(ROWS))) == epoch1
    assert prompts(take(loader(jsonl, seed=8), len(ROWS))) != epoch1
    # rows keep every field, tasks carry their identity
    task = loader(jsonl).get_next_item()
    source = next(r for r in ROWS if r["prompt"] == task["prompt"])
    assert {k: task[k] for k in source} == source
    assert task["seq"] == 0 and task["sample_index"] == 0 and task["uid"]


def test_unshuffled_training_loader_keeps_file_order(jsonl):
    dl = loader(jsonl, shuffle=False)
    assert prompts(take(dl, 2 * len(ROWS))) == [r["prompt"] for r in ROWS] * 2


def test_parquet_rows_load_like_jsonl(tmp_path, jsonl):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    path = tmp_path / "rows.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), str(path))
    dl = loader(str(path), is_validate=True)
    dl.unlock_for_weight_sync()
    got = [dl.get_next_item() for _ in range(len(ROWS))]
    assert [{k: g[k] for k in ROWS[0]} for g in got] == ROWS
    assert dl.get_next_item() is None
    # both formats in one loader (``path`` may be a list)
    both = loader([jsonl, str(path)], is_validate=True)
    assert both.num_rows() == 2 * len(ROWS)


def test_validation_loader_is_one_ordered_pass_and_resets(jsonl):
    dl = loader(jsonl, is_validate=True)
    assert dl.get_next_item() is None and not dl.can_return_item()  # locked until a validation starts
    dl.unlock_for_weight_sync()
    assert len(dl) == len(ROWS) and dl.can_return_item() and not dl.is_finished()
    got = prompts(take(dl, len(ROWS)))
    assert got == [r["prompt"] for r in ROWS]  # ordered, no shuffle
    assert dl.get_next_item() is None
    assert dl.is_finished() and not dl.can_return_item() and len(dl) == 0
    dl.reset()
    assert not dl.is_finished()
    assert prompts(take(dl, len(ROWS))) == got


def test_add_item_front_and_back_requeue_items(jsonl):
    """The seed's queue: add_item_front serves an item next, add_item_back / add_item after every
    fresh row of the pass."""
    dl = loader(jsonl, is_validate=True)
    dl.unlock_for_weight_sync()
    a, b, c = take(dl, 3)
    dl.add_item_back(b)
    dl.add_item_front(a)
    assert dl.get_next_item()["seq"] == a["seq"]
    assert dl.get_next_item()["prompt"] == ROWS[3]["prompt"]  # b waits behind the fresh rows
    # a requeued item is no longer outstanding; handing it out again makes it outstanding
    dl.add_item(c)
    assert c["seq"] not in [t["seq"] for t in dl.outstanding()]
    rest = []
    while (item := dl.get_next_item()) is not None:
        rest.append(item)
    assert [i["prompt"] for i in rest] == [r["prompt"] for r in ROWS[4:]] + [b["prompt"], c["prompt"]]
    assert [i["seq"] for i in rest[-2:]] == [b["seq"], c["seq"]]
    assert c["seq"] in [t["seq"] for t in dl.outstanding()]
    assert dl.is_finished()


def test_group_expansion_gives_group_size_tasks_with_one_uid(jsonl):
    dl = loader(jsonl, group_size=3)
    tasks = take(dl, 3 * 4)
    for g in range(4):
        group = tasks[3 * g: 3 * g + 3]
        assert len({t["uid"] for t in group}) == 1
        assert len({t["prompt"] for t in group}) == 1
        assert [t["sample_index"] for t in group] == [0, 1, 2]
    assert len({t["uid"] for t in tasks}) == 4
    assert [t["seq"] for t in tasks] == list(range(12))
    # a new epoch gives new uids for the same rows
    later = take(dl, 3 * len(ROWS))
    assert not {t["uid"] for t in later[-3:]} & {t["uid"] for t in tasks}


def test_state_dict_round_trip_continues_the_identical_sequence(jsonl):
    a = loader(jsonl, group_size=2)
    done = take(a, 10)
    a.mark_done([t["seq"] for t in done])
    state = json.loads(json.dumps(a.state_dict()))  # checkpoints store it as JSON
    expected = take(a, 3 * 2 * len(ROWS))  # crosses two epoch boundaries
    b = loader(jsonl, group_size=2)
    b.load_state_dict(state)
    assert take(b, len(expected)) == expected


def test_state_dict_hands_outstanding_tasks_out_first(jsonl):
    a = loader(jsonl, group_size=2)
    first = take(a, 6)
    a.mark_done([t["seq"] for t in first[:4]])  # the last two were never trained on
    state = json.loads(json.dumps(a.state_dict()))
    expected_next = take(a, 8)
    b = loader(jsonl, group_size=2)
    b.load_state_dict(state)
    assert take(b, 2) == first[4:]
    assert take(b, 8) == expected_next


# ----------------------------------------------------------------------------- trajectory pool


def traj(uid, i, version=0, **extra):
    return {"uid": uid, "sample_index": i, "seq": i, "model_version": version, "reward": 1.0, **extra}


def pool(batch_size=4, group_size=2, key_list=("uid",), check="batch_size"):
    return TrajectoryPool(OmegaConf.create({"batch_size": batch_size, "group_size": group_size,
                                            "key_list": list(key_list), "check_batch_ready_function": check}))


def test_store_kinds():
    assert isinstance(pool(key_list=())._instance("default")._store, SimpleTrajectoryStore)
    assert isinstance(pool()._instance("default")._store, GroupedTrajectoryStore)
    assert isinstance(pool(key_list=("data_source", "uid"))._instance("default")._store, HierarchicalTrajectoryStore)


def test_simple_store_batches_by_count():
    p = pool(batch_size=3, group_size=1, key_list=())
    for i in range(2):
        assert p.put_trajectory(traj(f"u{i}", 0)) == "success"
    assert p.get_batch(model_tag="default") is None
    p.put_trajectory(traj("u2", 0))
    batch = p.get_batch(model_tag="default")
    assert len(batch) == 3 and len(batch.trajectories) == 3 and batch.model_tag == "default"
    assert p.is_empty()


def test_grouped_store_releases_whole_groups_only():
    p = pool(batch_size=4, group_size=2)
    p.put_trajectory(traj("a", 0))
    p.put_trajectory(traj("b", 0))
    p.put_trajectory(traj("a", 1))
    assert p.get_batch(model_tag="default") is None  # one whole group (2) < batch 4
    p.put_trajectory(traj("c", 0))
    p.put_trajectory(traj("b", 1))
    batch = p.get_batch(model_tag="default")
    assert sorted((t["uid"], t["sample_index"]) for t in batch.trajectories) == \
        [("a", 0), ("a", 1), ("b", 0), ("b", 1)]
    assert batch.num_groups == 2
    assert p.instance("default").size() == 1  # c#0 waits for its partner


def test_groups_are_never_split_across_batches():
    p = pool(batch_size=4, group_size=2)
    for uid in "abc":
        for i in range(2):
            p.put_trajectory(traj(uid, i))
    first = p.get_batch(model_tag="default").trajectories
    assert len(first) == 4
    p.put_trajectory(traj("d", 0))
    assert p.get_batch(model_tag="default") is None
    p.put_trajectory(traj("d", 1))
    second = p.get_batch(model_tag="default").trajectories
    for batch in (first, second):
        uids = [t["uid"] for t in batch]
        assert all(uids.count(u) == 2 for u in uids)
    assert {t["uid"] for t in first} | {t["uid"] for t in second} == set("abcd")


def test_hierarchical_store_groups_by_every_key():
    p = pool(batch_size=2, group_size=2, key_list=("data_source", "uid"))
    p.put_trajectory(traj("1", 0, data_source="x"))
    p.put_trajectory(traj("1", 0, data_source="y"))
    assert p.get_batch(model_tag="default") is None  # same uid, different source: two groups
    p.put_trajectory(traj("1", 1, data_source="y"))
    batch = p.get_batch(model_tag="default").trajectories
    assert {t["data_source"] for t in batch} == {"y"}
    pending = p.instance("default")._store.partial_groups()  # ("x", "1") waits for its second member
    assert [[(t["data_source"], t["uid"]) for t in g] for g in pending] == [[("x", "1")]]


def test_newer_version_evicts_older_group_members_and_rerolls_them(jsonl):
    p = pool(batch_size=2, group_size=2)
    dl = loader(jsonl, group_size=2)
    task_a, task_b = take(dl, 2)
    p.set_module_references(dl, None)
    p.put_trajectory(traj(task_a["uid"], 0, version=0, task=task_a, seq=task_a["seq"]))
    p.put_trajectory(traj(task_b["uid"], 1, version=1, task=task_b, seq=task_b["seq"]))
    assert p.counters()["group_evicted"] == 1
    assert dl.get_next_item()["seq"] == task_a["seq"]  # the evicted task is rolled out again


def test_batch_ready_notifies_weight_sync_and_blocks_rollouts_in_sync_mode():
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}))
    p = pool(batch_size=2, group_size=2)
    p.set_module_references(None, wsc)
    wsc.set_module_references(None, p)
    p.put_trajectory(traj("a", 0))
    assert wsc.check_rollout_service_status() == "continue"
    p.put_trajectory(traj("a", 1))
    assert wsc.check_rollout_service_status() == "block"


def test_loaded_batch_finished_releases_a_partial_batch_when_data_and_workers_are_done(jsonl):
    tracker = ActivityTracker()
    tracker.register_module("rollout_worker_0", object(), is_rollout_worker=True)
    dl = loader(jsonl, is_validate=True)
    dl.unlock_for_weight_sync()
    p = pool(batch_size=8, group_size=1, key_list=(), check="loaded_batch_finished")
    p.set_activity_tracker(tracker)
    p.set_module_references(dl, None)
    p.put_trajectory(traj("a", 0))
    p.put_trajectory(traj("b", 0))
    assert p.get_batch(model_tag="default") is None  # the loader still has items
    take(dl, len(ROWS))
    token = tracker.start("rollout_worker_0", "rollout")
    assert p.get_batch(model_tag="default") is None  # a worker is still producing
    tracker.end(token)
    batch = p.get_batch(model_tag="default")
    assert batch is not None and len(batch) == 2
    # plain batch_size readiness never releases a partial batch
    q = pool(batch_size=8, group_size=1, key_list=())
    q.set_module_references(dl, None)
    q.put_trajectory(traj("a", 0))
    assert q.get_batch(model_tag="default") is None


def test_rerollout_while_locked_for_weight_sync():
    p = pool(batch_size=2, group_size=1, key_list=())
    p.notify_weight_sync_starting("default")
    assert p.put_trajectory(traj("a", 0)) == "re-rollout"
    assert p.is_empty() and p.counters()["rerollout_while_locked"] == 1
    p.unlock_for_weight_sync("default")
    assert p.put_trajectory(traj("a", 0)) == "success"
    assert not p.is_empty()


def test_one_pool_instance_per_model_tag():
    p = pool(batch_size=2, group_size=1, key_list=())
    p.put_trajectory(traj("a", 0, model_tag="policy"))
    p.put_trajectory(traj("b", 0, model_tag="critic"))
    p.put_trajectory(traj("c", 0, model_tag="policy"))
    assert sorted(p.get_model_tags()) == ["critic", "policy"]
    assert p.get_batch(model_tag="critic") is None
    batch = p.get_batch(model_tag="policy")
    assert [t["uid"] for t in batch.trajectories] == ["a", "c"]
    assert batch.model_tag == "policy"
    assert p.is_empty("policy") and not p.is_empty("critic") and not p.is_empty()
    assert p.get_batch(model_tag="nobody") is None


def test_stale_groups_are_rerolled_not_returned(jsonl):
    dl = loader(jsonl)
    p = pool(batch_size=2, group_size=2)
    p.set_module_references(dl, None)
    t0, t1 = take(dl, 2)
    p.put_trajectory(traj(t0["uid"], 0, version=0, task=t0, seq=t0["seq"]))
    p.put_trajectory(traj(t0["uid"], 1, version=0, task=t1, seq=t1["seq"]))
    assert p.get_batch(model_tag="default", min_version=1) is None
    assert p.counters()["stale_rerolled"] == 2
    assert [dl.get_next_item()["seq"] for _ in range(2)] == [t0["seq"], t1["seq"]]


def test_get_batch_waits_for_a_producer():
    p = pool(batch_size=2, group_size=1, key_list=())
    p.put_trajectory(traj("a", 0))
    threading.Timer(0.05, lambda: p.put_trajectory(traj("b", 0))).start()
    t0 = time.monotonic()
    batch = p.get_batch(model_tag="default", timeout=5.0)
    assert batch is not None and len(batch) == 2 and time.monotonic() - t0 < 4


# ----------------------------------------------------------------------------- weight sync


def test_sync_mode_blocks_after_batch_ready_until_weights_are_served_and_triggers_validation():
    client = MockInferenceClient(OmegaConf.create({"model_tag": "default"}))
    p = pool(batch_size=2, group_size=1, key_list=())
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync", "validate_freq": 2}),
                               VersionOnlyWeightSync(None))
    wsc.set_module_references(None, p, None, client)
    p.set_module_references(None, wsc)
    assert wsc.sync_mode == "sync" and wsc.staleness_threshold == 0

    wsc.trajectory_pool_notify_batch_ready()
    assert wsc.check_rollout_service_status() == "block"
    assert wsc.wait_rollout_allowed(timeout=0.05) is False

    released = threading.Event()

    def waiter():
        wsc.wait_rollout_allowed()
        released.set()

    threading.Thread(target=waiter, daemon=True).start()
    assert not released.wait(0.1)
    wsc.train_worker_notify_step_start("trainer")
    wsc.train_worker_notify_weight_update("trainer")
    assert released.wait(2.0)
    assert client.model_version() == 1
    assert wsc.get_train_model_version() == wsc.get_rollout_model_version() == 1
    assert wsc.min_trainable_version() == 1  # sync: only current-version trajectories train
    assert wsc.check_rollout_service_status() == "continue"
    assert not wsc.is_waiting_for_validation()

    # step 2 is a multiple of validate_freq: rollouts block until the validation ends
    wsc.trajectory_pool_notify_batch_ready()
    wsc.train_worker_notify_weight_update("trainer")
    assert client.model_version() == 2
    assert wsc.is_waiting_for_validation()
    assert wsc.check_rollout_service_status() == "block"

    # no weights move under a running validation
    updated = threading.Event()

    def step3():
        wsc.train_worker_notify_weight_update("trainer")
        updated.set()

    threading.Thread(target=step3, daemon=True).start()
    assert not updated.wait(0.1)
    assert client.model_version() == 2
    wsc.end_validate()
    assert updated.wait(2.0)
    assert client.model_version() == 3
    assert not wsc.is_waiting_for_validation()
    assert wsc.check_rollout_service_status() == "continue"
    assert wsc.sync_count == 3


def test_weight_sync_locks_the_pool_while_weights_move():
    seen = []

    class Recording(VersionOnlyWeightSync):
        def sync(self, trainer, inference_client, version):
            seen.append(p.put_trajectory(traj("x", 0)))
            super().sync(trainer, inference_client, version)

    client = MockInferenceClient(OmegaConf.create({}))
    p = pool(batch_size=2, group_size=1, key_list=())
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}), Recording(None))
    wsc.set_module_references(None, p, None, client)
    wsc.train_worker_notify_weight_update("trainer")
    assert seen == ["re-rollout"]
    assert p.put_trajectory(traj("x", 0)) == "success"


def test_stop_releases_blocked_rollouts():
    wsc = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}))
    wsc.trajectory_pool_notify_batch_ready()
    assert wsc.check_rollout_service_status() == "block"
    wsc.stop()
    assert wsc.wait_rollout_allowed(timeout=0.5)


# ----------------------------------------------------------------------------- activity tracker


def test_track_marks_work_in_flight_and_reports_exceptions():
    tracker = ActivityTracker()
    assert tracker.is_quiescent()
    with tracker.track("trainer", "train"):
        assert not tracker.is_quiescent()
        assert "trainer/train" in tracker.get_running_status_summary()
    assert tracker.is_quiescent() and tracker.get_running_status_summary() == "idle"
    with pytest.raises(ValueError):
        with tracker.track("trainer", "train"):
            raise ValueError("bad batch")
    assert tracker.is_quiescent()
    errors = tracker.error_reporter.errors()
    assert len(errors) == 1 and errors[0].exception_type == "ValueError"
    assert errors[0].module_name == "trainer" and "bad batch" in errors[0].message
    assert "Traceback" in errors[0].exception_traceback
    with pytest.raises(KeyError):
        with tracker.track("trainer", "train", auto_report_errors=False):
            raise KeyError("quiet")
    assert len(tracker.error_reporter.errors()) == 1


def test_wait_quiescent_and_rollout_worker_quiescence():
    tracker = ActivityTracker()
    tracker.register_module("rollout_worker_0", object(), is_rollout_worker=True)
    proxy = ActivityTrackerProxy(tracker)
    release = threading.Event()

    def work():
        with proxy.track("rollout_worker_0", "rollout"):
            release.wait(5)

    t = threading.Thread(target=work)
    t.start()
    deadline = time.monotonic() + 2
    while tracker.is_quiescent() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert not tracker.is_rollout_worker_quiescent()
    assert tracker.wait_quiescent(0.05) is False
    token = tracker.start("trainer", "train")
    release.set()
    t.join()
    assert tracker.is_rollout_worker_quiescent()  # the trainer's work is not rollout work
    assert not tracker.is_quiescent()
    tracker.end(token)
    assert tracker.wait_quiescent(1.0) is True


def test_health_check_of_a_hung_module_times_out():
    hang = threading.Event()

    class Hung:
        def health_check(self):
            hang.wait(10)
            return True

    class Unhealthy:
        def health_check(self):
            return False

    class Raising:
        def health_check(self):
            raise RuntimeError("no")

    class Fine:
        def health_check(self):
            return True

    tracker = ActivityTracker()
    for name, module in (("hung", Hung()), ("sick", Unhealthy()), ("raising", Raising()), ("fine", Fine())):
        tracker.register_module(name, module)
    t0 = time.monotonic()
    dead = tracker.dead_modules(timeout=0.1)
    elapsed = time.monotonic() - t0
    hang.set()
    assert sorted(dead) == ["hung", "raising", "sick"]
    assert elapsed < 2.0
    assert not tracker.check_module_liveness(0.1)


@pytest.mark.parametrize("severities, status", [
    ((), "healthy"),
    ((ErrorSeverity.INFO,), "healthy"),
    ((ErrorSeverity.WARNING,), "warning"),
    ((ErrorSeverity.WARNING, ErrorSeverity.ERROR), "error"),
    ((ErrorSeverity.CRITICAL, ErrorSeverity.WARNING), "critical"),
])
def test_error_reporter_health_status(severities, status):
    reporter = ErrorReporter()
    for i, severity in enumerate(severities):
        reporter.report_error(f"module{i}", "work", f"problem {i}", severity)
    health = reporter.get_health_status()
    assert health["status"] == status
    assert health["recent_error_count"] == len(severities)
    assert health["critical_level_count"] == severities.count(ErrorSeverity.CRITICAL)
    assert health["error_level_count"] == severities.count(ErrorSeverity.ERROR)
    assert health["warning_level_count"] == severities.count(ErrorSeverity.WARNING)
    if severities:
        assert health["message"] == f"module{len(severities) - 1}/work: problem {len(severities) - 1}"
    else:
        assert health["message"] == "no errors"


def test_error_reporter_keeps_the_most_recent_errors():
    reporter = ErrorReporter(max_errors=3)
    ids = [reporter.report_error("m", "w", str(i)) for i in range(5)]
    assert [e.message for e in reporter.errors()] == ["2", "3", "4"]
    assert len(set(ids)) == 5
    assert reporter.get_health_status()["error_level_count"] == 5  # counts are not truncated


# ----------------------------------------------------------------------------- validator


def vtraj(uid, source, reward, acc, i=0, failed=False):
    t = {"uid": uid, "sample_index": i, "data_source": source, "score": {"reward": reward, "acc": acc}}
    if failed:
        t.update(failed=True, score={}, error="boom")
    return t


def test_validator_metric_names_and_values(tmp_path):
    recorder = RunRecorder(str(tmp_path))
    tracker = ActivityTracker(experiment_logger=recorder)
    v = Validator(OmegaConf.create({"n_samples": 1}))
    v.set_activity_tracker(ActivityTrackerProxy(tracker))
    samples = [vtraj("1", "gsm", 1.0, 1.0), vtraj("2", "gsm", 0.0, 0.5), vtraj("3", "math", 0.5, 0.0),
               vtraj("4", "math", 0.0, 0.0, failed=True)]
    for s in samples:
        assert v.put_trajectory(s) == "success"
    assert v.put_trajectory(vtraj("1", "gsm", 1.0, 1.0)) == "fail"  # a sample counts once
    metrics = v.compute_and_log_metrics(step=3)
    assert metrics["val/reward"] == pytest.approx(1.5 / 4)  # failed sample scores 0 in the denominator
    assert metrics["val/acc"] == pytest.approx(1.5 / 4)
    assert metrics["val/gsm_reward"] == 0.5
    assert metrics["val/gsm_acc"] == 0.75
    assert metrics["val/math_reward"] == 0.25
    assert metrics["val/math_acc"] == 0.0
    assert metrics["val/num_samples"] == 4.0
    assert metrics["val/num_failed"] == 1.0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert abs(rows[0].pop("time") - time.time()) < 60  # every row is stamped when it is written
    assert rows == [{"step": 3, **metrics}]
    assert tracker.error_reporter.get_health_status()["error_level_count"] == 1  # the duplicate
    v.clear()
    assert v.compute_metrics()["val/num_samples"] == 0.0 and v.trajectories() == []


def test_validator_is_complete_when_data_done_and_workers_quiescent(jsonl):
    tracker = ActivityTracker()
    tracker.register_module("rollout_worker_0", object(), is_rollout_worker=True)
    dl = loader(jsonl, is_validate=True)
    v = Validator(OmegaConf.create({"n_samples": 2}))
    v.set_activity_tracker(ActivityTrackerProxy(tracker))
    v.set_module_references(dl)
    dl.unlock_for_weight_sync()
    assert not v.is_complete()
    take(dl, len(ROWS))
    token = tracker.start("rollout_worker_0", "validate")
    assert not v.is_complete()
    tracker.end(token)
    assert v.is_complete()
    assert v.expected_samples() == 2 * len(ROWS)
    assert v.compute_metrics()["val/num_missing"] == 2 * len(ROWS)
