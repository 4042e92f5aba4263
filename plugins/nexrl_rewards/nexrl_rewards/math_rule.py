"""``math_rule``: reward 1 when the reply's final answer is mathematically equal to the data item's.

The answer is extracted here (see extract.py); equality is math-verify's (fractions, LaTeX,
percentages, intervals, sets, symbolic equality), run in a worker process with a timeout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from nexrl_core import (
    ANSWER_FIELDS,
    BaseEvaluationTarget,
    ConfigError,
    EvaluationRunResult,
    Evaluator,
    required_row_field,
)

from .extract import EXTRACTORS, as_math, extract_answer
from .options import KEY, number, whole
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
                 wrong_answer_reward: float = 0.0,
                 after_thinking: bool = False,
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
        :param wrong_answer_reward: the reward of a reply whose answer was found but is not equal (NexRL's math
            scoring gave 0.1)
        :param after_thinking: score only the text after the reply's first `</think>`; a reply that opens
            `<think>` and never closes it has no answer (NexRL's math scoring)
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
        self.wrong_answer_reward = number(wrong_answer_reward, "wrong_answer_reward")
        if not isinstance(after_thinking, bool):
            raise ConfigError(f"{KEY}.after_thinking: expected true or false, got {after_thinking!r}")
        self.after_thinking = after_thinking
        self.timeout_s = number(timeout_s, "timeout_s", positive=True)
        self.verify_workers = whole(verify_workers, "verify_workers", low=1)
        self.verify_memory_mb = whole(verify_memory_mb, "verify_memory_mb", low=256)

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        truth = str(required_row_field(data, self.answer_key, f"{KEY}.answer_key", ANSWER_FIELDS))
        reply = evaluation_target.final_answer
        unclosed = False
        if self.after_thinking and "</think>" in reply:
            reply = reply.split("</think>", 2)[1]
        elif self.after_thinking and "<think>" in reply:
            reply, unclosed = "", True  # still thinking when it stopped
        format_ok = self._format.search(reply) is not None
        extracted, extracted_by = extract_answer(reply, self.extract_order)
        info: dict[str, Any] = {"reason": None, "extracted": extracted, "extracted_by": extracted_by,
                                "parsed_answer": [], "parsed_ground_truth": [], "detail": ""}
        correct = False
        if extracted is None:
            info["reason"] = NO_ANSWER
            info["detail"] = "the reply's <think> is never closed" if unclosed else \
                f"no answer found by {', '.join(self.extract_order)}"
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
        base = 1.0 if correct else self.wrong_answer_reward if extracted is not None else 0.0
        reward = base + (self.format_reward if format_ok else 0.0)
        return EvaluationRunResult(
            reward=reward, ground_truth=truth,
            metrics={"accuracy": float(correct), "answer_found": float(extracted is not None),
                     "format_ok": float(format_ok)},
            extra_info=info)
