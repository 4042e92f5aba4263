"""math_rule on rows shaped as verl's and NexRL 1.x's public math data (issue 46): the answer at
``reward_model.ground_truth``, the prompt as chat messages, ``data_source``, ``ability`` and
``extra_info`` beside it, read from Parquet and JSONL files as users have them."""

from __future__ import annotations

import json

import pytest

import nexrl_rewards.plugin as rewards_plugin
from nexrl_core import BaseEvaluationTarget
from nexrl_core.testing import make_recipe, plugin_manager
from nexrl_rewards.math_rule import MathRuleEvaluator

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
