"""Built-in evaluators for verifiable answers."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from ..config.settings import Settings, setting
from ..evaluation import ANSWER_FIELDS, BaseEvaluationTarget, EvaluationRunResult, Evaluator, required_row_field
from ..markers import hookimpl
from .python_reward import KEY, PythonFunctionEvaluator, RewardFunctionsEvaluator

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def _pattern_problem(value: str | None) -> str | None:
    if value is None:
        return None
    try:
        re.compile(value, re.DOTALL)
    except re.error as exc:
        return f"{value!r} is not a regular expression ({exc})"
    return None


@dataclass(frozen=True, kw_only=True)
class ExactMatchSettings(Settings):
    """The ``exact_match`` evaluator's keys."""

    answer_key: str = setting("answer", "row field that holds the expected answer; a dotted path reads a nested "
                                        "field (reward_model.ground_truth: verl's and NexRL's math rows)")
    case_sensitive: bool = setting(True, "whether 'Paris' and 'paris' differ")
    extract_pattern: str | None = setting(
        None, "regular expression (. spans lines) whose first match in the reply is the answer: its first group, "
              "else the whole match; a reply without one answers '' (null: the whole reply). NexRL's simple "
              "worker: `<answer>(.*?)</answer>`", check=_pattern_problem)


class ExactMatchEvaluator(Evaluator):
    """Reward 1 when the stripped answer equals the row's ``answer_key`` (a key, or a dotted path
    such as verl's ``reward_model.ground_truth``); a row without it fails the sample. With
    ``extract_pattern`` the answer is what the pattern finds in the reply (NexRL's ``simple``
    worker scored the ``<answer>...</answer>`` tag so)."""

    SETTINGS: ClassVar[type[Settings]] = ExactMatchSettings

    # sample data for the conformance check (nexrl plugins check) and the docs
    EXAMPLES = [
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": " Paris\n", "reward": 1.0},
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": "paris", "reward": 0.0},
        {"data": {"prompt": "Capital of France? One word.", "answer": "Paris"}, "response": "paris", "reward": 1.0,
         "options": {"case_sensitive": False}},
        {"data": {"prompt": "Capital of France?", "reward_model": {"ground_truth": "Paris"}},
         "response": "It is <answer> Paris </answer>.", "reward": 1.0,
         "options": {"answer_key": "reward_model.ground_truth", "extract_pattern": "<answer>(.*?)</answer>"}},
    ]

    def __init__(self, **options: object):
        """Built with the keys of its recipe mapping (:class:`ExactMatchSettings`) as keywords."""
        self.settings = ExactMatchSettings.of(options, KEY)
        pattern = self.settings.extract_pattern
        self._pattern = re.compile(pattern, re.DOTALL) if pattern is not None else None

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        settings = self.settings
        truth = str(required_row_field(data, settings.answer_key, f"{KEY}.answer_key", ANSWER_FIELDS))
        answer = evaluation_target.final_answer
        if self._pattern is not None:
            found = self._pattern.search(answer)
            answer = "" if found is None else (found.group(1) if self._pattern.groups else found.group(0)) or ""
        answer = answer.strip()
        same = answer == truth.strip() if settings.case_sensitive else answer.lower() == truth.strip().lower()
        return EvaluationRunResult(reward=float(same), ground_truth=truth, metrics={"accuracy": float(same)},
                                   extra_info={"extracted": answer} if self._pattern is not None else {})


@dataclass(frozen=True, kw_only=True)
class NumericAnswerSettings(Settings):
    """The ``numeric_answer`` evaluator's keys."""

    answer_key: str = setting("answer", "row field that holds the expected number; a dotted path reads a nested "
                                        "field (reward_model.ground_truth: verl's and NexRL's math rows)")
    extract: Literal["first", "last"] = setting("last", "which number of the reply is the answer")
    format_reward: float = setting(0.0, "added when the reply is a bare number")
    tolerance: float = setting(1e-6, "largest difference counted as equal", ge=0)


class NumericAnswerEvaluator(Evaluator):
    """Reward 1 when the answer's number equals the row's ``answer_key`` (a key or a dotted path);
    a row without it fails the sample.

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
        truth = required_row_field(data, settings.answer_key, f"{KEY}.answer_key", ANSWER_FIELDS)
        answer = evaluation_target.final_answer.strip()
        numbers = _NUMBER.findall(answer)
        picked = (numbers[0] if settings.extract == "first" else numbers[-1]) if numbers else None
        correct = picked is not None and abs(float(picked) - float(truth)) <= settings.tolerance
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
