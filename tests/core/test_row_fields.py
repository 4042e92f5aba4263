"""Every evaluator reads its answer the same way: a key, or a dotted path into nested mappings
(verl's and NexRL 1.x's math rows keep it at ``reward_model.ground_truth``); a row without it
fails the sample with the key, the recipe option and where the answer is instead of scoring 0.
Here the core's lookup and its built-in evaluators (exact_match, numeric_answer); the
nexrl-rewards evaluators: tests/rewards_plugin/test_verl_rows.py."""

from __future__ import annotations

import json

import pytest

from nexrl_core import ANSWER_FIELDS, BaseEvaluationTarget, required_row_field, row_field
from nexrl_core.builtins.evaluators import ExactMatchEvaluator, NumericAnswerEvaluator
from nexrl_core.testing import make_recipe

VERL = "reward_model.ground_truth"
OPTION = "rollout_worker.evaluator.answer_key"


def verl_row(index: int, question: str, answer: str, source: str = "openai/gsm8k") -> dict:
    """One row as verl's examples/data_preprocess scripts (and NexRL's math data) write it."""
    return {"data_source": source,
            "prompt": [{"role": "user", "content": question}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": answer},
            "extra_info": {"split": "train", "index": index, "answer": f"#### {answer}", "question": question}}


def test_a_dotted_key_reads_nested_mappings_and_a_flat_key_of_that_name_wins():
    row = verl_row(0, "1 + 1?", "2")
    assert row_field(row, VERL) == "2"
    assert row_field(row, "extra_info.index") == 0
    assert row_field(row, "data_source") == "openai/gsm8k"
    assert row_field({VERL: "flat", **row}, VERL) == "flat"
    assert row_field(row, "reward_model.style.deeper") is None  # "rule" is no mapping
    assert row_field(row, "reward_model.missing") is None and row_field(row, "answer") is None
    assert row_field({"a": {"b": None}}, "a.b") is None


def test_a_missing_field_names_the_item_the_key_the_option_and_where_the_answer_is():
    row = {"uid": "7:1", **verl_row(0, "1 + 1?", "2")}
    assert required_row_field(row, VERL, OPTION, ANSWER_FIELDS) == "2"
    with pytest.raises(ValueError, match=rf"^data item '7:1' has no 'answer' \({OPTION}\); the row has "
                                         rf"'{VERL}': set {OPTION}: {VERL}$"):
        required_row_field(row, "answer", OPTION, ANSWER_FIELDS)
    row["reward_model"]["ground_truth"] = ""  # empty is missing: an answer no reply can match
    with pytest.raises(ValueError, match=rf"^data item '7:1' has no '{VERL}' \({OPTION}\)$"):
        required_row_field(row, VERL, OPTION, ANSWER_FIELDS)
    # without places to suggest (test cases, instructions) the error stops at the option
    with pytest.raises(ValueError, match=r"^data item '7:1' has no 'tests' \(x.test_cases_key\)$"):
        required_row_field({"uid": "7:1", "answer": "2"}, "tests", "x.test_cases_key")


@pytest.mark.parametrize("evaluator", [ExactMatchEvaluator, NumericAnswerEvaluator])
def test_core_evaluators_read_the_path_and_refuse_a_row_without_the_answer(evaluator):
    row = {"uid": "1:0", **verl_row(1, "6 * 7?", "42")}
    right = evaluator(answer_key=VERL).evaluate(row, BaseEvaluationTarget("42"))
    assert right.reward == 1.0 and right.ground_truth == "42"
    assert evaluator(answer_key=VERL).evaluate(row, BaseEvaluationTarget("41")).reward == 0.0
    # the default key on verl rows scored a silent 0 before: now the sample fails and says what to set
    with pytest.raises(ValueError, match=rf"^data item '1:0' has no 'answer' \({OPTION}\); the row has '{VERL}'"):
        evaluator().evaluate(row, BaseEvaluationTarget("42"))
    with pytest.raises(ValueError, match=rf"has no '{VERL}' \({OPTION}\); the row has 'answer': set {OPTION}: "
                                         rf"answer$"):
        evaluator(answer_key=VERL).evaluate({"uid": "2:0", "answer": "42"}, BaseEvaluationTarget("42"))
    # flat rows as before
    assert evaluator().evaluate({"uid": "3:0", "answer": "42"}, BaseEvaluationTarget("42")).reward == 1.0


# (question the mock model echoes, ground truth, numeric_answer's reward, exact_match's reward)
ROWS = [("5", "5", 1.0, 1.0),
        ("Add 3 and 4: 8", "7", 0.0, 0.0),
        ("Half of one: 0.5", "0.5", 1.0, 0.0),
        ("0.25", "0.25", 1.0, 1.0)]


@pytest.mark.parametrize("evaluator, fmt", [("numeric_answer", "parquet"), ("numeric_answer", "jsonl"),
                                            ("exact_match", "parquet")])
def test_a_run_on_verl_files_scores_each_row_by_its_ground_truth(run_local, tmp_path, evaluator, fmt):
    rows = [verl_row(i, q, a) for i, (q, a, *_) in enumerate(ROWS)]
    path = tmp_path / f"train.{fmt}"
    if fmt == "parquet":
        pq = pytest.importorskip("pyarrow.parquet")
        pa = pytest.importorskip("pyarrow")
        pq.write_table(pa.Table.from_pylist(rows), path)  # nested struct columns, as verl's parquet files
    else:
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    data = {"type": "file", "path": str(path), "shuffle": False}
    recipe = make_recipe(
        data=data, trainer={"total_train_steps": 1},
        trajectory_pool={"batch_size": 2 * len(ROWS), "group_size": 2},
        rollout_worker={"num_workers": 2, "sampling": {"max_tokens": 64},
                        "evaluator": {"type": evaluator, "answer_key": VERL}},
        service={"inference_service": {"backend": "mock", "mode": "echo"}})
    controller, summary = run_local(recipe)
    assert summary.stopped_by == "finished" and summary.global_step == 1
    trained = [t for batch in controller.trainer.batches for t in batch]
    assert len(trained) == 2 * len(ROWS) and not any(t.get("failed") for t in trained)
    column = 2 if evaluator == "numeric_answer" else 3
    assert {t["ground_truth"]: t["score"]["reward"] for t in trained} == {r[1]: r[column] for r in ROWS}
