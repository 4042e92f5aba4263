"""``math_rule``: reward 1 when the reply's final answer is mathematically equal to the data item's.

The answer is extracted here (see extract.py); equality is math-verify's (fractions, LaTeX,
percentages, intervals, sets, symbolic equality), run in a worker process with a timeout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nexrl_core import BaseEvaluationTarget, ConfigError, EvaluationRunResult, Evaluator

from .extract import EXTRACTORS, as_math, extract_answer
from .options import KEY, number, whole
from .rows import field_at, missing_field
from .verify_pool import shared_pool

# Why a reply scored 0 (extra_info["reason"]); None when it is correct.
NO_ANSWER = "no_answer"
PARSE_FAILURE = "parse_failure"
NOT_EQUIVALENT = "not_equivalent"
TIMEOUT = "timeout"


class MathRuleEvaluator(Evaluator):
    """Rule-based math reward through math-verify.

    reward = 1 (answer equals the row's ``answer_key``: a key, or a dotted path such as verl's
    ``reward_model.ground_truth``) + ``format_reward`` when the reply matches
    ``format_pattern``. Metrics (every sample reports all of them): ``accuracy``,
    ``answer_found``, ``format_ok``. ``extra_info``: ``reason`` (None, ``no_answer``,
    ``parse_failure``, ``not_equivalent`` or ``timeout``), ``extracted``, ``extracted_by``,
    ``parsed_answer``, ``parsed_ground_truth`` and ``detail``.
    """

    # sample data for the conformance check (nexrl plugins check) and the docs
    EXAMPLES = [
        {"data": {"prompt": "Simplify 2/4.", "answer": "\\frac{1}{2}"}, "response": "It is \\boxed{0.5}.",
         "reward": 1.0},
        {"data": {"prompt": "Simplify 2/4.", "answer": "\\frac{1}{2}"}, "response": "The answer is 1/3",
         "reward": 0.0},
        {"data": {"prompt": "What is 6 * 7?", "answer": "42"}, "response": "6 * 7 = 42", "reward": 1.0},
    ]

    def __init__(self,
                 answer_key: str = "answer",
                 extract_order: Sequence[str] = ("boxed", "final_answer", "last_number"),
                 format_reward: float = 0.0,
                 format_pattern: str = r"\\boxed\{",
                 timeout_s: float = 5.0,
                 verify_workers: int = 2,
                 verify_memory_mb: int = 2048):
        """How the answer is found and compared (see docs/rewards.md).

        :param answer_key: data field that holds the ground truth; a dotted path reads a nested field
            (reward_model.ground_truth: verl's and NexRL's math rows)
        :param extract_order: extractors tried in order, the first that finds an answer wins: boxed, final_answer,
            last_number
        :param format_reward: added to the reward when the reply matches format_pattern
        :param format_pattern: regular expression searched in the reply
        :param timeout_s: seconds math-verify may spend on one sample
        :param verify_workers: math-verify worker processes (shared by the evaluators of the process)
        :param verify_memory_mb: address-space limit of each math-verify worker, in MB
        """
        order = [extract_order] if isinstance(extract_order, str) else list(extract_order)
        unknown = [name for name in order if name not in EXTRACTORS]
        if unknown or not order:
            raise ConfigError(f"{KEY}.extract_order: {unknown or 'empty'} — choose from {', '.join(EXTRACTORS)}")
        try:
            self._format = re.compile(format_pattern)
        except (re.error, TypeError) as exc:
            raise ConfigError(f"{KEY}.format_pattern: {format_pattern!r} is not a regular expression ({exc})") from None
        self.answer_key = answer_key
        self.extract_order = order
        self.format_reward = number(format_reward, "format_reward")
        self.timeout_s = number(timeout_s, "timeout_s", positive=True)
        self.verify_workers = whole(verify_workers, "verify_workers", low=1)
        self.verify_memory_mb = whole(verify_memory_mb, "verify_memory_mb", low=256)

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        truth_value = field_at(data, self.answer_key)
        if truth_value in (None, ""):
            # A data problem, not the model's: the sample fails instead of scoring a silent 0.
            raise missing_field(data, self.answer_key, f"{KEY}.answer_key")
        truth = str(truth_value)
        reply = evaluation_target.final_answer
        format_ok = self._format.search(reply) is not None
        extracted, extracted_by = extract_answer(reply, self.extract_order)
        info: dict[str, Any] = {"reason": None, "extracted": extracted, "extracted_by": extracted_by,
                                "parsed_answer": [], "parsed_ground_truth": [], "detail": ""}
        correct = False
        if extracted is None:
            info["reason"] = NO_ANSWER
            info["detail"] = f"no answer found by {', '.join(self.extract_order)}"
        else:
            verdict = shared_pool(self.verify_workers, self.verify_memory_mb).check(
                as_math(truth), as_math(extracted), self.timeout_s)
            info["parsed_answer"], info["parsed_ground_truth"] = verdict["pred"], verdict["gold"]
            if verdict["status"] == "ok" and not verdict["gold_is_math"]:
                raise ValueError(f"math-verify cannot parse the ground truth {truth!r} of data item "
                                 f"{data.get('uid')!r} ('{self.answer_key}')")
            if verdict["status"] == "timeout":
                info["reason"] = TIMEOUT
                info["detail"] = f"verification took longer than timeout_s={self.timeout_s:g}"
            elif verdict["status"] == "ok" and verdict["equal"]:
                correct = True
            elif verdict["status"] != "ok" or not verdict["pred_is_math"]:
                info["reason"] = PARSE_FAILURE
                info["detail"] = verdict["error"] or f"math-verify cannot read {extracted!r} as math"
            else:
                info["reason"] = NOT_EQUIVALENT
                info["detail"] = f"{verdict['pred'][0]} != {verdict['gold'][0]}"
        reward = float(correct) + (self.format_reward if format_ok else 0.0)
        return EvaluationRunResult(
            reward=reward, ground_truth=truth,
            metrics={"accuracy": float(correct), "answer_found": float(extracted is not None),
                     "format_ok": float(format_ok)},
            extra_info=info)
