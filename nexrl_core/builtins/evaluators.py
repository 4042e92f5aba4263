"""Built-in evaluators for verifiable answers."""

from __future__ import annotations

import re
from typing import Any, Literal

from ..config.options import Option
from ..evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from ..markers import hookimpl
from .python_reward import PythonFunctionEvaluator, RewardFunctionsEvaluator

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


class NumericAnswerEvaluator(Evaluator):
    """Reward 1 when the answer's number equals ``data[answer_key]``.

    ``extract`` picks which number of the reply is the answer: ``last`` (default:
    "2 + 3 = 5" answers 5) or ``first``. ``format_reward`` (default 0) is added
    when the reply is a bare number, which nudges a model towards terse answers.
    """

    OPTIONS = {
        "answer_key": Option("answer", str, "row field that holds the expected number"),
        "extract": Option("last", Literal["first", "last"], "which number of the reply is the answer"),
        "format_reward": Option(0.0, float, "added when the reply is a bare number"),
        "tolerance": Option(1e-6, float, "largest difference counted as equal", ge=0),
    }

    EXAMPLES = [
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "2 + 3 = 5", "reward": 1.0},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "5.", "reward": 1.5,
         "options": {"format_reward": 0.5}},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "5, or maybe 6", "reward": 0.0},
        {"data": {"prompt": "What is 0.1 + 0.2?", "answer": "0.3"}, "response": "0.3", "reward": 1.0},
    ]

    def __init__(self, answer_key: str = "answer", extract: str = "last", format_reward: float = 0.0,
                 tolerance: float = 1e-6):
        if extract not in ("first", "last"):
            raise ValueError(f"rollout_worker.evaluator.extract: '{extract}' is not one of first, last")
        self.answer_key = answer_key
        self.extract = extract
        self.format_reward = format_reward
        self.tolerance = tolerance

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        truth = data.get(self.answer_key)
        answer = evaluation_target.final_answer.strip()
        numbers = _NUMBER.findall(answer)
        picked = (numbers[0] if self.extract == "first" else numbers[-1]) if numbers else None
        correct = picked is not None and truth is not None and abs(float(picked) - float(truth)) <= self.tolerance
        bare = _NUMBER.fullmatch(answer.rstrip(".")) is not None
        reward = float(correct) + (self.format_reward if bare else 0.0)
        return EvaluationRunResult(reward=reward, ground_truth=str(truth),
                                   metrics={"accuracy": float(correct), "bare_number": float(bare),
                                            "response_chars": float(len(answer))},
                                   extra_info={"parsed": picked})


@hookimpl
def nexrl_evaluators():
    return {"exact_match": ExactMatchEvaluator, "numeric_answer": NumericAnswerEvaluator,
            "python": PythonFunctionEvaluator, "reward_funcs": RewardFunctionsEvaluator}
