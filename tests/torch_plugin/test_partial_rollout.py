"""In-flight weight updates in the ``hf`` engine (``weight.partial_rollout``, issue #47 item 1): a
batch that is decoding takes new weights at its next decode-step boundary and each request goes on
from the tokens it has; every token records the weights that sampled it; the prefix's KV cache is
kept or computed again under the new weights."""

from __future__ import annotations

import threading

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.rollout.engine import HFInferenceEngine, _Update

PROMPT = "the quick brown fox"
PARAMS = SamplingParams(max_tokens=12, temperature=1.0, seed=7)


@pytest.fixture()
def engines(tiny_model_dir):
    made = []

    def make(**config):
        engine = HFInferenceEngine({"model_path": tiny_model_dir, "num_threads": 1, **config})
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


def _new_weights(engine, seed=1):
    g = torch.Generator().manual_seed(seed)
    return {name: p.detach() + 0.3 * torch.randn(p.shape, generator=g) for name, p in engine.model.named_parameters()}


def _decode_with_update(engine, update):
    """One request decoded while ``update`` waits for the batch (handed over once the batch decodes:
    taken at its first decode-step boundary; pending at a batch's start, it would be taken before
    the batch's first token)."""
    calls = []
    own = engine._use_decode_threads

    def decode_step_starts():  # called once as the batch starts, then at the top of each decode step
        calls.append(1)
        if len(calls) == 2:
            engine._update = update
        own()

    engine._use_decode_threads = decode_step_starts
    result: list = []
    caller = threading.Thread(target=lambda: result.append(engine.complete(PROMPT, PARAMS)))
    caller.start()
    caller.join(30)
    assert update.done.is_set() and update.error is None
    return result[0]


@pytest.mark.parametrize("fast_path", [True, False])
def test_a_running_batch_takes_new_weights_at_a_step_and_its_tokens_say_which(engines, fast_path):
    old = engines(fast_path=fast_path).complete(PROMPT, PARAMS)  # the whole reply under the old weights
    engine = engines(fast_path=fast_path)
    weights = _new_weights(engine)
    result = _decode_with_update(engine, _Update(weights, 1, recompute_prefix=True))
    assert engine.model_version() == 1
    n = len(result.response_token_ids)
    assert n > 2 and result.token_versions == [0] + [1] * (n - 1)
    assert result.model_version == 0  # the version that began it (staleness counts from there)
    # the first token is the old weights' (same seed, same draw); the rest are the new weights':
    # with the prefix recomputed, each one's log-prob is what the new model gives it after the prefix
    assert result.response_token_ids[0] == old.response_token_ids[0]
    assert result.response_logprobs[0] == pytest.approx(old.response_logprobs[0], abs=1e-5)
    [rescored] = engine.score([(result.prompt_token_ids, result.response_token_ids, 1.0)])
    assert max(abs(a - b) for a, b in zip(result.response_logprobs[1:], rescored[1:])) < 1e-4
    assert abs(result.response_logprobs[0] - rescored[0]) > 1e-3  # token 0 was not the new weights'


def test_keeping_the_prefix_cache_continues_from_the_old_keys(engines):
    engine = engines()
    recomputed = engines()
    weights = _new_weights(engine)
    kept = _decode_with_update(engine, _Update(weights, 1, recompute_prefix=False))
    again = _decode_with_update(recomputed, _Update(weights, 1, recompute_prefix=True))
    assert kept.token_versions[:2] == [0, 1] and again.token_versions[:2] == [0, 1]
    assert kept.response_token_ids[0] == again.response_token_ids[0]
    # the second token is the new weights' in both, over old keys in one and recomputed keys in the other
    assert kept.response_logprobs[1] != again.response_logprobs[1]


def test_an_in_flight_push_with_no_batch_running_is_taken_at_once(engines):
    engine = engines()
    weights = _new_weights(engine)
    done = threading.Event()
    with engine._model_lock:  # a batch holding the model: the push waits for a step boundary
        pusher = threading.Thread(target=lambda: (engine.load_weights(weights, 3, in_flight=True), done.set()))
        pusher.start()
        assert not done.wait(0.1)
    pusher.join(10)  # the batch gave the model back: the push took it itself
    assert done.is_set() and engine.model_version() == 3
    assert all(torch.equal(p, weights[name]) for name, p in engine.model.named_parameters())
    result = engine.complete(PROMPT, PARAMS)
    assert result.model_version == 3 and result.token_versions is None  # one version: not listed


def _recipe(tmp_path, model_dir, **weight):
    import yaml

    from tests.support.torch_fixtures import tiny_services

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "inline", "rows": [{"prompt": f"count {i}", "answer": "x"} for i in range(8)]},
        "rollout_worker": {"num_workers": 4, "sampling": {"max_tokens": 24}, "evaluator": {"type": "letter_share",
                                                                                          "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 4},
        "weight": {"backend": "in_process", **weight},
        "service": tiny_services(model_dir),
        "logger": {"samples_every": 1, "samples_per_step": 4}}))
    return str(path)


@pytest.mark.parametrize("overrides, line", [
    (["weight.sync_mode=sync", "weight.staleness_threshold=0"],
     "error: weight.partial_rollout: does nothing without weight.sync_mode other than sync"),
    (["weight.partial_rollout=false", "weight.partial_rollout_prefix=recompute"],
     "error: weight.partial_rollout_prefix: does nothing without weight.partial_rollout"),
    (["+service.inference_service.replicas=2"], "error: weight.partial_rollout: the hf engine takes in-flight "
                                                "updates with one replica (service.inference_service.replicas: 1)"),
    (["weight.backend=version_only"], "error: weight.partial_rollout: needs 'weight_sync:in_flight' (weights pushed "
                                      "while requests decode"),
])
def test_partial_rollout_is_refused_where_it_cannot_work(cli, tmp_path, tiny_model_dir, overrides, line):
    recipe = _recipe(tmp_path, tiny_model_dir, sync_mode="fully-async", staleness_threshold=2, partial_rollout=True)
    for command in ("validate", "run"):
        code, out, errors, err = cli(command, recipe, *overrides)
        assert code == 2 and any(e.startswith(line) for e in errors), (command, err)


def test_a_fully_async_run_with_partial_rollout_trains_and_records_token_versions(cli, tmp_path, tiny_model_dir):
    import json

    recipe = _recipe(tmp_path, tiny_model_dir, sync_mode="fully-async", staleness_threshold=2, partial_rollout=True,
                     partial_rollout_prefix="recompute")
    code, out, errors, err = cli("run", recipe)
    assert code == 0, err
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/grad_norm" in r]
    assert len(steps) == 4 and all(r["train/grad_norm"] > 0 for r in steps)
    samples = [json.loads(line) for line in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    for sample in samples:
        versions = sample.get("token_versions")
        if versions is not None:  # never going back, and only versions the run pushed
            assert versions == sorted(versions) and set(versions) <= set(range(5))
