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
