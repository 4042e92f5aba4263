"""``instruction_following`` (nexrl-rewards): IFEval-style verifiable instructions. Each kind on a
reply that follows it and one that breaks it; strict and loose; the three data layouts (nexrl's,
IFEval's rows, ROLL's ground_truth); data problems fail the sample; and a short mock run."""

from __future__ import annotations

import json

import pytest

import nexrl_rewards.plugin as rewards_plugin
from nexrl_core import BaseEvaluationTarget, ConfigError
from nexrl_core.testing import make_recipe, plugin_manager
from nexrl_rewards.instruction_following import KINDS, InstructionFollowingEvaluator, sentences, words


def _score(instructions, reply, **options):
    evaluator = InstructionFollowingEvaluator(**options)
    return evaluator.evaluate({"uid": "0:0", "prompt": "Tell me about the sea.", "instructions": instructions},
                              BaseEvaluationTarget(reply))


def _follows(instruction, reply, **options):
    return _score([instruction], reply, **options).reward == 1.0


# (instruction, a reply that follows it, a reply that breaks it)
CASES = {
    "keywords": ({"type": "keywords", "keywords": ["ocean", "Salt"]},
                 "The OCEAN is full of salt.", "The sea is full of salt."),
    "keyword_frequency": ({"type": "keyword_frequency", "keyword": "wave", "frequency": 3, "relation": "at least"},
                          "Wave after wave after Wave.", "One wave, then another wave."),
    "forbidden_words": ({"type": "forbidden_words", "forbidden_words": ["blue", "deep"]},
                        "The sea is bluish and deeply calm.", "The sea is Blue."),
    "letter_frequency": ({"type": "letter_frequency", "letter": "z", "let_frequency": 2, "let_relation": "less than"},
                         "Zero waves today.", "Zany zebras zoom."),
    "number_sentences": ({"type": "number_sentences", "num_sentences": 2, "relation": "at most"},
                         "Dr. Smith saw the sea. It was calm!", "It was calm. It was wide. It was old."),
    "number_paragraphs": ({"type": "number_paragraphs", "num_paragraphs": 2},
                          "The sea is wide.\n***\nIt is also deep.", "The sea is wide.\n***\n\n***\nIt is deep."),
    "number_words": ({"type": "number_words", "num_words": 5, "relation": "less than"},
                     "Waves don't stop.", "The sea is wide and very deep."),
    "nth_paragraph_first_word": ({"type": "nth_paragraph_first_word", "num_paragraphs": 2, "nth_paragraph": 2,
                                  "first_word": "tides"},
                                 "The sea.\n\n\"Tides, they rise.\"", "The sea.\n\nWaves rise."),
    "number_placeholders": ({"type": "number_placeholders", "num_placeholders": 2},
                            "Meet me at [address] on [date].", "Meet me at [address] on []."),
    "postscript": ({"type": "postscript", "postscript_marker": "P.S."},
                   "The sea is wide.\n\nP.S. bring a towel.", "The sea is wide.\nP.S."),
    "number_bullet_lists": ({"type": "number_bullet_lists", "num_bullets": 2},
                            "Facts:\n* it is wet\n- it is wide\n\n***\n**bold** line",
                            "Facts:\n* it is wet\n* it is wide\n* it is old"),
    "constrained_response": ({"type": "constrained_response"}, "My answer is maybe.", "Perhaps."),
    "number_highlighted_sections": ({"type": "number_highlighted_sections", "num_highlights": 2},
                                    "It is *wide* and **deep**.", "It is *wide* and * deep *."),
    "multiple_sections": ({"type": "multiple_sections", "section_spliter": "SECTION", "num_sections": 2},
                          "SECTION 1\nThe sea.\n## SECTION 2\nThe sky.", "SECTION 1\nThe sea and the sky."),
    "json_format": ({"type": "json_format"}, "```json\n{\"sea\": \"wide\"}\n```", "{\"sea\": wide}"),
    "title": ({"type": "title"}, "<<Ode to the Sea>>\nIt is wide.", "<< >>\nIt is wide."),
    "two_responses": ({"type": "two_responses"}, "The sea is wide.\n******\nThe sea is deep.",
                      "The sea is wide.\n******\nThe sea is wide."),
    "repeat_prompt": ({"type": "repeat_prompt"}, "tell me about the sea. It is wide.", "The sea is wide."),
    "end_checker": ({"type": "end_checker", "end_phrase": "Any other questions?"},
                    "The sea is wide. Any other questions?\n", "Any other questions? The sea is wide."),
    "quotation": ({"type": "quotation"}, "\"The sea is wide.\"", "\"The sea\" is wide."),
    "capital_word_frequency": ({"type": "capital_word_frequency", "capital_frequency": 2,
                                "capital_relation": "at least"},
                               "The SEA is VERY wide.", "The SEA is very wide."),
    "english_capital": ({"type": "english_capital"}, "THE SEA IS WIDE, 100%.", "THE SEA IS Wide."),
    "english_lowercase": ({"type": "english_lowercase"}, "the sea is wide.", "the sea is Wide."),
    "no_comma": ({"type": "no_comma"}, "The sea is wide and deep.", "The sea is wide，and deep."),
}


def test_every_kind_is_tested():
    assert set(CASES) | {"response_language"} == set(KINDS)


@pytest.mark.parametrize("kind", sorted(CASES))
def test_each_kind_on_a_reply_that_follows_it_and_one_that_breaks_it(kind):
    instruction, follows, breaks = CASES[kind]
    good, bad = _score([instruction], follows), _score([instruction], breaks)
    assert good.reward == 1.0 and good.extra_info["reason"] is None, good.extra_info
    assert bad.reward == 0.0 and bad.extra_info["not_followed"] == [kind], bad.extra_info
    assert bad.extra_info["instructions"][0]["detail"]  # says what it found
    assert good.metrics[f"{kind}_total"] == 1.0 and good.metrics[f"{kind}_followed"] == 1.0
    assert bad.metrics[f"{kind}_total"] == 1.0 and bad.metrics[f"{kind}_followed"] == 0.0


@pytest.mark.parametrize("relation, passes", [
    ("less than", [3]), ("at most", [3, 4]), ("exactly", [4]), ("at least", [4, 5]), ("more than", [5]),
    ("around", [3, 4, 5]),
])
def test_relations(relation, passes):
    for n in (3, 4, 5):
        reply = " ".join(["word"] * n)
        assert _follows({"type": "number_words", "num_words": 4, "relation": relation}, reply) == (n in passes)


def test_words_and_sentences_are_counted_as_a_reader_counts_them():
    assert words("Don't stop: well-known, e.g. 3.5 times!") == ["Don't", "stop", "well-known", "e", "g", "3", "5",
                                                              "times"]
    assert sentences("Mr. J. Smith left at 3.30 p.m. today. Did he? Yes!! \"Really.\" Ok") == [
        "Mr. J. Smith left at 3.30 p.m. today.", "Did he?", "Yes!!", "\"Really.\"", "Ok"]
    assert sentences("# A heading\n\nA line without a stop\n\n...") == ["# A heading", "A line without a stop"]


def test_loose_forgives_a_first_line_a_last_line_and_markdown_stars():
    instructions = [{"type": "end_checker", "end_phrase": "Is there anything else?"},
                    {"type": "number_words", "num_words": 6, "relation": "at most"}]
    reply = "Sure! Here is my answer:\nThe sea is wide. Is there anything else?\n(I hope this helps.)"
    strict = _score(instructions, reply)
    loose = _score(instructions, reply, mode="loose")
    assert strict.reward == 0.0 and strict.metrics["strict_accuracy"] == 0.0
    assert loose.reward == 0.5  # the ending is loosely there; the word count is not, even without a line
    assert strict.metrics["loose_accuracy"] == loose.metrics["loose_accuracy"] == 0.0
    assert [(i["strict"], i["loose"]) for i in loose.extra_info["instructions"]] == [(False, True), (False, False)]
    starred = _score([{"type": "end_checker", "end_phrase": "the end"}], "This is **the end**", mode="loose")
    assert starred.reward == 1.0 and starred.metrics["strict_accuracy"] == 0.0


def test_fraction_and_all_or_nothing():
    instructions = ["no_comma", "title", {"type": "number_words", "num_words": 3, "relation": "at least"}]
    reply = "No title here, sorry."
    fraction = _score(instructions, reply)
    assert fraction.reward == pytest.approx(1 / 3) and fraction.metrics["instruction_accuracy"] == pytest.approx(1 / 3)
    assert fraction.metrics["accuracy"] == 0.0 and fraction.metrics["num_instructions"] == 3.0
    assert _score(instructions, reply, reward_mode="all_or_nothing").reward == 0.0
    assert _score(instructions, "<<T>> no commas here", reward_mode="all_or_nothing").reward == 1.0
    assert fraction.extra_info["not_followed"] == ["no_comma", "title"]
    assert fraction.ground_truth == "no_comma; title; number_words(num_words=3, relation='at least')"


def test_every_sample_reports_the_same_metric_names():
    a = _score(["no_comma"], "x").metrics
    b = _score([{"type": "number_words", "num_words": 1}, "title"], "y").metrics
    assert set(a) == set(b) and len(a) == 5 + 2 * len(KINDS)
    assert set(_score(["no_comma"], "x", kind_metrics=False).metrics) == {
        "accuracy", "instruction_accuracy", "strict_accuracy", "loose_accuracy", "num_instructions"}


def test_the_reply_after_the_reasoning_is_checked():
    reply = "<think>Hmm, commas, commas, commas.</think>\nThe sea is wide."
    assert _score(["no_comma"], reply).reward == 1.0
    assert _score(["no_comma"], reply).extra_info["checked"] == "after_thinking"
    assert _score(["no_comma"], reply, after_thinking=False).reward == 0.0


# -- data layouts ----------------------------------------------------------------------------------

def test_ifeval_rows_are_read_as_they_come():
    row = {"uid": "0:0", "prompt": "Write about the sea.",
           "instruction_id_list": ["punctuation:no_comma", "length_constraints:number_words",
                                   "detectable_format:title"],
           # IFEval's kwargs hold every key, None where unused
           "kwargs": [{"num_words": None, "relation": None}, {"num_words": 4, "relation": "less than"}, {}]}
    result = InstructionFollowingEvaluator().evaluate(row, BaseEvaluationTarget("<<Sea>> wide sea"))
    assert result.reward == 1.0 and [i["kind"] for i in result.extra_info["instructions"]] == [
        "no_comma", "number_words", "title"]
    row["kwargs"] = json.dumps(row["kwargs"])  # a JSON string, as some copies store it
    assert InstructionFollowingEvaluator().evaluate(row, BaseEvaluationTarget("<<Sea>>, wide")).reward == \
        pytest.approx(2 / 3)


def test_rolls_ground_truth_is_read_with_its_function_names():
    evaluator = InstructionFollowingEvaluator(instructions_key="ground_truth")
    truth = json.dumps({"func_name": "validate_word_constraint", "N": 3, "quantifier": "at most"})
    row = {"uid": "0:0", "prompt": "p", "tag": "ifeval", "ground_truth": truth}
    assert evaluator.evaluate(row, BaseEvaluationTarget("one two three")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("one two three four")).reward == 0.0
    row["ground_truth"] = {"func_name": "verify_keyword_frequency", "word": "sea", "N": 2}  # exactly N
    assert evaluator.evaluate(row, BaseEvaluationTarget("sea sea")).reward == 1.0
    assert evaluator.evaluate(row, BaseEvaluationTarget("sea sea sea")).reward == 0.0
    row["ground_truth"] = {"func_name": "validate_sections", "N": 2, "section_splitter": "Part"}
    assert evaluator.evaluate(row, BaseEvaluationTarget("Part 1\na\nPart 2\nb")).reward == 1.0


@pytest.mark.parametrize("data, message", [
    ({"prompt": "p"}, "has no 'instructions' (rollout_worker.evaluator.instructions_key) and no IFEval"),
    ({"instructions": []}, "no instruction to check"),
    ({"instructions": [{"type": "number_wordz", "num_words": 3}]}, "unknown instruction kind 'number_wordz'"),
    ({"instructions": [{"type": "number_words"}]}, "number_words needs num_words"),
    ({"instructions": [{"type": "number_words", "num_words": 3, "relation": "roughly"}]},
     "number_words.relation: 'roughly' is not one of less than, at most, exactly, at least, more than, around"),
    ({"instructions": [{"type": "number_words", "num_words": 3, "words": 2}]},
     "number_words takes num_words, relation, not words"),
    ({"instructions": [{"type": "letter_frequency", "letter": "ab", "let_frequency": 1}]}, "'ab' is not one letter"),
    ({"instructions": [{"type": "number_words", "num_words": -1}]}, "-1 is not a whole number >= 0"),
    ({"instructions": [{"type": "keywords", "keywords": []}]}, "is not a list of words"),
    ({"instruction_id_list": ["punctuation:no_comma"], "kwargs": [{}, {}]}, "1 instruction ids but 2 kwargs"),
    ({"instructions": [{"type": "response_language", "language": "fr"}]}, "cannot check a reply's language"),
])
def test_a_data_item_it_cannot_check_fails_the_sample(data, message):
    with pytest.raises(ValueError, match="data item '0:0'" if "language" not in message else "response_language"):
        try:
            InstructionFollowingEvaluator().evaluate({"uid": "0:0", **data}, BaseEvaluationTarget("reply"))
        except ValueError as exc:
            assert message in str(exc), str(exc)
            raise


def test_ignore_kinds_leaves_instructions_out():
    evaluator = InstructionFollowingEvaluator(ignore_kinds=["language:response_language"])
    row = {"uid": "0:0", "instructions": [{"type": "response_language", "language": "fr"}, "no_comma"]}
    result = evaluator.evaluate(row, BaseEvaluationTarget("Bonjour la mer"))
    assert result.reward == 1.0 and result.metrics["num_instructions"] == 1.0
    with pytest.raises(ValueError, match="all of its kinds are in ignore_kinds"):
        evaluator.evaluate({"uid": "0:0", "instructions": [{"type": "response_language", "language": "fr"}]},
                           BaseEvaluationTarget("Bonjour"))


@pytest.mark.parametrize("options, message", [
    ({"mode": "lenient"}, "rollout_worker.evaluator.mode: 'lenient' is not one of strict, loose"),
    ({"reward_mode": "all"}, "rollout_worker.evaluator.reward_mode: 'all' is not one of fraction, all_or_nothing"),
    ({"ignore_kinds": ["no_commas"]}, "rollout_worker.evaluator.ignore_kinds: unknown instruction kind 'no_commas'"),
])
def test_bad_options_are_config_errors(options, message):
    with pytest.raises(ConfigError, match=message):
        InstructionFollowingEvaluator(**options)


# -- through a run ---------------------------------------------------------------------------------

# The mock policy echoes the prompt: each row's prompt is the reply the evaluator sees.
ROWS = [
    ("<<Sea>>\nThe sea is wide.", ["title", "no_comma"], 1.0),
    ("The sea is wide, and deep.", ["title", "no_comma"], 0.0),
    ("<<Sea>>\nWide, deep.", ["title", "no_comma"], 0.5),
    ("one two three four five", [{"type": "number_words", "num_words": 3, "relation": "at most"}], 0.0),
]


def test_the_evaluator_through_a_short_mock_run(run_local):
    rows = [{"prompt": p, "instructions": i} for p, i, _ in ROWS]
    recipe = make_recipe(
        data={"type": "inline", "shuffle": False, "rows": rows},
        trajectory_pool={"batch_size": 2 * len(ROWS), "group_size": 2},
        trainer={"total_train_steps": 1},
        rollout_worker={"num_workers": 2, "sampling": {"max_tokens": 512},
                        "evaluator": {"type": "instruction_following"}},
        validate={"validate_before_train": True, "success_threshold": 1.0, "data": {"type": "inline", "rows": rows}},
        service={"inference_service": {"backend": "mock", "mode": "echo"}})
    controller, summary = run_local(recipe, pm=plugin_manager(rewards_plugin))
    assert summary.stopped_by == "finished" and summary.global_step == 1
    val = summary.validation[0]
    expected = [reward for _, _, reward in ROWS]
    assert val["val/num_samples"] == len(ROWS) and val["val/num_failed"] == 0
    assert val["val/reward"] == pytest.approx(sum(expected) / len(ROWS))
    assert val["val/success_rate"] == pytest.approx(sum(r == 1.0 for r in expected) / len(ROWS))
    # a kind's instruction-level accuracy: its followed mean over its total mean
    assert val["val/title_total"] == pytest.approx(3 / 4) and val["val/title_followed"] == pytest.approx(2 / 4)
    assert val["val/no_comma_followed"] / val["val/no_comma_total"] == pytest.approx(1 / 3)
    assert val["val/number_words_total"] == pytest.approx(1 / 4) and val["val/number_words_followed"] == 0.0
    trained = [t for batch in controller.trainer.batches for t in batch]
    assert sorted(t["score"]["reward"] for t in trained) == sorted(expected * 2)


def test_docs_list_every_kind_as_the_code_checks_it():
    from pathlib import Path

    from nexrl_rewards.instruction_following import REQUIRED

    section = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text().split(
        "## `instruction_following`", 1)[1].split("\n## ", 1)[0]
    for kind in KINDS.values():
        params = ", ".join(f"`{p}`" if d is REQUIRED or d in ((), None) else f"`{p}` (default {d})"
                           for p, (_, d) in kind.params.items())
        row = f"| `{kind.name}` | `{kind.ifeval}` | {params or '—'} | {kind.words} |"
        assert row in section, row
