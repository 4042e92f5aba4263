"""math_rule: answer extraction, math-verify equivalence, the reasons for a 0, timeouts."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from nexrl_core import BaseEvaluationTarget, ConfigError
from nexrl_rewards.extract import as_math, extract_answer, final_answer_phrase, last_boxed, last_number
from nexrl_rewards.math_rule import MathRuleEvaluator
from nexrl_rewards.verify_pool import VerifierPool


def score(evaluator: MathRuleEvaluator, truth: str, reply: str, **data):
    return evaluator.evaluate({"uid": "0:0", "answer": truth, **data}, BaseEvaluationTarget(final_answer=reply))


@pytest.fixture(scope="module")
def math_rule():
    return MathRuleEvaluator()


EQUIVALENT = [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac12"),
    ("3/4", "\\frac{3}{4}"),
    ("-2.5", "-\\frac{5}{2}"),
    ("0.75", "75\\%"),
    ("75\\%", "\\frac{3}{4}"),
    ("1000", "1,000"),
    ("10", "10.0"),
    ("[1,2)", "[1, 2)"),
    ("(-\\infty, 3]", "(-\\infty,3]"),
    ("\\{1,2\\}", "\\{2, 1\\}"),
    ("(x+1)^2", "x^2+2x+1"),
    ("\\frac{\\sqrt{2}}{2}", "\\frac{1}{\\sqrt{2}}"),
    ("\\frac{\\pi}{2}", "\\pi/2"),
    ("2", "\\frac{4}{2}"),
    ("5", "x = 5"),
    ("\\infty", "\\infty"),
    ("\\text{Evelyn}", "\\text{Evelyn}"),
]

NOT_EQUIVALENT = [
    ("2", "3"),
    ("\\frac{1}{3}", "0.3333"),
    ("\\pi", "3.14"),
    ("[1,2)", "(1,2]"),
    ("\\{1,2\\}", "\\{1,3\\}"),
    ("(x+1)^2", "x^2+1"),
    ("0.75", "75"),
    ("-5", "5"),
]


@pytest.mark.parametrize("truth, answer", EQUIVALENT)
def test_equivalent_answers_score_one(math_rule, truth, answer):
    result = score(math_rule, truth, f"Thus the result is \\boxed{{{answer}}}.")
    assert (result.reward, result.extra_info["reason"]) == (1.0, None), result.extra_info
    assert result.metrics == {"accuracy": 1.0, "answer_found": 1.0, "format_ok": 1.0}
    assert result.ground_truth == truth


@pytest.mark.parametrize("truth, answer", NOT_EQUIVALENT)
def test_different_answers_score_zero_with_parsed_values(math_rule, truth, answer):
    result = score(math_rule, truth, f"\\boxed{{{answer}}}")
    info = result.extra_info
    assert result.reward == 0.0 and result.metrics["accuracy"] == 0.0
    assert info["reason"] == "not_equivalent"
    assert info["extracted"] == answer and info["extracted_by"] == "boxed"
    assert info["parsed_answer"] and info["parsed_ground_truth"]  # both sides as math-verify read them
    assert "!=" in info["detail"]


@pytest.mark.parametrize("truth, reply", [
    ("18", "The answer is $18."),                                # a currency sign, not math
    ("18", "She earns \\$18 a day, so \\boxed{\\$18}"),
    ("18", "The final answer is 18 dollars."),                   # a plain-text unit
    ("18", "\\boxed{18 \\text{ dollars}}"),
    ("18", "The answer is **18**."),                             # markdown emphasis
    ("\\frac{1}{2}", "The answer is: $\\frac{1}{2}$ and that is all"),
    ("1000", "Janet has 1,000 marbles left over in the end"),
])
def test_how_models_write_answers(math_rule, truth, reply):
    result = score(math_rule, truth, reply)
    assert result.reward == 1.0, result.extra_info


@pytest.mark.parametrize("reply, expected", [
    ("so \\boxed{\\frac{1}{2}} done", "\\frac{1}{2}"),
    ("first \\boxed{1} then \\boxed{2}", "2"),
    ("\\boxed{\\{1, \\{2\\}\\}}", "\\{1, \\{2\\}\\}"),
    ("\\boxed{\\frac{a}{b^{2}}}", "\\frac{a}{b^{2}}"),
    ("\\fbox{7}", "7"),
    ("\\boxed {7}", "7"),
    ("\\boxed{unclosed", None),
    ("no box", None),
])
def test_boxed_extraction_handles_nesting(reply, expected):
    assert last_boxed(reply) == expected


@pytest.mark.parametrize("reply, expected", [
    ("Final Answer: The final answer is $\\frac{2}{3}$. I hope it is correct.", "\\frac{2}{3}"),
    ("The final answer is 12.", "12"),
    ("Therefore, the answer is: 3/4\nExtra text", "3/4"),
    ("answer = 42", "42"),
    ("Janet earns 18 dollars.\n#### 18", "18"),
    ("the final answer is \\boxed{5}", "5"),
    ("answer: first; later answer: 9", "9"),
    ("no phrase here 12", None),
])
def test_final_answer_phrase_extraction(reply, expected):
    assert final_answer_phrase(reply) == expected


@pytest.mark.parametrize("reply, expected", [
    ("2 + 3 = 5", "5"),
    ("it costs 1,000 dollars", "1,000"),
    ("-2.5 and then -7", "-7"),
    ("ratio 3/4", "3/4"),
    ("grew by 75%", "75%"),
    ("x2 and v1.2.3", None),
    ("none", None),
])
def test_last_number_extraction(reply, expected):
    assert last_number(reply) == expected


def test_extraction_order_is_configurable():
    reply = "The final answer is 7. Check: \\boxed{8}, and 9 more"
    assert extract_answer(reply, ["boxed", "final_answer", "last_number"]) == ("8", "boxed")
    assert extract_answer(reply, ["final_answer", "boxed"]) == ("7", "final_answer")
    assert extract_answer(reply, ["last_number"]) == ("9", "last_number")
    assert extract_answer("nothing", ["boxed", "final_answer"]) == (None, None)
    evaluator = MathRuleEvaluator(extract_order=["final_answer", "last_number"])
    assert score(evaluator, "7", reply).reward == 1.0
    assert score(evaluator, "8", reply).extra_info["reason"] == "not_equivalent"


@pytest.mark.parametrize("answer, expected", [
    ("75\\%", "$75$%"), ("75 %", "$75$%"), ("$\\frac{1}{2}$", "$\\frac{1}{2}$"), ("\\(3\\).", "$3$"), ("x+1", "$x+1$"),
])
def test_answers_are_wrapped_for_math_verify(answer, expected):
    assert as_math(answer) == expected


def test_no_answer_reason(math_rule):
    result = score(math_rule, "10", "I do not know.")
    assert result.reward == 0.0
    assert result.metrics == {"accuracy": 0.0, "answer_found": 0.0, "format_ok": 0.0}
    assert result.extra_info["reason"] == "no_answer" and result.extra_info["extracted"] is None


def test_parse_failure_reason(math_rule):
    result = score(math_rule, "2", "\\boxed{\\frac{}{}}")
    assert result.reward == 0.0
    assert result.extra_info["reason"] == "parse_failure"
    assert result.extra_info["extracted"] == "\\frac{}{}"
    assert result.extra_info["parsed_ground_truth"][0] == "2"


def test_format_reward_is_added_when_the_pattern_matches():
    evaluator = MathRuleEvaluator(format_reward=0.1)
    assert score(evaluator, "4", "\\boxed{4}").reward == pytest.approx(1.1)
    assert score(evaluator, "4", "\\boxed{5}").reward == pytest.approx(0.1)
    plain = score(evaluator, "4", "the answer is 4")
    assert plain.reward == 1.0 and plain.metrics["format_ok"] == 0.0
    think = MathRuleEvaluator(format_reward=0.5, format_pattern=r"(?s)^<think>.*</think>")
    assert score(think, "4", "<think>2+2</think> 4").reward == 1.5


def test_ground_truth_key_is_configurable():
    evaluator = MathRuleEvaluator(answer_key="solution")
    result = evaluator.evaluate({"uid": "u", "solution": "\\frac{1}{4}"}, BaseEvaluationTarget("\\boxed{0.25}"))
    assert result.reward == 1.0 and result.ground_truth == "\\frac{1}{4}"


def test_missing_or_unparseable_ground_truth_fails_the_sample(math_rule):
    with pytest.raises(ValueError, match="no 'answer'"):
        math_rule.evaluate({"uid": "u"}, BaseEvaluationTarget("\\boxed{1}"))
    with pytest.raises(ValueError, match="cannot parse the ground truth"):
        score(math_rule, "\\frac{", "\\boxed{1}")


def test_a_pathological_expression_times_out_instead_of_hanging():
    evaluator = MathRuleEvaluator(timeout_s=0.5)
    result = score(evaluator, "2", "\\boxed{9^{9^{9^{9}}}}")
    assert result.reward == 0.0 and result.extra_info["reason"] == "timeout"
    assert score(evaluator, "2", "\\boxed{2}").reward == 1.0  # the pool still answers


def test_a_worker_stuck_past_the_grace_period_is_killed_and_replaced():
    pool = VerifierPool(size=1, memory_mb=1024)
    try:
        assert pool.check("$1$", "$1$", 5.0)["equal"] is True
        worker = pool._idle.get_nowait()
        pool._idle.put(worker)
        os.kill(worker.proc.pid, signal.SIGSTOP)  # stuck where no signal handler can run
        answer = pool.check("$1$", "$1$", 0.2)
        assert answer["status"] == "timeout" and pool.replaced == 1
        assert worker.proc.returncode == -signal.SIGKILL
        assert pool.check("$2$", "$\\frac{4}{2}$", 5.0)["equal"] is True
    finally:
        pool.close()


def test_concurrent_evaluations_from_many_threads(math_rule):
    cases = [(str(i), f"\\boxed{{{i if i % 3 else i + 1}}}") for i in range(24)]
    results: dict[int, float] = {}

    def run(i: int) -> None:
        truth, reply = cases[i]
        results[i] = score(math_rule, truth, reply).reward

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(cases))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert results == {i: (0.0 if i % 3 == 0 else 1.0) for i in range(len(cases))}


@pytest.mark.parametrize("kwargs, key", [
    ({"extract_order": ["boxed", "magic"]}, "extract_order"),
    ({"extract_order": []}, "extract_order"),
    ({"timeout_s": 0}, "timeout_s"),
    ({"verify_workers": 0}, "verify_workers"),
    ({"format_pattern": "(unclosed"}, "format_pattern"),
    ({"verify_workers": "two"}, "verify_workers"),
    ({"format_reward": "0.1"}, "format_reward"),
])
def test_bad_options_name_the_key(kwargs, key):
    with pytest.raises(ConfigError, match=f"rollout_worker.evaluator.{key}"):
        MathRuleEvaluator(**kwargs)
