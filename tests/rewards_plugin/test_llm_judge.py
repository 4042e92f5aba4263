"""llm_judge: score parsing, retries, and judge failures counted as failed samples (never a 0),
against a real OpenAI-compatible server on loopback and other registered backends."""

from __future__ import annotations

import re
import threading

import pytest

from nexrl_core import BaseEvaluationTarget, ConfigError
from nexrl_rewards.llm_judge import DEFAULT_VERDICTS, JudgeError, LLMJudgeEvaluator, parse_score
from tests.support.judge import judge_service as service


def judge(evaluator, reply: str, **data):
    item = {"uid": "0:0", "prompt": "What is 2 + 2?", "answer": "4", **data}
    return evaluator.evaluate(item, BaseEvaluationTarget(final_answer=reply))


# ---------------------------------------------------------------------------------- parsing

@pytest.mark.parametrize("text, scale, expected", [
    ("correct", (0, 1), (1.0, "reply")),
    ("Incorrect.", (0, 1), (0.0, "reply")),
    ("**Yes**", (0, 1), (1.0, "reply")),
    ("not correct", (0, 1), (0.0, "reply")),
    ("0.8", (0, 1), (0.8, "reply")),
    ("7", (0, 10), (0.7, "reply")),
    ("3/4", (0, 1), (0.75, "reply")),
    ("The student is wrong.\nVerdict: incorrect", (0, 1), (0.0, "label")),
    ("Reasoning... the answer matches.\n**Score:** 9", (1, 10), (8 / 9, "label")),
    ("Score: 12\nScore: 4", (0, 5), (0.8, "label")),  # the last label that is a valid score
    ('{"score": 4, "why": "close"}', (0, 5), (0.8, "json")),
    ('Here:\n```json\n{"score": "correct"}\n```', (0, 1), (1.0, "json")),
    ('{"reason": "a } in a string", "score": 1}', (0, 1), (1.0, "json")),
    ('{"score": true}', (0, 1), (1.0, "json")),
    ('{"verdict": 1}\nFinal answer: no', (0, 1), (0.0, "label")),
])
def test_scores_are_parsed_from_numbers_verdicts_and_json(text, scale, expected):
    score, where = parse_score(text, DEFAULT_VERDICTS, "score", scale)
    assert (score, where) == (pytest.approx(expected[0]), expected[1])


@pytest.mark.parametrize("text, scale", [
    ("I think it might be fine, perhaps", (0, 1)),
    ("", (0, 1)),
    ("11", (0, 10)),            # out of range is not a score
    ("-1", (0, 1)),
    ("5/4", (0, 1)),
    ('{"score": "maybe"}', (0, 1)),
    ("The answer is correct but the reasoning is wrong", (0, 1)),  # no single verdict
])
def test_what_is_not_a_score(text, scale):
    assert parse_score(text, DEFAULT_VERDICTS, "score", scale) is None


# ------------------------------------------------------------------- against a loopback server

def test_a_verdict_becomes_the_reward_and_the_prompt_carries_the_item(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server))
    result = judge(evaluator, "It is 4 <<correct>>")
    assert result.reward == 1.0
    assert result.metrics == {"accuracy": 1.0, "judge_score": 1.0, "judge_attempts": 1.0}
    assert result.extra_info["reason"] is None and result.extra_info["judge_reply"] == "correct"
    sent = judge_server.last_request("/v1/chat/completions").body
    text = sent["messages"][-1]["content"]
    assert "What is 2 + 2?" in text and "Reference answer:\n4" in text and "It is 4 <<correct>>" in text
    assert sent["temperature"] == 0.0 and sent["max_tokens"] == 256


def test_numbers_are_scaled_and_json_is_read(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server), score_range=[0, 10], pass_threshold=0.7,
                                  prompt_template="Q: {question}\nA: {response}\nScore 0-10.")
    six = judge(evaluator, "<<Score: 6>>")
    assert six.reward == pytest.approx(0.6) and six.metrics["accuracy"] == 0.0
    assert six.extra_info["reason"] == "judged_incorrect"
    json_reply = judge(evaluator, '<<{"score": 9}>>')
    assert json_reply.reward == pytest.approx(0.9) and json_reply.extra_info["found_in"] == "json"


def test_an_unparseable_reply_is_retried_with_sampling(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server), max_retries=2, retry_temperature=0.9)
    result = judge(evaluator, "<<hmm, hard to say|still thinking|incorrect>>")
    assert result.reward == 0.0 and result.metrics["judge_attempts"] == 3.0
    assert [p.startswith("unparseable reply") for p in result.extra_info["problems"]] == [True, True]
    temperatures = [r.body["temperature"] for r in judge_server.requests if r.method == "POST"]
    assert temperatures == [0.0, 0.9, 0.9]


def test_garbage_after_every_retry_is_a_failure_not_a_zero(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server), max_retries=1)
    with pytest.raises(JudgeError, match="no usable score in 2 attempts: unparseable reply 'lorem ipsum'"):
        judge(evaluator, "<<lorem ipsum>>")
    assert judge_server.request_count == 2


def test_server_errors_are_retried_then_fail(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server), max_retries=2)
    judge_server.fail_next(2, status=500)
    recovered = judge(evaluator, "<<yes>>")
    assert recovered.reward == 1.0 and recovered.metrics["judge_attempts"] == 3.0
    assert all("HTTP 500" in p for p in recovered.extra_info["problems"])
    judge_server.fail_next(3, status=503)
    with pytest.raises(JudgeError, match="3 attempts: InferenceError: .*HTTP 503"):
        judge(evaluator, "<<yes>>")
    judge_server.fail_next(1, status=400)  # a client error is not retried by the backend: still a failure
    with pytest.raises(JudgeError):
        LLMJudgeEvaluator(service=service(judge_server), max_retries=0).evaluate(
            {"prompt": "q", "answer": "a"}, BaseEvaluationTarget("<<yes>>"))


def test_a_judge_that_times_out_is_a_failure(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server, timeout=0.3), max_retries=1)
    judge_server.delay_next(2, seconds=2.0)
    with pytest.raises(JudgeError, match="timeout"):
        judge(evaluator, "<<yes>>")


def test_a_malformed_answer_from_the_server_is_a_failure(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server), max_retries=0)
    judge_server.malform_next(1, kind="json")
    with pytest.raises(JudgeError, match="not JSON|malformed|JSON"):
        judge(evaluator, "<<yes>>")


def test_concurrent_judgements_share_one_client(judge_server):
    evaluators = [LLMJudgeEvaluator(service=service(judge_server)) for _ in range(4)]
    assert len({id(e.client) for e in evaluators}) == 1
    results: dict[int, float] = {}

    def run(i: int) -> None:
        results[i] = judge(evaluators[i % 4], f"<<{i % 3}/2>>").reward if i % 3 < 3 else 0.0

    threads = [threading.Thread(target=run, args=(i,)) for i in range(12)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert results == {i: (i % 3) / 2 for i in range(12)}


def test_a_plain_prompt_and_a_system_prompt(judge_server):
    plain = LLMJudgeEvaluator(service=service(judge_server), use_chat=False, prompt_template="Grade: {response}")
    assert judge(plain, "<<correct>>").reward == 1.0
    assert judge_server.last_request("/v1/completions").body["prompt"] == "Grade: <<correct>>"
    chat = LLMJudgeEvaluator(service=service(judge_server), system_prompt="Be strict.")
    judge(chat, "<<no>>")
    assert judge_server.last_request("/v1/chat/completions").body["messages"][0] == {
        "role": "system", "content": "Be strict."}


def test_literal_braces_in_the_template_are_kept(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server),
                                  prompt_template='Answer {response}. Reply as {"score": <0 or 1>}.')
    judge(evaluator, "<<1>>")
    text = judge_server.last_request("/v1/chat/completions").body["messages"][-1]["content"]
    assert text == 'Answer <<1>>. Reply as {"score": <0 or 1>}.'


def test_a_missing_reference_fails_the_sample(judge_server):
    evaluator = LLMJudgeEvaluator(service=service(judge_server))
    with pytest.raises(ValueError, match=r"^data item '1:2' has no 'answer' \(rollout_worker.evaluator.reference_key\)$"):
        evaluator.evaluate({"uid": "1:2", "prompt": "q"}, BaseEvaluationTarget("x"))
    assert judge_server.request_count == 0


def test_the_api_key_never_shows_in_what_the_evaluator_reports(judge_server):
    key = "sk-nexrl-test-secret-123"
    judge_server.api_key = key
    try:
        evaluator = LLMJudgeEvaluator(service=service(judge_server, api_key=key), max_retries=0)
        result = judge(evaluator, "<<yes>>")
        assert result.reward == 1.0
        judge_server.fail_next(1, status=500)
        with pytest.raises(JudgeError) as failure:
            judge(evaluator, "<<yes>>")
    finally:
        judge_server.api_key = None
    assert key not in repr(result) and key not in str(failure.value) and key not in repr(evaluator.client)


# ------------------------------------------------------------------------- other backends

def test_any_registered_backend_can_judge():
    # The core's `mock` backend in echo mode answers with the user message: the template makes
    # it "judge" with the reply itself, without any server.
    evaluator = LLMJudgeEvaluator(service={"backend": "mock", "mode": "echo"}, prompt_template="{response}",
                                  score_range=[0, 5])
    assert evaluator.evaluate({"uid": "u"}, BaseEvaluationTarget("4")).reward == pytest.approx(0.8)


def test_the_in_process_hf_engine_can_judge(tmp_path):
    pytest.importorskip("nexrl_grpo")
    from tests.support.torch_fixtures import build_model, build_tokenizer

    tokenizer = build_tokenizer()
    build_model(tokenizer).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    svc = {"backend": "hf", "model_path": str(tmp_path), "fast_path": "false"}
    probe = LLMJudgeEvaluator(service=svc, max_tokens=6, max_retries=0, prompt_template="{response}",
                              verdicts={})
    with pytest.raises(JudgeError, match="unparseable reply") as failure:
        probe.evaluate({"uid": "u"}, BaseEvaluationTarget("what is two plus three?"))
    # The tiny model's greedy reply, whatever it is, becomes a verdict worth 0.25.
    said = re.search(r"unparseable reply '(.*)'", str(failure.value), re.DOTALL).group(1)
    graded = LLMJudgeEvaluator(service=svc, max_tokens=6, max_retries=0, prompt_template="{response}",
                               verdicts={said: 0.25})
    assert graded.client is probe.client  # one engine for one service mapping
    assert graded.evaluate({"uid": "u"}, BaseEvaluationTarget("what is two plus three?")).reward == 0.25


@pytest.mark.parametrize("kwargs, key", [
    ({"service": "http://x"}, "service"),
    ({"service": None}, "service"),
    ({"service": {"url": "http://x"}}, "service.backend"),
    ({"service": {"backend": "nope"}}, "service.backend"),
    ({"service": {"backend": "openai"}}, "service"),
    ({"service": {"backend": "openai", "url": "http://127.0.0.1:9", "temprature": 1}}, "service.temprature"),
    ({"prompt_template": "no placeholder"}, "prompt_template"),
    ({"score_range": [5, 1]}, "score_range"),
    ({"score_range": "high"}, "score_range"),
    ({"verdicts": {"good": 2}}, "verdicts"),
    ({"max_retries": -1}, "max_retries"),
    ({"max_tokens": "many"}, "max_tokens"),
    ({"temperature": -0.5}, "temperature"),
])
def test_bad_options_name_the_key(kwargs, key):
    kwargs = {"service": {"backend": "mock"}, **kwargs}
    with pytest.raises(ConfigError, match=re.escape(f"rollout_worker.evaluator.{key}")):
        LLMJudgeEvaluator(**kwargs)
