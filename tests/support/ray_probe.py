"""Test components that tell which process they run in (for the Ray launch-mode tests).

- trainer ``pid_mock``: the mock trainer whose exported "weights" name its process and are kept
  in a per-process registry, so the receiver can tell whether it got the very object (an
  in-process hand-over) or a copy from another process;
- inference backend ``pid_mock``: the mock engine that records every weight load;
- weight-sync backend ``deferred_probe``: hands the trainer's export to the engine as a deferred
  argument (what the ``in_process`` backend of nexrl-grpo does);
- evaluator ``pid_probe``: reward 1, and ``pid`` (its process) among the trajectory's extra info.
"""

from __future__ import annotations

import os
from typing import Any

from nexrl_core import EvaluationRunResult, Evaluator, Option, WeightSyncBackend, deferred, execute, hookimpl
from nexrl_core.builtins.mock import MockInferenceClient, MockTrainer

# pid -> the last export of the trainer in that process
_EXPORTS: dict[int, dict[str, Any]] = {}


class PidTrainer(MockTrainer):
    def export_weights(self) -> dict[str, Any]:
        payload = {"pid": os.getpid(), "step": self.global_step}
        _EXPORTS[os.getpid()] = payload
        return payload


class PidEngine(MockInferenceClient):
    def __init__(self, config: Any):
        super().__init__(config)
        self.loads: list[dict[str, Any]] = []

    def load_weights(self, state_dict: dict[str, Any], version: int) -> None:
        same_object = state_dict is _EXPORTS.get(os.getpid())
        self.loads.append({"from_pid": state_dict["pid"], "pid": os.getpid(), "same_object": same_object,
                           "step": state_dict["step"], "version": version})
        self.set_model_version(version)

    def weight_loads(self) -> list[dict[str, Any]]:
        return self.loads

    def pid(self) -> int:
        return os.getpid()


class DeferredProbeSync(WeightSyncBackend):
    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        execute(inference_client.load_weights, deferred(trainer.export_weights), version)


class PidProbe(Evaluator):
    def evaluate(self, data: dict, evaluation_target: Any) -> EvaluationRunResult:
        return EvaluationRunResult(reward=1.0, metrics={}, extra_info={"pid": os.getpid()})


class ProbePlugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"pid_mock": PidTrainer}

    @hookimpl
    def nexrl_inference_backends(self):
        return {"pid_mock": PidEngine}

    @hookimpl
    def nexrl_weight_sync_backends(self):
        return {"deferred_probe": DeferredProbeSync}

    @hookimpl
    def nexrl_evaluators(self):
        return {"pid_probe": PidProbe}


class FailingTrainer(MockTrainer):
    """Raises in its training thread at step ``fail_at``."""

    OPTIONS = {"fail_at": Option(2, int, "the step whose training raises", ge=1)}

    def train(self, trajectories: list) -> dict[str, float]:
        if self.global_step + 1 == int(self._config.get("fail_at", 2)):
            raise RuntimeError(f"injected failure in process {os.getpid()}")
        return super().train(trajectories)


class FailingPlugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"failing_mock": FailingTrainer}
