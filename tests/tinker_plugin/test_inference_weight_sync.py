"""The ``tinker`` inference and weight-sync backends, through the plugin manager and the core's controller."""

from __future__ import annotations

import threading
import warnings

import pytest
from omegaconf import OmegaConf

from nexrl_core import InferenceError, SamplingParams, WeightSyncController
from nexrl_core.plugins import PluginManager
from nexrl_tinker.datums import build_datum
from nexrl_tinker.service import TinkerTrainService
from nexrl_tinker.standin import Fault
from tests.tinker_plugin.helpers import API_KEY, MODEL


@pytest.fixture
def plugin_manager(monkeypatch):
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-tinker")
    return PluginManager()


def _inference_config(standin, tiny_folder, **overrides):
    return {"backend": "tinker", "base_model": MODEL, "tokenizer_path": tiny_folder, "base_url": standin.url,
            "api_key": API_KEY, **overrides}


@pytest.fixture
def make_client(plugin_manager):
    clients = []

    def make(config):
        cls = plugin_manager.resolve("inference_backend", "tinker", "service.inference_service.backend")
        client = cls(OmegaConf.create(config))
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close()


def test_completions_carry_prompt_and_response_tokens_and_logprobs(standin, make_client, tiny_folder, tokenizer):
    client = make_client(_inference_config(standin, tiny_folder))
    messages = [{"role": "user", "content": "what is two plus three?"}]
    result = client.complete(messages, SamplingParams(max_tokens=5, temperature=1.0, seed=3))
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert result.prompt_token_ids == tokenizer(rendered, add_special_tokens=False).input_ids
    assert len(result.response_token_ids) == len(result.response_logprobs) <= 5
    assert all(lp <= 0 for lp in result.response_logprobs)
    assert result.text == tokenizer.decode(result.response_token_ids, skip_special_tokens=True)
    assert result.model_version == 0
    again = client.complete(messages, SamplingParams(max_tokens=5, temperature=1.0, seed=3))
    assert again.response_token_ids == result.response_token_ids  # the seed travels to the sampler
    plain = client.complete("the quick brown", SamplingParams(max_tokens=3, temperature=0))
    assert plain.prompt_token_ids == tokenizer("the quick brown").input_ids

    # A stop string: the sampler stops on it, the text ends right before it, the tokens stay as sampled.
    greedy = client.complete("the quick brown", SamplingParams(max_tokens=8, temperature=0))
    stop = greedy.text[3:5]
    stopped = client.complete("the quick brown", SamplingParams(max_tokens=8, temperature=0, stop=[stop]))
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    assert greedy.text.startswith(stopped.text)
    assert stop in tokenizer.decode(stopped.response_token_ids, skip_special_tokens=True)


def test_sampling_failures_are_retried_then_reported(make_standin, make_client, tiny_folder):
    standin = make_standin(faults=[Fault("asample", 1, "request_failed")])
    client = make_client(_inference_config(standin, tiny_folder, max_retries=1, retry_backoff=0.01))
    assert client.complete("hello", SamplingParams(max_tokens=2)).response_token_ids
    standin.faults.append(Fault("asample", 1, "request_failed", count=2))
    with pytest.raises(InferenceError, match=r"Tinker sample \(\d+ prompt tokens, max_tokens 2, weights v0\) failed"):
        client.complete("hello", SamplingParams(max_tokens=2))


def test_config_errors(standin, tiny_folder, plugin_manager):
    cls = plugin_manager.resolve("inference_backend", "tinker", "service.inference_service.backend")
    from nexrl_core import ConfigError

    with pytest.raises(ConfigError, match="service.inference_service.tokenizer_path: required"):
        cls(_inference_config(standin, None))
    with pytest.raises(ConfigError, match="tokenizer_path: '/nope' is not a folder"):
        cls(_inference_config(standin, "/nope"))
    client = cls(_inference_config(standin, tiny_folder, base_model=None))
    with pytest.raises(InferenceError, match="has no sampler yet"):
        client.complete("hi", SamplingParams(max_tokens=1))


class _TinkerTrainer:
    """The part of a Tinker trainer the weight sync uses: its current weights as a sampling client."""

    def __init__(self, service: TinkerTrainService):
        self.service = service

    def export_weights(self):
        return self.service.sampling_client()


def test_weight_sync_serves_each_new_version(standin, make_client, tiny_folder, tokenizer, plugin_manager):
    client = make_client(_inference_config(standin, tiny_folder, base_model=None))
    service = TinkerTrainService({"base_model": MODEL, "lora_rank": 4, "lr": 2e-2, "base_url": standin.url,
                                  "api_key": API_KEY}, seed=0)
    try:
        backend = plugin_manager.resolve("weight_sync_backend", "tinker", "weight.backend")(OmegaConf.create({}))
        controller = WeightSyncController(OmegaConf.create({"sync_mode": "sync"}), backend)
        controller.set_module_references(None, None, trainer=_TinkerTrainer(service), inference_client=client)
        controller.sync_weight_to_rollout_service()  # what the controller does before the first rollout
        prompt = "the quick brown"
        greedy = SamplingParams(max_tokens=6, temperature=0)
        before = client.complete(prompt, greedy)
        assert before.model_version == 0

        datum = build_datum(tokenizer(prompt).input_ids, tokenizer(" fox jumps over the lazy dog").input_ids,
                            "cross_entropy")
        for _ in range(3):
            controller.train_worker_notify_step_start("trainer")
            service.train_step([datum], "cross_entropy")
            controller.train_worker_notify_weight_update("trainer")
        after = client.complete(prompt, greedy)
        assert after.model_version == 3 == controller.get_rollout_model_version()
        assert after.response_token_ids != before.response_token_ids
        assert after.text.startswith(" fox")
    finally:
        service.close()


def test_weight_sync_needs_a_tinker_trainer_and_client(standin, make_client, tiny_folder, plugin_manager):
    from nexrl_core import ConfigError

    backend = plugin_manager.resolve("weight_sync_backend", "tinker", "weight.backend")(OmegaConf.create({}))

    class LocalTrainer:
        def export_weights(self):
            return {"w": 0}

    client = make_client(_inference_config(standin, tiny_folder))
    with pytest.raises(ConfigError, match="needs a trainer that trains through Tinker"):
        backend.sync(LocalTrainer(), client, 1)


def test_the_client_is_unhealthy_when_the_service_stops_answering(make_standin, make_client, tiny_folder):
    """Before, the client always answered healthy: a service that went away was found only by the
    rollouts' failures."""
    from nexrl_core.runtime.activity import _health_problem

    standin = make_standin()
    client = make_client(_inference_config(standin, tiny_folder, request_timeout=2.0, max_retries=0))
    assert client.health_check() is True
    threads = threading.active_count()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # through the SDK's current API, not a deprecated one
        for _ in range(5):  # a run checks every few seconds: no thread or connection left behind per check
            assert _health_problem(client, 10.0) is None
    assert threading.active_count() <= threads
    standin.stop()
    problem = _health_problem(client, 5.0)
    assert problem is not None and ("health check" in problem or "no answer within" in problem), problem
