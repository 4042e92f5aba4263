"""Overlap on one device (issue #47 item 4): with ``weight.rollouts_ahead`` the in-process engine
decodes the next batch while the local trainer steps, at most the bound ahead (so within the
staleness bound, nothing decoded only to be re-rolled), the two splitting the CPU threads."""

from __future__ import annotations

import json
import threading
import time

import pytest
import torch

from nexrl_core.weight_sync import WeightSyncController
from nexrl_torch.cpu_threads import use_threads


def _controller(**weight):
    return WeightSyncController({"sync_mode": "fully-async", "staleness_threshold": 2, **weight})


def test_rollouts_ahead_admits_the_bound_and_settled_rollouts_free_their_slots():
    wsc = _controller(rollouts_ahead="staleness")
    assert wsc.bound_rollouts_ahead(4) == 8  # staleness_threshold batches
    assert wsc.begin_rollouts(count=20) == 8 and not wsc.begin_rollout()
    assert wsc.check_rollout_service_status() == "block"
    wsc.end_rollouts(landed=7, returned=1)  # one did not land: its slot is free again
    assert wsc.begin_rollout() and not wsc.begin_rollout()
    wsc.rollouts_settled(count=4)  # the trainer took a batch of 4
    assert wsc.begin_rollouts(count=20) == 4 and wsc.rollouts_unsettled() == 8
    wsc.return_rollout_slots(count=2)  # dynamic sampling dropped a group of 2
    assert wsc.begin_rollouts(count=20) == 2

    waiter = threading.Thread(target=wsc.wait_rollout_allowed, args=("default", 10.0))
    waiter.start()
    time.sleep(0.05)
    assert waiter.is_alive()  # blocked at the bound
    wsc.rollouts_settled(count=1)
    waiter.join(5)
    assert not waiter.is_alive()


@pytest.mark.parametrize("weight, bound", [
    ({}, None),  # no bound: fully-async rollouts never wait
    ({"rollouts_ahead": 3}, 3),
    ({"rollouts_ahead": "staleness", "staleness_threshold": 0}, 4),  # at least one batch ahead
    ({"rollouts_ahead": "staleness", "sync_mode": "sync", "staleness_threshold": 0}, None),
])
def test_the_bound_each_setting_gives(weight, bound):
    wsc = _controller(**weight)
    assert wsc.bound_rollouts_ahead(4) == bound
    admitted = wsc.begin_rollouts(count=50)
    assert admitted == (50 if bound is None else bound)


def test_use_threads_sets_the_calling_threads_count_only():
    seen: dict[str, int] = {}
    before = torch.get_num_threads()

    def narrowed():
        use_threads(1)
        seen["narrowed"] = torch.get_num_threads()
        torch.ones(64, 64) @ torch.ones(64, 64)  # a parallel region keeps the count
        seen["after_op"] = torch.get_num_threads()

    def other():
        seen["other"] = torch.get_num_threads()

    with torch.inference_mode():
        torch.set_num_threads(2)
        try:
            for target in (narrowed, other):
                thread = threading.Thread(target=target)
                thread.start()
                thread.join()
            assert seen == {"narrowed": 1, "after_op": 1, "other": 2}
            assert torch.get_num_threads() == 2
        finally:
            torch.set_num_threads(before)
    with pytest.raises(ValueError, match="positive thread count"):
        use_threads(0)


def _recipe(tmp_path, model_dir, steps=4, **weight):
    import yaml

    from tests.support.torch_fixtures import tiny_services

    services = tiny_services(model_dir)
    for section in services.values():  # the process's threads (the test's 2), split between the two
        section.pop("num_threads")
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": f"count {i}", "answer": "x"} for i in range(16)]},
        "rollout_worker": {"num_workers": 4, "sampling": {"max_tokens": 16},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": steps},
        "weight": {"backend": "in_process", **weight},
        "service": services}))
    return str(path)


@pytest.mark.parametrize("lend", [False, True])
def test_the_engine_decodes_the_next_batch_while_the_trainer_steps(cli, tmp_path, tiny_model_dir, monkeypatch, lend):
    """Real run (tiny model, hf engine, local torch trainer in one process): a decode batch starts
    inside a training step's interval, on the engine's half of the threads while the trainer's
    thread runs on the other half (with lend_idle_threads, a batch decoded while the trainer waits
    runs on both); staleness stays within the bound and nothing is re-rolled stale."""
    from nexrl_core.trainer import BaseTrainer
    from nexrl_torch.rollout.engine import HFInferenceEngine

    generations: list[tuple[float, float, int]] = []
    steps: list[tuple[float, float, int]] = []
    generate, train_step = HFInferenceEngine._generate, BaseTrainer._train_step

    def timed_generate(self, batch):  # instrumentation: the real method runs
        start, threads = time.monotonic(), torch.get_num_threads()
        try:
            return generate(self, batch)
        finally:
            generations.append((start, time.monotonic(), max(threads, torch.get_num_threads())))

    def timed_step(self, *args, **kwargs):
        start, threads = time.monotonic(), torch.get_num_threads()
        try:
            return train_step(self, *args, **kwargs)
        finally:
            steps.append((start, time.monotonic(), threads))

    monkeypatch.setattr(HFInferenceEngine, "_generate", timed_generate)
    monkeypatch.setattr(BaseTrainer, "_train_step", timed_step)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    recipe = _recipe(tmp_path, tiny_model_dir, sync_mode="fully-async", staleness_threshold=1,
                     rollouts_ahead="staleness")
    try:
        code, out, errors, err = cli("run", recipe, f"+service.inference_service.lend_idle_threads={str(lend).lower()}")
        assert code == 0, err
        assert torch.get_num_threads() == 2  # the engine gave the process its threads back on close
    finally:
        torch.set_num_threads(before)

    assert len(steps) == 4
    inside = [g for g in generations if any(s0 < g[0] < s1 for s0, s1, _ in steps)]
    assert inside, (generations, steps)  # decoding began while a step was training
    if lend:  # the first batch decodes before the first step: the trainer lends its thread (test_thread_share)
        assert 2 in {threads for _, _, threads in generations} <= {1, 2}, (generations, steps)
    else:
        assert {threads for _, _, threads in generations} == {1}, (generations, steps)  # decode_threads auto: 1 of 2
        assert {threads for _, _, threads in steps} == {1}  # the trainer's thread: the other one

    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    trained = [r for r in rows if "timing/train_s" in r]
    assert max(r["train/token_staleness_max"] for r in trained) <= 1
    assert max(r["train/staleness_max"] for r in trained) == 1  # it did train on the batch decoded ahead
    assert trained[-1]["pool/stale_rerolled"] == 0  # nothing decoded only to be thrown away


@pytest.mark.parametrize("override, line", [
    ("+weight.rollouts_ahead=0", "error: weight.rollouts_ahead: expected null, 'staleness' or a positive integer"),
    ("+weight.rollouts_ahead=soon", "error: weight.rollouts_ahead: expected null, 'staleness' or a positive integer"),
    ("+service.inference_service.decode_threads=0", "error: service.inference_service.decode_threads: expected "
                                                    "'auto', null or a positive integer"),
])
def test_bad_overlap_settings_are_refused_naming_the_key(cli, tmp_path, tiny_model_dir, override, line):
    recipe = _recipe(tmp_path, tiny_model_dir, sync_mode="fully-async", staleness_threshold=1)
    code, out, errors, err = cli("validate", recipe, override)
    assert code == 2 and any(e.startswith(line) for e in errors), err


def test_rollouts_ahead_in_sync_mode_is_refused(cli, tmp_path, tiny_model_dir):
    recipe = _recipe(tmp_path, tiny_model_dir, sync_mode="sync", rollouts_ahead="staleness")
    code, out, errors, err = cli("validate", recipe)
    assert code == 2 and any(e.startswith("error: weight.rollouts_ahead: does nothing without weight.sync_mode "
                                          "other than sync") for e in errors), err
