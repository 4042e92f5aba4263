"""The CPU threads split between the in-process engine and a trainer computing beside it
(``weight.rollouts_ahead``, ``decode_threads: auto``): while both compute each keeps its part; with
``lend_idle_threads`` a side computing nothing lends the other its threads, taken at the next layer or
decode step (nexrl_torch.cpu_threads.ThreadShare)."""

from __future__ import annotations

import threading

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch import cpu_threads
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import grpo_loss, random_batch

pytestmark = pytest.mark.skipif(not cpu_threads._thread_setters(),
                                reason="torch here has no OpenMP thread count to set per thread")


@pytest.fixture
def two_torch_threads():
    previous = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    cpu_threads.end_share()
    torch.set_num_threads(previous)


def _on_a_thread(fn):
    box = {}

    def run():
        try:
            box["value"] = fn()
        except BaseException as exc:  # noqa: BLE001 - re-raised on the test's thread
            box["error"] = exc

    thread = threading.Thread(target=run)
    thread.start()
    thread.join(120)
    if "error" in box:
        raise box["error"]
    return box["value"]


@pytest.mark.parametrize("lend_idle", [True, False])
def test_each_side_gets_its_part_while_both_compute_and_all_while_the_other_waits(lend_idle):
    share = cpu_threads.ThreadShare(4, 1, lend_idle)
    assert share.threads_for("engine") == (4 if lend_idle else 1)
    assert share.threads_for("trainer") == (4 if lend_idle else 3)
    share.computing("trainer", True)
    assert share.threads_for("engine") == 1
    assert share.threads_for("trainer") == (4 if lend_idle else 3)
    share.computing("engine", True)
    assert (share.threads_for("engine"), share.threads_for("trainer")) == (1, 3)
    share.computing("trainer", False)
    assert (share.threads_for("engine"), share.threads_for("trainer")) == ((4 if lend_idle else 1), 3)
    with pytest.raises(ValueError, match="at least one of 2 threads"):
        cpu_threads.ThreadShare(2, 2, True)


def test_the_trainer_takes_the_engines_threads_at_the_layer_after_the_engine_stops(
        tiny_model_and_tokenizer, two_torch_threads):
    """A real forward and backward of the train service: its layers run on the trainer's part while
    the engine computes, and on both threads from the first layer after the engine stopped, in the
    forward and in the backward."""
    model, tokenizer = tiny_model_and_tokenizer
    service = LocalTorchTrainService({"lr": 1e-3}, model=model, tokenizer=tokenizer)
    share = cpu_threads.start_share(2, 1, lend_idle=True)
    layers = list(model.model.layers)
    assert len(layers) >= 2
    seen: list[tuple[str, int, int]] = []
    engine_stops_at: list[int] = []

    def record(index):
        def before(module, args):
            seen.append(("forward", index, torch.get_num_threads()))
            if engine_stops_at and engine_stops_at[0] == index:
                share.computing("engine", False)  # the engine's batch ends while the trainer is at this layer

        def after(module, args, output):
            hidden = output[0] if isinstance(output, tuple) else output
            if hidden.requires_grad:
                hidden.register_hook(lambda grad: seen.append(("backward", index, torch.get_num_threads())))
        return before, after

    for index, layer in enumerate(layers):  # after the service's own hooks: they see the count it set
        before, after = record(index)
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)

    def step():
        service.forward_backward(random_batch(0), grpo_loss())
        counts = list(seen)
        seen.clear()
        return counts

    share.computing("engine", True)
    both = _on_a_thread(step)
    assert both and {threads for _, _, threads in both} == {1}, both  # forward and backward on its one thread

    engine_stops_at.append(0)
    switched = _on_a_thread(step)
    forward = [threads for phase, _, threads in switched if phase == "forward"]
    backward = [threads for phase, _, threads in switched if phase == "backward"]
    assert forward == [1] + [2] * (len(layers) - 1), switched  # from the next layer on: both threads
    assert backward and set(backward) == {2}, switched

    engine_stops_at.clear()
    alone = _on_a_thread(step)  # the engine idle throughout
    assert {threads for _, _, threads in alone} == {2}, alone
    assert share.threads_for("engine") == 2  # the trainer's call is over: it computes nothing now


def test_the_engine_decodes_on_its_part_while_the_trainer_computes_and_on_all_when_it_waits(
        tiny_model_and_tokenizer, two_torch_threads, monkeypatch):
    model, tokenizer = tiny_model_and_tokenizer
    engine = HFInferenceEngine({"max_batch_size": 4, "device": "cpu", "lend_idle_threads": True}, model=model,
                               tokenizer=tokenizer)
    decode_threads: list[int] = []
    follow = HFInferenceEngine._use_decode_threads

    def recorded(self):  # instrumentation: the real method runs, then the count it left is read
        follow(self)
        decode_threads.append(torch.get_num_threads())

    monkeypatch.setattr(HFInferenceEngine, "_use_decode_threads", recorded)
    try:
        assert engine.share_cpus_with_trainer() == 1
        share = cpu_threads.current_share()
        assert share is not None and (share.total, share.engine, share.lend_idle) == (2, 1, True)

        def generate():
            engine.complete("hello world", SamplingParams(max_tokens=6, temperature=1.0, seed=3))
            counts = list(decode_threads)
            decode_threads.clear()
            return counts

        share.computing("trainer", True)
        assert set(generate()) == {1}
        share.computing("trainer", False)
        assert set(generate()) == {2}
    finally:
        engine.close()
    assert cpu_threads.current_share() is None and torch.get_num_threads() == 2  # closed: the split ends


def test_without_lending_the_engine_keeps_its_part(tiny_model_and_tokenizer, two_torch_threads):
    model, tokenizer = tiny_model_and_tokenizer  # lend_idle_threads: false by default
    engine = HFInferenceEngine({"max_batch_size": 4, "device": "cpu"}, model=model, tokenizer=tokenizer)
    try:
        engine.share_cpus_with_trainer()
        share = cpu_threads.current_share()
        assert share is not None and not share.lend_idle and share.threads_for("engine") == 1
    finally:
        engine.close()
