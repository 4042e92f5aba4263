"""The seed's evaluation types: what an evaluator sees and returns; how it reads a data row's fields."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .types import lookup

# Where data rows usually keep the expected answer: verl's and NexRL 1.x's math rows
# ({"reward_model": {"style": "rule", "ground_truth": "72"}, ...}), and most others.
ANSWER_FIELDS = ("reward_model.ground_truth", "answer")


def row_field(row: Mapping[str, Any], key: str) -> Any:
    """``row[key]`` when the row has that key; else the value a dotted ``key`` names, one mapping
    level per part (``reward_model.ground_truth``); None when there is none."""
    return row[key] if key in row else lookup(row, key)


def _absent(value: Any) -> bool:
    return value is None or (isinstance(value, str) and value == "")


def required_row_field(row: Mapping[str, Any], key: str, option: str, usual: Sequence[str] = ()) -> Any:
    """:func:`row_field`, or a ValueError naming the data item, ``key`` and the recipe ``option``
    that set it when the row has nothing there (None or ""): a data problem fails the sample
    instead of scoring a silent 0. The error names the first of ``usual`` (other places such a
    field often is: :data:`ANSWER_FIELDS`) that the row has, and what to set."""
    value = row_field(row, key)
    if not _absent(value):
        return value
    hint = ""
    for other in usual:
        if other != key and not _absent(row_field(row, other)):
            hint = f"; the row has '{other}': set {option}: {other}"
            break
    raise ValueError(f"data item {row.get('uid')!r} has no '{key}' ({option}){hint}")


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
