"""Weight pushes off the trainer's thread (``weight.background_push``, issue #47): the push returns
before the engine has the weights; the engine copies them on its own thread; the trainer's next
optimizer step waits until they are copied (no copy of the weights is made); a push that fails its
check leaves nothing sampled under it."""

from __future__ import annotations

import threading

import pytest
import torch

from nexrl_core import InferenceError
from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService

PROMPT = "the quick brown fox"
PARAMS = SamplingParams(max_tokens=6, temperature=1.0, seed=7)


@pytest.fixture()
def engine(tiny_model_dir):
    made = HFInferenceEngine({"model_path": tiny_model_dir, "num_threads": 1})
    yield made
    made.close()


@pytest.fixture()
def service(tiny_model_dir):
    made = LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-2, "num_threads": 1})
    yield made
    made.close()


def _nudge(service):
    """Gradients on every trained weight, so the next optim_step moves them all."""
    for p in service._params:
        p.grad = torch.ones_like(p)


def _snapshot(weights):
    return {k: v.detach().clone() for k, v in weights.items()}


def _equal(model, weights):
    own = model.state_dict()
    return all(torch.equal(own[k], v) for k, v in weights.items())


def test_the_push_returns_before_the_engine_has_the_weights_and_the_trainer_step_waits_for_the_copy(engine, service):
    _nudge(service)
    service.optim_step()  # the trainer's weights differ from the engine's (both started from one folder)
    pushed = _snapshot(service.export_weights())
    assert not _equal(engine.model, pushed)
    done: list = []
    with engine._model_lock:  # a batch decoding: the engine takes the weights only after it
        assert engine.push_weights(service.export_weights(), 1, on_done=done.append) is True
        assert engine.model_version() == 0 and not done  # returned before the engine had them
        _nudge(service)
        stepped = threading.Event()
        trainer = threading.Thread(target=lambda: (service.optim_step(), stepped.set()))
        trainer.start()
        # the step would overwrite the tensors the engine has still to read: it waits for the copy
        assert not stepped.wait(0.3)
        assert _equal(service.model, pushed)
    trainer.join(30)
    assert stepped.is_set() and done == [None] and engine.model_version() == 1
    assert _equal(engine.model, pushed)  # the pushed values, not the step's after them
    assert not _equal(service.model, pushed)
    result = engine.complete(PROMPT, PARAMS)
    assert result.model_version == 1 and result.token_versions is None


def test_an_idle_engine_takes_a_push_on_its_own_thread(engine, service):
    _nudge(service)
    service.optim_step()
    threads: list[str] = []
    done = threading.Event()
    engine.push_weights(service.export_weights(), 4, after_apply=lambda: threads.append(threading.current_thread().name),
                        on_done=lambda error: done.set())
    assert done.wait(30)
    assert threads == [engine._thread.name] and engine.model_version() == 4
    assert _equal(engine.model, service.export_weights())


def test_a_push_between_batches_waits_for_the_running_batch(engine, service):
    """Without weight.partial_rollout the running batch ends under the weights it began with."""
    _nudge(service)
    service.optim_step()
    calls = []
    own = engine._use_decode_threads

    def decode_step_starts():  # the batch's start, then each decode step: the push arrives mid-batch
        calls.append(1)
        if len(calls) == 3:
            engine.push_weights(service.export_weights(), 1, in_flight=False)
        own()

    engine._use_decode_threads = decode_step_starts
    first = engine.complete(PROMPT, PARAMS)
    engine._use_decode_threads = own
    assert first.model_version == 0 and first.token_versions is None  # every token the old weights'
    second = engine.complete(PROMPT, PARAMS)
    assert second.model_version == 1 and _equal(engine.model, service.export_weights())


def test_an_in_flight_push_records_which_weights_sampled_each_token(engine, service):
    _nudge(service)
    service.optim_step()
    calls = []
    own = engine._use_decode_threads

    def decode_step_starts():
        calls.append(1)
        if len(calls) == 3:  # after two tokens
            engine.push_weights(service.export_weights(), 1, in_flight=True)
        own()

    engine._use_decode_threads = decode_step_starts
    result = engine.complete(PROMPT, SamplingParams(max_tokens=12, temperature=1.0, seed=7))
    n = len(result.response_token_ids)
    assert n > 2 and result.token_versions == [0, 0] + [1] * (n - 2) and result.model_version == 0


def test_a_push_that_fails_its_check_leaves_nothing_sampled_under_it(engine, service):
    errors: list = []

    def check():
        raise RuntimeError("served probe mismatch")

    engine.push_weights(service.export_weights(), 1, after_apply=check, on_done=errors.append)
    _nudge(service)
    service.optim_step()  # released even though the push failed: the trainer is not left waiting
    assert len(errors) == 1 and "served probe mismatch" in str(errors[0])
    assert not engine.health_check()
    with pytest.raises(InferenceError, match="a push failed"):
        engine.complete(PROMPT, PARAMS)


def test_a_push_the_engine_never_takes_is_released_when_it_closes(tiny_model_dir, service):
    engine = HFInferenceEngine({"model_path": tiny_model_dir, "num_threads": 1})
    errors: list = []
    with engine._model_lock:
        engine.push_weights(service.export_weights(), 1, on_done=errors.append)
        closer = threading.Thread(target=engine.close)
        closer.start()
    closer.join(30)
    _nudge(service)
    service.optim_step()  # not left waiting for a reader that is gone
    assert len(errors) <= 1


def test_exported_weights_pickle_as_a_plain_dict(service):
    import pickle

    exported = service.export_weights()
    assert hasattr(exported, "hold")
    again = pickle.loads(pickle.dumps(exported))
    assert type(again) is dict and again.keys() == exported.keys()


def _async_recipe(tmp_path, model_dir, name, **weight):
    from tests.support.letters import tiny_grpo_recipe

    cfg = tiny_grpo_recipe(tmp_path / name, model_dir, group=4, steps=4,
                           weight={"sync_mode": "fully-async", "staleness_threshold": 1, "rollouts_ahead": "staleness",
                                   "backend": "in_process", **weight})
    return cfg


def _run(tmp_path, cfg, plugin=None):
    import json

    import yaml

    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe
    from tests.support.letters import grpo_plugin_manager

    path = tmp_path / f"{tmp_path.name}.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    pm = grpo_plugin_manager()
    if plugin is not None:
        pm.register(plugin, name="test-backend", distribution="nexrl-test (in-process)")
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    pushed: list[bool] = []
    engine = controller.inference_client
    push = engine.push_weights
    engine.push_weights = lambda *a, **k: pushed.append(push(*a, **k)) or pushed[-1]
    try:
        controller.run()
    finally:
        rows = [json.loads(line) for line in (tmp_path / cfg["run_dir"] / "metrics.jsonl").read_text().splitlines()]
    return controller, [r for r in rows if "train/reward_mean" in r], pushed


@pytest.mark.parametrize("partial", [True, False])
def test_an_async_run_pushes_off_the_trainer_thread_and_ends_serving_its_last_weights(tmp_path, tiny_model_dir,
                                                                                       partial):
    from tests.support.weights import same_weights

    # the async default (partial); asked for by name (whole batches)
    cfg = _async_recipe(tmp_path, tiny_model_dir, "run", partial_rollout=partial,
                        **({} if partial else {"background_push": True}))
    controller, steps, pushed = _run(tmp_path, cfg)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and all(r["train/grad_norm"] > 0 for r in steps)
    assert pushed == [True] * 4  # every step's push went to the engine's thread
    assert all(r["weight/served_version_ok"] == 1.0 and r["weight/served_probe_gap"] < 1e-4 for r in steps[1:])
    assert all(r["train/token_staleness_max"] <= 1 for r in steps)
    engine, trainer = controller.inference_client, controller.trainer
    assert engine.model_version() == 4  # the last push landed before the run ended
    assert same_weights(engine.model.state_dict(), dict(trainer.train_service.export_weights()))


def test_an_async_run_whose_background_pushes_never_arrive_trains_nothing_sampled_after_them(tmp_path, tiny_model_dir):
    from nexrl_core import hookimpl
    from nexrl_core.controller import RunFailed
    from nexrl_torch.rollout.weights import InProcessWeightSync

    class Nothing(dict):
        def hold(self):
            return lambda: None

    class LostPush(InProcessWeightSync):
        """Hands the engine no tensors, only the version number (the weights never arrive)."""

        def sync_in_background(self, trainer, inference_client, version, after_apply, on_done):
            inference_client.push_weights(Nothing(), version, self.in_flight, False, after_apply, on_done)
            return True

    class Plugin:
        @hookimpl
        def nexrl_weight_sync_backends(self):
            return {"lost_push": LostPush}

    cfg = _async_recipe(tmp_path, tiny_model_dir, "lost", partial_rollout=True, backend="lost_push",
                        background_push=True)
    with pytest.raises(RunFailed, match="pushing weights v1 to the inference service failed.*did not reach it"):
        _run(tmp_path, cfg, Plugin())
    import json

    rows = [json.loads(line) for line in (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert steps  # step 1 trains on v0's rollouts
    # step k is trained while the trainer is at version k-1: every token it trained was v0's
    assert all(r["train/token_staleness_mean"] == r["step"] - 1 for r in steps)


def test_pushes_stay_on_the_trainer_thread_when_asked(tmp_path, tiny_model_dir):
    cfg = _async_recipe(tmp_path, tiny_model_dir, "foreground", partial_rollout=True, background_push=False)
    controller, steps, pushed = _run(tmp_path, cfg)
    assert [r["step"] for r in steps] == [1, 2, 3, 4] and pushed == []  # never handed to the engine's thread
    assert all("weight/apply_s" not in r for r in steps) and controller.inference_client.model_version() == 4
