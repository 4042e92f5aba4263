"""The seed's evaluation types: what an evaluator sees and returns."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any


@dataclass
class BaseEvaluationTarget:
    final_answer: str


@dataclass
class EvaluationRunResult:
    reward: float = 0.0
    ground_truth: str = ""
    metrics: dict[str, float] = field(default_factory=dict)
    extra_info: dict[str, Any] = field(default_factory=dict)


class Evaluator(ABC):
    """Task-specific scoring. Keys of `rollout_worker.evaluator` other than `type`
    reach the constructor as keyword arguments."""

    @abstractmethod
    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        """Score `evaluation_target` against the data item it answered."""

    def evaluate_many(self, items: list[tuple[dict[str, Any], BaseEvaluationTarget]]
                      ) -> list[EvaluationRunResult | Exception]:
        """Score several ``(data, evaluation_target)`` at once: a worker that took several tasks in
        one call (``rollout_worker.tasks_per_call``) asks this once for them. Each item gets its
        result, or the exception scoring it raised. This default scores them one by one; an
        evaluator whose scoring batches (TRL-style reward functions, a judge model) overrides it."""
        out: list[EvaluationRunResult | Exception] = []
        for data, target in items:
            try:
                out.append(self.evaluate(data, target))
            except Exception as exc:
                out.append(exc)
        return out
