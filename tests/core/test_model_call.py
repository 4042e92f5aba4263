"""The rollout worker's public model call, ``BaseRolloutWorker.complete`` (issue #45 item 7): the
worker's sampling with the call's keys over it, one seed per call, answers asked in advance
(``tasks_per_call``) used once and only for the request they were asked for."""

from __future__ import annotations

import threading

import pytest

from nexrl_core import SimpleRolloutWorker, hookimpl
from nexrl_core.builtins.mock import MockInferenceClient, _last_user_text
from nexrl_core.controller import RunFailed


class RecordingClient(MockInferenceClient):
    """The mock model, remembering each request (last user text, seed, max_tokens, temperature)."""

    requests: list[tuple[str, int | None, int, float]] = []
    lock = threading.Lock()

    def complete(self, prompt, params):
        with self.lock:
            type(self).requests.append((_last_user_text(prompt), params.seed, params.max_tokens, params.temperature))
        return super().complete(prompt, params)


class Louder(SimpleRolloutWorker):
    """A first call whose prompt differs from build_prompt's: an answer asked in advance does not fit it."""

    def step(self, task):
        prompt = [{"role": "user", "content": "Loudly: " + task["prompt"]}]
        return self._put_trajectory(self.completion_trajectory(task, prompt, self.complete(prompt)))


class BadKey(SimpleRolloutWorker):
    def step(self, task):
        self.complete(task["prompt"], {"max_token": 5})


def _plugin():
    class Plugin:
        @hookimpl
        def nexrl_rollout_workers(self):
            return {"louder": Louder, "bad_key": BadKey}

        @hookimpl
        def nexrl_inference_backends(self):
            return {"recording": RecordingClient}
    return Plugin()


def _run(nexrl_run, worker, **service):
    RecordingClient.requests = []
    return nexrl_run({"rollout_worker": {"num_workers": 1, **worker},
                      "service": {"inference_service": {"backend": "recording", "mode": "sum", **service}},
                      "trainer": {"total_train_steps": 2}}, _plugin())


def test_answers_asked_in_advance_are_each_used_once(nexrl_run):
    """tasks_per_call: 4 asks the model once per sample (before, as now: no second request)."""
    result = _run(nexrl_run, {"tasks_per_call": 4, "sampling": {"max_tokens": 7, "temperature": 0.5}})
    assert result.errors == [] and len(result.trajectories) == 8
    seeds = [r[1] for r in RecordingClient.requests]
    assert len(seeds) == len(set(seeds)) >= 8  # no request asked twice
    trained = {t["sampling"]["seed"] for t in result.trajectories}
    assert trained <= set(seeds)
    assert {(r[2], r[3]) for r in RecordingClient.requests} == {(7, 0.5)}  # the recipe's sampling


def test_a_first_call_unlike_the_prepared_one_asks_the_model(nexrl_run):
    result = _run(nexrl_run, {"type": "louder", "tasks_per_call": 4})
    assert result.errors == [] and len(result.trajectories) == 8
    for trajectory in result.trajectories:
        assert trajectory["prompt"][0]["content"].startswith("Loudly: ")
        asked = [r for r in RecordingClient.requests if r[1] == trajectory["sampling"]["seed"]]
        # the prepared request (same seed, the plain prompt) and this task's own call
        assert sorted(r[0].startswith("Loudly: ") for r in asked) == [False, True]


def test_an_unknown_sampling_key_fails_the_run_naming_it(nexrl_run):
    with pytest.raises(RunFailed) as failed:  # every sample fails: a plugin bug stops the run
        _run(nexrl_run, {"type": "bad_key"})
    assert "complete(sampling=...): unknown sampling keys ['max_token']" in str(failed.value)
    assert "(tests/core/test_model_call" in str(failed.value)  # where the worker called it (cut to fit)
