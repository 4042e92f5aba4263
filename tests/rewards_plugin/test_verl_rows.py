"""The nexrl-rewards evaluators on rows shaped as verl's and NexRL 1.x's public math data (issue
46): the answer at ``reward_model.ground_truth``, the prompt as chat messages, ``data_source``,
``ability`` and ``extra_info`` beside it, read from Parquet and JSONL files as users have them.
Every evaluator's key takes the dotted path (the core's row_field; exact_match and numeric_answer:
tests/core/test_row_fields.py)."""

from __future__ import annotations

import json

import pytest

import nexrl_rewards.plugin as rewards_plugin
from nexrl_core import BaseEvaluationTarget
from nexrl_core.builtins.dataloaders import read_rows
from nexrl_core.testing import make_recipe, plugin_manager
from nexrl_rewards.code_sandbox import CodeSandboxEvaluator
from nexrl_rewards.instruction_following import InstructionFollowingEvaluator
from nexrl_rewards.llm_judge import LLMJudgeEvaluator
from nexrl_rewards.math_rule import MathRuleEvaluator
from tests.rewards_plugin.test_code_sandbox import ADD, SUM_CASES, fenced, runnable_here
from tests.support.judge import judge_service

VERL = "reward_model.ground_truth"


def verl_row(index: int, question: str, answer: str, source: str = "openai/gsm8k") -> dict:
    """One row as verl's examples/data_preprocess scripts (and NexRL's math data) write it."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index, "answer": f"#### {answer}", "question": question}}


def test_the_answer_is_read_at_reward_model_ground_truth():
    evaluator = MathRuleEvaluator(answer_key=VERL)
    row = {"uid": "0:0", **verl_row(0, "Half of 1?", "\\frac{1}{2}")}
    right = evaluator.evaluate(row, BaseEvaluationTarget("So \\boxed{0.5}."))
    assert right.reward == 1.0 and right.ground_truth == "\\frac{1}{2}"
    wrong = evaluator.evaluate(row, BaseEvaluationTarget("So \\boxed{0.25}."))
    assert wrong.reward == 0.0 and wrong.extra_info["reason"] == "not_equivalent"
    # a top-level key of that very name wins over the path (a row flattened by another tool)
    flat = {"uid": "0:1", VERL: "3", **verl_row(1, "1 + 2?", "4")}
    assert evaluator.evaluate(flat, BaseEvaluationTarget("\\boxed{3}")).reward == 1.0
    # a ground truth stored as a number (a Parquet int column) is its text
    number = {"uid": "0:2", **verl_row(2, "6 * 7?", "42")}
    number["reward_model"]["ground_truth"] = 42
    assert evaluator.evaluate(number, BaseEvaluationTarget("6 * 7 = 42")).reward == 1.0


def test_a_row_without_the_answer_fails_with_the_key_and_where_the_answer_is():
    evaluator = MathRuleEvaluator(answer_key=VERL)
    row = {"uid": "3:0", **verl_row(3, "1 + 1?", "2")}
    del row["reward_model"]["ground_truth"]
    with pytest.raises(ValueError, match=r"^data item '3:0' has no 'reward_model.ground_truth' "
                                         r"\(rollout_worker.evaluator.answer_key\)$"):
        evaluator.evaluate(row, BaseEvaluationTarget("\\boxed{2}"))
    row["reward_model"] = "2"  # not a mapping: the path names nothing
    with pytest.raises(ValueError, match="has no 'reward_model.ground_truth'"):
        evaluator.evaluate(row, BaseEvaluationTarget("\\boxed{2}"))
    # the default key on verl rows: the error says where the answer is and what to set
    with pytest.raises(ValueError, match=r"has no 'answer' \(rollout_worker.evaluator.answer_key\); the row has "
                                         r"'reward_model.ground_truth': set rollout_worker.evaluator.answer_key: "
                                         r"reward_model.ground_truth$"):
        MathRuleEvaluator().evaluate({"uid": "4:0", **verl_row(4, "1 + 1?", "2")}, BaseEvaluationTarget("2"))
    # and the other way round: the path on flat rows
    with pytest.raises(ValueError, match=r"the row has 'answer': set rollout_worker.evaluator.answer_key: answer$"):
        evaluator.evaluate({"uid": "5:0", "prompt": "1 + 1?", "answer": "2"}, BaseEvaluationTarget("2"))


# (question the mock model echoes, ground truth, reward): the echo holds a boxed answer
ROWS = [("Add 2 and 3: \\boxed{5}", "5", 1.0),
        ("Add 3 and 4: \\boxed{8}", "7", 0.0),
        ("Half of one: \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("No answer given here", "1", 0.0)]


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_a_run_on_verl_files_scores_each_row_by_its_ground_truth(run_local, tmp_path, fmt):
    rows = [verl_row(i, q, a, source="openai/gsm8k" if i % 2 else "math") for i, (q, a, _) in enumerate(ROWS)]
    path = tmp_path / f"train.{fmt}"
    if fmt == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pq.write_table(pa.Table.from_pylist(rows), path)  # nested struct columns, as verl's parquet files
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {"type": "file", "path": str(path)}
    recipe = make_recipe(
        data={**data, "shuffle": False}, trainer={"total_train_steps": 1},
        trajectory_pool={"batch_size": 2 * len(ROWS), "group_size": 2},
        rollout_worker={"num_workers": 2, "sampling": {"max_tokens": 256},
                        "evaluator": {"type": "math_rule", "answer_key": VERL}},
        validate={"validate_before_train": True, "data": data},
        service={"inference_service": {"backend": "mock", "mode": "echo"}})
    controller, summary = run_local(recipe, pm=plugin_manager(rewards_plugin))
    assert summary.stopped_by == "finished" and summary.global_step == 1
    trained = [t for batch in controller.trainer.batches for t in batch]
    by_truth = {t["ground_truth"]: t["score"]["reward"] for t in trained}
    assert by_truth == {truth: reward for _, truth, reward in ROWS}
    assert len(trained) == 2 * len(ROWS)
    val = summary.validation[0]
    assert val["val/num_samples"] == len(ROWS) and val["val/num_failed"] == 0
    assert val["val/accuracy"] == pytest.approx(sum(r for *_, r in ROWS) / len(ROWS))


def through_file(tmp_path, fmt: str, rows: list[dict]) -> list[dict]:
    """``rows`` written to a Parquet or JSONL file and read back as the file loader reads them."""
    path = tmp_path / f"rows.{fmt}"
    if fmt == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pq.write_table(pa.Table.from_pylist(rows), path)
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return [{"uid": f"{i}:0", **row} for i, row in enumerate(read_rows(str(path)))]


FORMATS = ["parquet", "jsonl"]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_judge_reads_the_reference_and_the_question_at_their_paths(judge_server, tmp_path, fmt):
    row, = through_file(tmp_path, fmt, [verl_row(0, "What is 6 * 7?", "42")])
    evaluator = LLMJudgeEvaluator(service=judge_service(judge_server), reference_key=VERL,
                                  question_key="extra_info.question")
    result = evaluator.evaluate(row, BaseEvaluationTarget("It is 42 <<1>>"))
    assert result.reward == 1.0 and result.ground_truth == "42"
    sent = judge_server.last_request("/v1/chat/completions").body["messages"][-1]["content"]
    assert "Question:\nWhat is 6 * 7?\n" in sent and "Reference answer:\n42\n" in sent
    with pytest.raises(ValueError, match=rf"^data item '0:0' has no 'answer' \(rollout_worker.evaluator."
                                         rf"reference_key\); the row has '{VERL}': set rollout_worker.evaluator."
                                         rf"reference_key: {VERL}$"):
        LLMJudgeEvaluator(service=judge_service(judge_server)).evaluate(row, BaseEvaluationTarget("42 <<1>>"))


@pytest.mark.parametrize("fmt", FORMATS)
def test_code_sandbox_reads_the_test_cases_at_their_path(tmp_path, fmt):
    row = verl_row(0, "Add two numbers read from stdin.", json.dumps(SUM_CASES))  # a JSON column
    row, = through_file(tmp_path, fmt, [row])
    evaluator = CodeSandboxEvaluator(test_cases_key=VERL, timeout_s=3.0, **runnable_here())
    result = evaluator.evaluate(row, BaseEvaluationTarget(fenced(ADD)))
    assert result.reward == 1.0 and result.extra_info["passed"] == len(SUM_CASES)
    wrong = evaluator.evaluate(row, BaseEvaluationTarget(fenced("print(0)\n")))
    assert wrong.reward == 0.0
    with pytest.raises(ValueError, match=r"^data item '0:0' has no 'test_cases' "
                                         r"\(rollout_worker.evaluator.test_cases_key\)$"):
        CodeSandboxEvaluator(timeout_s=3.0, **runnable_here()).evaluate(row, BaseEvaluationTarget(fenced(ADD)))


@pytest.mark.parametrize("fmt", FORMATS)
def test_instruction_following_reads_the_instructions_at_their_path(tmp_path, fmt):
    instructions = [{"type": "number_words", "relation": "less than", "num_words": 10}, {"type": "no_comma"}]
    row, = through_file(tmp_path, fmt, [verl_row(0, "Describe the sea briefly, without commas.",
                                                 json.dumps(instructions))])
    evaluator = InstructionFollowingEvaluator(instructions_key=VERL)
    assert evaluator.evaluate(row, BaseEvaluationTarget("Blue and endless.")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("Blue, endless.")).reward == 0.5
    with pytest.raises(ValueError, match=r"has no 'instructions' \(rollout_worker.evaluator.instructions_key\)"):
        InstructionFollowingEvaluator().evaluate(row, BaseEvaluationTarget("Blue."))
