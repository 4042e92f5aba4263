"""Built-in evaluators for verifiable answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config.settings import Settings, setting
from ..evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from ..markers import hookimpl
from .python_reward import KEY, PythonFunctionEvaluator, RewardFunctionsEvaluator

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


class ExactMatchEvaluator(Evaluator):
    """Reward 1 when the stripped answer equals ``data[answer_key]``."""

    # sample data for the conformance check (nexrl plugins check) and the docs
    EXAMPLES = [
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": " Paris\n", "reward": 1.0},
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": "paris", "reward": 0.0},
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": "paris", "reward": 1.0,
         "options": {"case_sensitive": False}},
    ]

    def __init__(self, answer_key: str = "answer", case_sensitive: bool = True):
        """
        :param answer_key: row field that holds the expected answer
        :param case_sensitive: whether 'Paris' and 'paris' differ
        """
        self.answer_key = answer_key
        self.case_sensitive = case_sensitive

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        truth = str(data.get(self.answer_key, ""))
        answer = evaluation_target.final_answer.strip()
        same = answer == truth.strip() if self.case_sensitive else answer.lower() == truth.strip().lower()
        return EvaluationRunResult(reward=float(same), ground_truth=truth, metrics={"accuracy": float(same)})


@dataclass(frozen=True, kw_only=True)
class NumericAnswerSettings(Settings):
    """The ``numeric_answer`` evaluator's keys."""

    answer_key: str = setting("answer", "row field that holds the expected number")
    extract: Literal["first", "last"] = setting("last", "which number of the reply is the answer")
    format_reward: float = setting(0.0, "added when the reply is a bare number")
    tolerance: float = setting(1e-6, "largest difference counted as equal", ge=0)


class NumericAnswerEvaluator(Evaluator):
    """Reward 1 when the answer's number equals ``data[answer_key]``.

    ``extract`` picks which number of the reply is the answer: ``last`` (default:
    "2 + 3 = 5" answers 5) or ``first``. ``format_reward`` (default 0) is added
    when the reply is a bare number, which nudges a model towards terse answers.
    """

    SETTINGS: ClassVar[type[Settings]] = NumericAnswerSettings

    EXAMPLES = [
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "2 + 3 = 5", "reward": 1.0},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "5.", "reward": 1.5,
         "options": {"format_reward": 0.5}},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "5, or maybe 6", "reward": 0.0},
        {"data": {"prompt": "What is 0.1 + 0.2?", "answer": "0.3"}, "response": "0.3", "reward": 1.0},
    ]

    def __init__(self, **options: object):
        """Built with the keys of its recipe mapping (:class:`NumericAnswerSettings`) as keywords."""
        self.settings = NumericAnswerSettings.of(options, KEY)

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        settings = self.settings
        truth = data.get(settings.answer_key)
        answer = evaluation_target.final_answer.strip()
        numbers = _NUMBER.findall(answer)
        picked = (numbers[0] if settings.extract == "first" else numbers[-1]) if numbers else None
        correct = picked is not None and truth is not None and abs(float(picked) - float(truth)) <= settings.tolerance
        bare = _NUMBER.fullmatch(answer.rstrip(".")) is not None
        reward = float(correct) + (settings.format_reward if bare else 0.0)
        return EvaluationRunResult(reward=reward, ground_truth=str(truth),
                                   metrics={"accuracy": float(correct), "bare_number": float(bare),
                                            "response_chars": float(len(answer))},
                                   extra_info={"parsed": picked})


@hookimpl
def nexrl_evaluators():
    return {"exact_match": ExactMatchEvaluator, "numeric_answer": NumericAnswerEvaluator,
            "python": PythonFunctionEvaluator, "reward_funcs": RewardFunctionsEvaluator}
