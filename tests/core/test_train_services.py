"""Train services through the ``nexrl_train_services`` hook, without torch: a third-party plugin
registers a service and a trainer that drives "any service taking counting batches"; the recipe
picks the service with ``service.train_service.backend``, ``nexrl validate`` checks its keys, and a
run builds it, trains through ``train_step``, checkpoints and resumes through ``save_state`` /
``load_state``."""

from __future__ import annotations

import json
import os
from typing import Any

import pytest

from nexrl_core import REQUIRED, BaseTrainer, Option, StepResult, TrainService, hookimpl
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.runtime.train_service import result_of


class _Done:
    """A finished remote call: what a remote service's forward_backward returns at once."""

    def __init__(self, value: Any):
        self.value = value

    def result(self) -> Any:
        return self.value


class CountingService(TrainService):
    """'Weights' are one number per token id; a step adds lr * (its reward sum) to the counted tokens."""

    OPTIONS = {"lr": Option(REQUIRED, float, "step size", gt=0),
               "start": Option(0.0, float, "initial weight of every token"),
               "note": Option(None, str, "must not say 'bad'")}
    BATCH_FORMAT = "counts"
    built: list[CountingService] = []

    @classmethod
    def from_config(cls, config, *, seed, total_steps, path="service.train_service"):
        service = cls(dict(config), seed=seed, total_steps=total_steps)
        cls.built.append(service)
        return service

    @classmethod
    def check_config(cls, section, path="service.train_service"):
        return [f"{path}.note: says 'bad'"] if section.get("note") == "bad" else []

    def __init__(self, config: dict, seed: int, total_steps: int):
        self.config, self.seed, self.total_steps = config, seed, total_steps
        self.weights: dict[str, float] = {}
        self.pending = 0.0
        self.steps = 0
        self.calls: list[str] = []

    def forward(self, batch):
        return [self.weights.get(str(t), float(self.config.get("start", 0.0))) for t in batch]

    def forward_backward(self, batch, loss):
        self.calls.append("forward_backward")
        self.pending_tokens = list(batch)
        self.pending = float(loss)
        return _Done(StepResult({"loss": -self.pending}, [{"weight": w} for w in self.forward(batch)]))

    def optim_step(self):
        self.calls.append("optim_step")
        for t in self.pending_tokens:
            key = str(t)
            self.weights[key] = self.weights.get(key, float(self.config.get("start", 0.0))) + \
                float(self.config["lr"]) * self.pending
        self.steps += 1
        return _Done({"lr": float(self.config["lr"])})

    def save_state(self, folder, extra_state=None):
        with open(os.path.join(folder, "counting.json"), "w") as f:
            json.dump({"weights": self.weights, "steps": self.steps, "extra": extra_state or {}}, f)

    def load_state(self, folder):
        with open(os.path.join(folder, "counting.json")) as f:
            state = json.load(f)
        self.weights, self.steps = state["weights"], state["steps"]
        return state["extra"]

    def sampling_client(self):
        return dict(self.weights)


class CountingTrainer(BaseTrainer):
    TRAIN_SERVICE_BATCH_FORMAT = "counts"
    TRAIN_SERVICE_DEFAULT = "counting"

    def __init__(self, config, parts=None):
        super().__init__(config, parts)
        self.service: CountingService | None = None
        self.results: list[StepResult] = []

    def initialize_workers(self):
        if self.service is None:
            self.service = self.create_train_service()

    def train(self, trajectories):
        tokens = [t for traj in trajectories for t in traj["response_token_ids"]]
        result = self.service.train_step(tokens, sum(float(t.get("reward", 0.0)) for t in trajectories))
        self.results.append(result)
        return {f"train/{k}": v for k, v in result.metrics.items()}

    def save_model_state(self, folder):
        self.service.save_state(folder, extra_state={"global_step": self.global_step})

    def load_model_state(self, folder):
        self.initialize_workers()
        self.loaded_extra_state = self.service.load_state(folder)


class OtherFormatService(CountingService):
    BATCH_FORMAT = "strings"


class CountingPlugin:
    @hookimpl
    def nexrl_train_services(self):
        return {"counting": CountingService, "strings_only": OtherFormatService}

    @hookimpl
    def nexrl_trainers(self):
        return {"counting": CountingTrainer}


@pytest.fixture
def pm(core_pm):
    core_pm.register(CountingPlugin(), name="counting", distribution="nexrl-counting (in-process)")
    CountingService.built.clear()
    return core_pm


RECIPE = {
    "data": {"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "2 + 2", "answer": "4"}]},
    "rollout_worker": {"num_workers": 2, "evaluator": {"type": "numeric_answer"}},
    "trajectory_pool": {"batch_size": 4, "group_size": 2},
    "trainer": {"type": "counting", "total_train_steps": 3, "save_freq": 1},
    "service": {"train_service": {"lr": 0.5},
                "inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 2}},
}


def _problems(pm, tmp_path, recipe: dict) -> list[str]:
    import yaml

    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"), **recipe}))
    return check_config(load_recipe(str(path)), pm)


def _with_service(**section) -> dict:
    return {**RECIPE, "service": {**RECIPE["service"], "train_service": section}}


def test_the_recipe_selects_a_registered_service_and_its_keys_are_checked(pm, tmp_path):
    assert _problems(pm, tmp_path, RECIPE) == []  # backend: the trainer's default
    assert _problems(pm, tmp_path, _with_service(backend="counting", lr=0.5)) == []
    [unknown] = _problems(pm, tmp_path, _with_service(backend="countng", lr=0.5))  # its keys are not judged
    assert unknown.startswith("service.train_service.backend: unknown train service 'countng'. Did you mean "
                              "'counting'? Available: 'counting' (nexrl-counting (in-process)), 'strings_only'")
    assert _problems(pm, tmp_path, _with_service(backend="strings_only", lr=0.5)) == [
        "service.train_service.backend: 'strings_only' is not one of counting: trainer 'counting' builds counts "
        "batches, and train service 'strings_only' (nexrl-counting (in-process)) takes strings batches"]
    assert _problems(pm, tmp_path, _with_service(lr=0.5, lrr=1)) == [
        "service.train_service.lrr: unknown key; did you mean 'service.train_service.lr'? (train service "
        "'counting' accepts: backend, lr, start, note)"]
    assert _problems(pm, tmp_path, _with_service(start=1.0)) == [
        "service.train_service.lr: required (step size)"]
    assert _problems(pm, tmp_path, _with_service(lr=0.5, note="bad")) == ["service.train_service.note: says 'bad'"]


def test_a_trainer_that_drives_no_service_accepts_no_service_keys(pm, tmp_path):
    recipe = {**_with_service(backend="counting"), "trainer": {"type": "mock"}}
    assert _problems(pm, tmp_path, recipe) == ["service.train_service.backend: unknown key"]


def test_a_run_builds_the_service_trains_through_it_and_resumes_its_state(pm, run_local, tmp_path):
    controller, summary = run_local(RECIPE, pm=pm)
    assert summary.stopped_by == "finished" and summary.global_step == 3
    service = CountingService.built[-1]
    assert service.seed == 42 and service.total_steps == 3 and service.config["lr"] == 0.5
    assert service.calls == ["forward_backward", "optim_step"] * 3
    assert all(isinstance(r, StepResult) and r.metrics["lr"] == 0.5 and "loss" in r.metrics and r.outputs
               for r in controller.trainer.results)
    assert service.weights  # the counted tokens moved
    saved = json.loads((tmp_path / "run" / "checkpoints" / "global_step_2" / "counting.json").read_text())
    assert saved["steps"] == 2 and saved["extra"] == {"global_step": 2}

    recipe = {**RECIPE, "trainer": {**RECIPE["trainer"], "total_train_steps": 4},
              "resume": {"mode": "from_path", "resume_path": str(tmp_path / "run" / "checkpoints" / "global_step_3")}}
    controller, summary = run_local(recipe, pm=pm, name="resume.yaml")
    resumed = CountingService.built[-1]
    assert summary.global_step == 4 and resumed is not service
    assert controller.trainer.loaded_extra_state == {"global_step": 3}
    assert resumed.steps == 4 and resumed.calls == ["forward_backward", "optim_step"]  # step 4 only


def test_result_of_waits_for_a_pending_call_and_passes_a_finished_one():
    assert result_of(_Done(3)) == 3 and result_of({"a": 1}) == {"a": 1}
