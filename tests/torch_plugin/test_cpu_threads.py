"""A thread that has finished its work holds no OpenMP workers (nexrl_torch.cpu_threads): with more
OpenMP threads in the process than CPUs, libgomp stops spinning and every parallel op of the thread
that does compute pays a wake-up."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch import cpu_threads
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import grpo_loss, random_batch

pytestmark = pytest.mark.skipif(not cpu_threads._resolve(),
                                reason="torch's OpenMP runtime here is not GNU libgomp (nothing to pause)")


def _threads() -> set[str]:
    """The process's threads (ids), so threads other tests leave starting or ending do not count."""
    return set(os.listdir("/proc/self/task"))


@pytest.fixture
def two_torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(previous)


def _in_a_thread(fn):
    """``fn(workers)`` on a fresh thread; ``workers()`` starts an OpenMP team on that thread (a
    parallel matmul) and returns the threads that started with it."""
    box = {}

    def workers() -> set[str]:
        before = _threads()
        torch.randn(512, 512) @ torch.randn(512, 512)
        return _threads() - before

    def run():
        try:
            box["value"] = fn(workers)
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    if "error" in box:
        raise box["error"]
    return box["value"]


def _still_running(threads: set[str], timeout: float = 10.0) -> set[str]:
    """Which of ``threads`` still run once they have had ``timeout`` seconds to end (a paused worker
    exits soon after the pause)."""
    deadline = time.monotonic() + timeout
    while (alive := threads & _threads()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return alive


def test_a_paused_thread_gives_its_workers_back_and_gets_new_ones_when_it_computes_again(two_torch_threads):
    def body(workers):
        team = workers()
        cpu_threads.release_idle_workers()
        alive = _still_running(team)
        again = workers()  # the thread computes again, on a new team
        return team, alive, again

    team, alive, again = _in_a_thread(body)
    assert len(team) == 1  # two torch threads: the thread itself and one worker
    assert alive == set()
    assert len(again) == 1 and again != team
    cpu_threads.release_idle_workers()  # a thread that never had a team: nothing to do


def test_the_train_service_gives_back_its_callers_workers(tiny_model_and_tokenizer, two_torch_threads):
    model, tokenizer = tiny_model_and_tokenizer
    service = LocalTorchTrainService({"lr": 1e-3}, model=model, tokenizer=tokenizer)

    def body(workers):
        team = workers()
        metrics = service.forward_backward(random_batch(0), grpo_loss())
        return team, _still_running(team), metrics

    team, alive, metrics = _in_a_thread(body)
    assert len(team) == 1 and alive == set()
    assert torch.isfinite(torch.tensor(metrics["loss"]))


def test_the_engine_gives_back_its_own_workers_when_idle_and_its_callers_after_a_weight_load(
        tiny_model_and_tokenizer, two_torch_threads):
    model, tokenizer = tiny_model_and_tokenizer
    engine = HFInferenceEngine({"max_batch_size": 8}, model=model, tokenizer=tokenizer)
    try:
        before = _threads()
        results = []
        callers = [threading.Thread(target=lambda: results.append(
            engine.complete("hello world " * 20, SamplingParams(max_tokens=8)))) for _ in range(8)]
        for caller in callers:
            caller.start()
        for caller in callers:
            caller.join(60)
        assert len(results) == 8 and all(r.response_token_ids for r in results)
        # the engine's thread ran parallel ops while generating; idle, it holds no worker
        assert _still_running(_threads() - before) == set()

        weights = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}

        def body(workers):
            team = workers()
            engine.load_weights(weights, version=1)
            return team, _still_running(team)

        team, alive = _in_a_thread(body)
        assert len(team) == 1 and alive == set()
        assert engine.model_version() == 1
    finally:
        engine.close()
