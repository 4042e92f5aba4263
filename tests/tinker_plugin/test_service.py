"""nexrl's Tinker train service on the real SDK, against the stand-in."""

from __future__ import annotations

import json
import logging
import time

import numpy as np
import pytest
from loguru import logger

from nexrl_core import ConfigError, DataError
from nexrl_tinker.datums import build_datum
from nexrl_tinker.remote import TinkerRequestError, resolve_connection
from nexrl_tinker.service import LearningRateSchedule, TinkerTrainService
from nexrl_tinker.standin import Fault
from tests.tinker_plugin.helpers import API_KEY, MODEL

TEXTS = [("the quick brown", " fox jumps over the lazy dog"), ("count: one, two,", " three, four, five")]


def _config(standin, **overrides):
    return {"backend": "tinker", "base_model": MODEL, "lora_rank": 4, "lr": 1e-2, "base_url": standin.url,
            "api_key": API_KEY, **overrides}


@pytest.fixture
def make_service():
    services = []

    def make(config, **kwargs):
        service = TinkerTrainService(config, seed=0, **kwargs)
        services.append(service)
        return service

    yield make
    for service in services:
        service.close()


def _datums(tokenizer):
    return [build_datum(tokenizer(p).input_ids, tokenizer(r).input_ids, "cross_entropy") for p, r in TEXTS]


def _greedy(sampler, ids):
    from tinker import types

    params = types.SamplingParams(max_tokens=6, temperature=0.0, stop=[])
    return list(sampler.sample(types.ModelInput.from_ints(ids), 1, params).result().sequences[0].tokens)


def test_train_steps_lower_the_loss_and_sampling_follows_the_weights(standin, make_service, tokenizer):
    service = make_service(_config(standin))
    datums = _datums(tokenizer)
    prompt = tokenizer(TEXTS[0][0]).input_ids
    before = _greedy(service.sampling_client(), prompt)
    results = [service.train_step(datums, "cross_entropy") for _ in range(4)]
    losses = [r.metrics["loss_sum"] for r in results]
    assert losses[-1] < 0.5 * losses[0], losses
    assert {"loss_sum", "grad_norm", "lr"} <= set(results[0].metrics)
    assert results[0].metrics["lr"] == pytest.approx(1e-2)
    assert len(results[0].outputs) == 2 and results[0].outputs[0]["logprobs"].shape == (datums[0].model_input.length,)
    after = _greedy(service.sampling_client(), prompt)
    assert after != before
    assert service.optimizer_steps == 4
    # Forward and backward really were submitted back to back: the server saw them in seq order.
    assert standin.count("POST /api/v1/forward_backward") == 4 and standin.count("POST /api/v1/optim_step") == 4


def test_learning_rate_schedules():
    constant = LearningRateSchedule(1.0, "constant", warmup_steps=4)
    assert [constant(s) for s in range(6)] == [0.25, 0.5, 0.75, 1.0, 1.0, 1.0]
    linear = LearningRateSchedule(1.0, "linear", warmup_steps=2, decay_steps=6, min_lr_ratio=0.2)
    assert [round(linear(s), 6) for s in range(8)] == [0.5, 1.0, 1.0, 0.8, 0.6, 0.4, 0.2, 0.2]
    cosine = LearningRateSchedule(2.0, "cosine", decay_steps=4)
    assert [round(cosine(s), 6) for s in range(5)] == [2.0, round(1 + np.cos(np.pi / 4), 6), 1.0,
                                                      round(1 - np.cos(np.pi / 4), 6), 0.0]


def test_each_step_sends_the_scheduled_learning_rate(standin, make_service, tokenizer):
    service = make_service(_config(standin, lr_schedule="linear", lr_warmup_steps=1), total_steps=3)
    datums = _datums(tokenizer)
    sent = [service.train_step(datums, "cross_entropy").metrics for _ in range(3)]
    assert [m["lr"] for m in sent] == pytest.approx([1e-2, 1e-2, 5e-3])
    assert [m["learning_rate"] for m in sent] == pytest.approx([1e-2, 1e-2, 5e-3])  # what the server applied


def test_bad_config_values_name_the_key(standin):
    for change, message in [({"base_model": None}, "service.train_service.base_model: required"),
                            ({"lora_rank": 0}, "lora_rank: expected a positive integer, got 0"),
                            ({"lr_schedule": "step"}, "lr_schedule: 'step' is not one of constant, linear, cosine"),
                            ({"betas": [0.9]}, r"betas: expected \[beta1, beta2\]"),
                            ({"request_timeout": -1}, "request_timeout: expected a positive number, got -1"),
                            ({"min_lr_ratio": 2}, "min_lr_ratio: expected a number >= 0 and <= 1, got 2"),
                            ({"lr": "1e-4"}, "lr: expected a number, got a string .* write 1.0e-5"),
                            ({"train_mlp": False, "train_attn": False, "train_unembed": False}, "at least one of"),
                            ({"lorarank": 4}, "service.train_service.lorarank: unknown key; did you mean "
                                              "'service.train_service.lora_rank'")]:
        with pytest.raises(ConfigError, match=message):
            TinkerTrainService(_config(standin, **change))


def test_recipe_sections_come_as_omegaconf_with_env_interpolation(standin, make_service, monkeypatch):
    from omegaconf import OmegaConf

    monkeypatch.setenv("MY_TINKER_KEY", API_KEY)
    section = OmegaConf.create({"backend": "tinker", "base_model": MODEL, "base_url": standin.url, "lr": 0.5,
                                "betas": [0.8, 0.9], "api_key": "${oc.env:MY_TINKER_KEY}"})
    service = make_service(section)
    assert service.connection.api_key == API_KEY and service.adam["beta1"] == 0.8
    assert API_KEY not in repr(service.connection)
    monkeypatch.delenv("MY_TINKER_KEY")
    with pytest.raises(ConfigError, match=r"service.train_service.api_key: .*MY_TINKER_KEY"):
        TinkerTrainService(section)


def test_checkpoint_resume_continues_with_the_same_optimizer_state(standin, make_service, tokenizer, tmp_path):
    datums = _datums(tokenizer)
    config = _config(standin, lr_schedule="cosine")
    first = make_service(config, total_steps=4)
    for _ in range(2):
        first.train_step(datums, "cross_entropy")
    folder = tmp_path / "global_step_2"
    folder.mkdir()
    first.save_state(str(folder), extra_state={"note": [1, 2]})
    state = json.loads((folder / "tinker_state.json").read_text())
    path = state["tinker_path"]
    assert state == {"format": 1, "tinker_path": path, "sampler_path": state["sampler_path"], "base_model": MODEL,
                     "lora_rank": 4, "optimizer_steps": 2, "model_id": first.training_client.model_id,
                     "extra_state": {"note": [1, 2]}}
    assert path.startswith("tinker://") and path.endswith("/weights/optim_step_2")
    assert state["sampler_path"].endswith("/sampler_weights/optim_step_2")
    first.save_state(str(folder), extra_state={"note": [1, 2]})  # again at one step (save_on_stop): one snapshot
    assert json.loads((folder / "tinker_state.json").read_text())["sampler_path"] == state["sampler_path"]
    assert standin.count("POST /api/v1/save_weights_for_sampler") == 1
    uninterrupted = first.train_step(datums, "cross_entropy")
    probe = first.forward(datums).outputs

    resumed = make_service(config, total_steps=4)
    assert resumed.load_state(str(folder)) == {"note": [1, 2]}
    assert resumed.optimizer_steps == 2 and resumed.training_client.model_id != first.training_client.model_id
    continued = resumed.train_step(datums, "cross_entropy")
    assert continued.metrics["loss_sum"] == uninterrupted.metrics["loss_sum"]
    assert continued.metrics["lr"] == uninterrupted.metrics["lr"]  # the schedule resumes at step 3
    for a, b in zip(resumed.forward(datums).outputs, probe):
        np.testing.assert_array_equal(a["logprobs"], b["logprobs"])

    with pytest.raises(ConfigError, match="trained from 'tiny'"):
        make_service(_config(standin, base_model="other")).load_state(str(folder))
    with pytest.raises(ConfigError, match="lora_rank: 8, but the checkpoint .* was trained with rank 4"):
        make_service(_config(standin, lora_rank=8)).load_state(str(folder))
    with pytest.raises(DataError, match="no tinker_state.json"):
        resumed.load_state(str(tmp_path))


def test_repeatable_calls_are_retried_and_training_calls_are_reported(make_standin, make_service, tokenizer):
    standin = make_standin(faults=[Fault("save_weights_for_sampler", 1, "request_failed")])
    service = make_service(_config(standin, max_retries=2, retry_backoff=0.01))
    assert _greedy(service.sampling_client(), tokenizer("hello").input_ids)  # failed once, sent again
    assert standin.count("POST /api/v1/save_weights_for_sampler") == 2

    standin.faults.append(Fault("forward_backward", 1, "request_failed"))
    with pytest.raises(TinkerRequestError) as info:
        service.train_step(_datums(tokenizer), "cross_entropy")
    message = str(info.value)
    assert "forward_backward (2 datums, " in message and "loss cross_entropy" in message
    assert service.training_client.model_id in message and "injected request failure" in message
    assert "resume from the last checkpoint" in message
    assert standin.count("POST /api/v1/forward_backward") == 1  # never sent twice


@pytest.mark.parametrize("fault, request_name", [(Fault("retrieve_future", 1, 429, count=10**9), "forward_backward"),
                                                 (Fault("optim_step", 1, "hang"), "optim_step 1")])
def test_a_call_without_an_answer_is_reported_at_the_deadline(make_standin, make_service, tokenizer, fault,
                                                              request_name):
    standin = make_standin()
    service = make_service(_config(standin, request_timeout=1.5))
    service.connect()
    standin.faults.append(fault)
    started = time.monotonic()
    with pytest.raises(TinkerRequestError, match="no result within request_timeout=1.5s") as info:
        service.train_step(_datums(tokenizer), "cross_entropy")
    assert time.monotonic() - started < 10
    assert info.value.request.startswith(request_name) and standin.url in str(info.value)
    assert fault.hits >= 1


def test_an_unreachable_service_fails_at_connect(make_standin, make_service):
    standin = make_standin(faults=[Fault("create_session", 1, 503, count=10**9)])
    service = make_service(_config(standin, request_timeout=1.0))
    with pytest.raises(TinkerRequestError, match=r"create_lora_training_client \(base model tiny, rank 4\)"):
        service.connect()
    # The SDK keeps retrying in the background; a stopped server closes its connections and answers no more.
    standin.stop()
    answered = standin.count("POST /api/v1/create_session")
    time.sleep(1.5)
    assert standin.count("POST /api/v1/create_session") == answered


def _no_credentials(monkeypatch, tmp_path):
    for name in ("TINKER_API_KEY", "TINKER_CREDENTIAL_CMD"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no key stored by `tinker auth login`


def test_a_missing_api_key_is_a_config_error(monkeypatch, tmp_path, tiny_folder):
    from nexrl_tinker.inference import TinkerInferenceClient

    _no_credentials(monkeypatch, tmp_path)
    with pytest.raises(ConfigError, match=r"service.train_service.api_key: no Tinker API key: set "
                                          r"service.train_service.api_key .* or the TINKER_API_KEY"):
        TinkerTrainService({"base_model": MODEL})
    with pytest.raises(ConfigError, match="service.inference_service.api_key: no Tinker API key"):
        TinkerInferenceClient({"backend": "tinker", "base_model": MODEL, "tokenizer_path": tiny_folder})
    # What `nexrl validate` can ask without building anything:
    assert TinkerTrainService.check_config({"base_model": MODEL}) == [
        "service.train_service.api_key: no Tinker API key: set service.train_service.api_key (e.g. "
        "${oc.env:TINKER_API_KEY}) or the TINKER_API_KEY environment variable"]
    problems = TinkerInferenceClient.check_config({"backend": "tinker"})
    assert [p.split(":")[0] for p in problems] == ["service.inference_service.api_key",
                                                   "service.inference_service.tokenizer_path"]
    assert TinkerTrainService.check_config({"base_model": MODEL, "api_key": API_KEY}) == []
    assert TinkerInferenceClient.check_config({"api_key": API_KEY, "tokenizer_path": tiny_folder}) == []
    monkeypatch.setenv("TINKER_API_KEY", "sk-not-a-tinker-key-42")
    with pytest.raises(ConfigError, match="TINKER_API_KEY: not a Tinker API key") as info:
        TinkerTrainService({"base_model": MODEL})
    assert "sk-not-a-tinker-key-42" not in str(info.value)
    monkeypatch.setenv("TINKER_API_KEY", API_KEY)
    assert TinkerTrainService({"base_model": MODEL}).connection.api_key == API_KEY
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9/")
    assert resolve_connection({}, "s").base_url == "http://127.0.0.1:9"
    assert resolve_connection({"base_url": "http://x:1"}, "s").base_url == "http://x:1"


def test_the_api_key_never_reaches_logs_checkpoints_or_errors(make_standin, monkeypatch, tmp_path, tokenizer,
                                                              tiny_folder):
    from nexrl_core import SamplingParams
    from nexrl_tinker.inference import TinkerInferenceClient

    canary = "tml-CANARY-7f3a9c2e51"
    standin = make_standin(api_key=canary)
    monkeypatch.setenv("TINKER_API_KEY", canary)
    out = tmp_path / "run"
    out.mkdir()
    sink = logger.add(str(out / "run.log"), level="DEBUG")
    handler = logging.FileHandler(out / "sdk.log")
    loggers = [logging.getLogger(name) for name in ("", "tinker", "httpx", "httpcore", "nexrl_tinker")]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.DEBUG)
    logging.getLogger().addHandler(handler)
    errors = []
    try:
        config = {"base_model": MODEL, "lora_rank": 2, "base_url": standin.url, "max_retries": 1,
                  "retry_backoff": 0.01}
        service = TinkerTrainService(config, seed=0)
        datums = _datums(tokenizer)
        service.train_step(datums, "cross_entropy")
        (out / "global_step_1").mkdir()
        service.save_state(str(out / "global_step_1"))
        resumed = TinkerTrainService(config)
        resumed.load_state(str(out / "global_step_1"))
        resumed.close()
        client = TinkerInferenceClient({"backend": "tinker", "tokenizer_path": tiny_folder, "base_url": standin.url})
        client.set_sampling_client(service.sampling_client(), 1)
        result = client.complete([{"role": "user", "content": "hello"}], SamplingParams(max_tokens=4))
        (out / "completion.json").write_text(json.dumps(result.__dict__))
        standin.faults.extend([Fault("forward_backward", 1, "request_failed"), Fault("asample", 1, 401, count=9)])
        for call in (lambda: service.train_step(datums, "cross_entropy"),
                     lambda: client.complete("hi", SamplingParams(max_tokens=2)),
                     lambda: TinkerTrainService({**config, "api_key": "tml-CANARY-wrong"}).connect()):
            try:
                call()
            except Exception as exc:
                errors.append(f"{exc!r} {exc}")
        errors += [repr(service.connection), repr(client.connection)]
        client.close()
        service.close()
    finally:
        logger.remove(sink)
        logging.getLogger().removeHandler(handler)
        handler.close()
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)
    assert len(errors) == 5 and "401" in errors[1] and "401" in errors[2]
    assert all("CANARY" not in text for text in errors), errors
    files = [p for p in out.rglob("*") if p.is_file()]
    assert {"run.log", "sdk.log", "tinker_state.json", "completion.json"} <= {p.name for p in files}
    assert (out / "sdk.log").stat().st_size > 0
    for path in files:
        assert b"CANARY" not in path.read_bytes(), path
