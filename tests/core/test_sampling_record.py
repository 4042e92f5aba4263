"""Sampling parameters travel with the data (torch-free): the simple rollout worker sends every
sampling key of the recipe, records the parameters it sent on each trajectory (validation's
temperature included), and a bad or unknown sampling key stops ``nexrl validate`` and
``nexrl run`` alike with one line naming it."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_core import ConfigError
from nexrl_core.builtins.mock import MockInferenceClient
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.runtime.inference import SamplingParams
from nexrl_core.testing import make_recipe, write_recipe

SAMPLING = {"max_tokens": 8, "temperature": 0.5, "top_p": 0.9, "top_k": 3, "stop": ["\n\n"]}


def _recipe(tmp_path: Path, fast_monitor, **worker) -> Path:
    recipe = make_recipe(
        run_dir=str(tmp_path / "run"), runtime_monitor=fast_monitor, logger={"backend": []},
        data={"type": "inline", "rows": [{"prompt": f"{a} + 1", "answer": str(a + 1)} for a in range(4)]},
        validate={"validate_before_train": True, "data": {"type": "inline", "rows": [{"prompt": "9 + 1",
                                                                                        "answer": "10"}]}},
        rollout_worker={"validate_temperature": 0, "sampling": SAMPLING, "evaluator": {"type": "exact_match"},
                        **worker},
        trajectory_pool={"key_list": ["uid"]}, trainer={"total_train_steps": 2},
        service={"inference_service": {"backend": "mock", "mode": "echo"}})
    return Path(write_recipe(recipe, tmp_path / "recipe.yaml"))


def test_trajectories_carry_the_parameters_the_backend_received(tmp_path, fast_monitor, core_pm, reset_loguru):
    controller = NexRLController(load_recipe(str(_recipe(tmp_path, fast_monitor))), plugin_manager=core_pm)
    received: list[SamplingParams] = []
    complete = MockInferenceClient.complete
    client = controller.inference_client
    client.complete = lambda prompt, params: (received.append(params), complete(client, prompt, params))[1]
    validated = []
    put = controller.validator.put_trajectory
    controller.validator.put_trajectory = lambda t: (validated.append(t), put(t))[1]
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == []

    trained = [t for batch in controller.trainer.batches for t in batch]
    assert len(trained) == 8 and len(validated) >= 1
    sent = {p.seed: p.as_record() for p in received}
    for t in trained + validated:
        assert t["sampling"] == sent[t["sampling"]["seed"]]  # exactly what went to the backend
    for t in trained:
        assert {k: t["sampling"][k] for k in SAMPLING} == SAMPLING
        assert t["token_versions"] == [t["model_version"]] * len(t["response_token_ids"])
    for t in validated:
        assert t["sampling"]["temperature"] == 0 and t["sampling"]["top_k"] == 3


@pytest.mark.parametrize("sampling,expected", [
    ({"temprature": 0.7}, "rollout_worker.sampling.temprature: unknown key; did you mean "
                          "'rollout_worker.sampling.temperature'?"),
    ({"max_token": 8}, "did you mean 'rollout_worker.sampling.max_tokens'?"),
    ({"seed": 3}, "the seed is derived per request from rollout_worker.seed"),
    ({"temperature": -0.5}, "rollout_worker.sampling.temperature: expected a non-negative number, got -0.5"),
    ({"top_p": 1.5}, "rollout_worker.sampling.top_p: expected a number > 0 and <= 1, got 1.5"),
    ({"top_k": -4}, "rollout_worker.sampling.top_k: expected an integer >= -1, got -4"),
    ({"max_tokens": 0}, "rollout_worker.sampling.max_tokens: expected a positive integer, got 0"),
])
def test_bad_sampling_keys_are_one_line_in_validate_and_run(tmp_path, fast_monitor, core_pm, sampling, expected):
    path = _recipe(tmp_path, fast_monitor, sampling=sampling)
    cfg = load_recipe(str(path))
    problems = check_config(cfg, core_pm)
    assert len(problems) == 1 and expected in problems[0], problems
    with pytest.raises(ConfigError, match=re.escape(expected)):
        NexRLController(cfg, plugin_manager=core_pm)


def test_bad_validate_temperature_is_named(tmp_path, fast_monitor, core_pm):
    cfg = load_recipe(str(_recipe(tmp_path, fast_monitor, validate_temperature=-1.0)))
    assert check_config(cfg, core_pm) == [
        "rollout_worker.validate_temperature: expected a non-negative number, got -1.0"]


def test_cli_validate_reports_a_sampling_typo(tmp_path, fast_monitor):
    path = _recipe(tmp_path, fast_monitor, sampling={"max_token": 8})
    proc = subprocess.run([sys.executable, "-m", "nexrl_core.cli", "validate", str(path)], capture_output=True,
                          text=True, timeout=60, env={**os.environ, "NEXRL_LOAD_PLUGINS": ""})
    assert proc.returncode == 2 and "rollout_worker.sampling.max_token: unknown key" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_dict_shaped_completion_call_returns_its_sampling_record():
    client = MockInferenceClient({"mode": "echo"})
    out = client.completion("hello", max_tokens=3, temperature=0.2, top_k=5, extra="kept")
    assert out["response"] == "hel" and out["extra"] == "kept"
    assert out["sampling"] == {"max_tokens": 3, "temperature": 0.2, "top_p": 1.0, "top_k": 5, "stop": [], "seed": None}
    with pytest.raises(ValueError, match="top_p"):
        client.completion("hello", top_p=0)
