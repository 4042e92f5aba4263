"""The evaluation core (reducer + summarize) against its spec, docs/evaluation.md.

Each test cites the section of the page it checks. The last tests parse the page's metric
table and fail when the code and the page disagree (doc/code drift guard).
"""

from __future__ import annotations

import itertools
import re
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core.runtime.eval_core import DuplicateSampleError, EvalState, SampleRecord, add_sample, pass_at_k, summarize
from nexrl_core.validator import Validator

DOC = Path(__file__).resolve().parents[2] / "docs" / "evaluation.md"


def rec(uid, idx=0, source="default", failed=False, **scores):
    return SampleRecord(uid=str(uid), sample_index=idx, data_source=source, scores={} if failed else dict(scores),
                        failed=failed, error="boom" if failed else None)


def state_of(records):
    state = EvalState()
    for r in records:
        state = add_sample(state, r)
    return state


# -- §Denominators / §Failed samples ------------------------------------------------------

def test_every_mean_divides_by_all_samples_failed_included():
    # docs/evaluation.md §Denominators, §Failed samples
    records = [rec(0, reward=1.0, accuracy=1.0), rec(1, reward=1.0, accuracy=0.0), rec(2, failed=True),
               rec(3, failed=True)]
    m = summarize(state_of(records), expected_samples=4)
    assert m["val/reward"] == pytest.approx(2 / 4)  # not 2/2: failures are never dropped
    assert m["val/accuracy"] == pytest.approx(1 / 4)
    assert not any(k.startswith("val/default_") for k in m)  # one implicit source: no copy of every metric
    assert m["val/num_samples"] == 4.0
    assert m["val/num_failed"] == 2.0
    assert m["val/num_missing"] == 0.0


def test_failed_sample_scores_zero_for_every_key_even_if_it_reported_scores():
    # docs/evaluation.md §Failed samples: a failed trajectory's score dict is ignored (score 0).
    t_ok = {"uid": "0:0", "sample_index": 0, "data_source": "a", "score": {"reward": 1.0, "x": 3.0}}
    t_bad = {"uid": "0:1", "sample_index": 0, "data_source": "a", "failed": True, "error": "e",
             "score": {"reward": 1.0, "x": 3.0}}
    m = summarize(state_of([SampleRecord.from_trajectory(t_ok), SampleRecord.from_trajectory(t_bad)]))
    assert m["val/reward"] == 0.5 and m["val/x"] == 1.5 and m["val/a_x"] == 1.5
    assert m["val/num_failed"] == 1.0


def test_score_key_missing_from_some_samples_counts_zero():
    # docs/evaluation.md §Denominators: a metric reported only sometimes is averaged over all samples
    m = summarize(state_of([rec(0, reward=1.0, extra=4.0), rec(1, reward=1.0)]))
    assert m["val/extra"] == 2.0


def test_no_samples_gives_zero_means_and_counts():
    # docs/evaluation.md §Denominators
    m = summarize(EvalState(), expected_samples=3)
    assert m == {"val/reward": 0.0, "val/num_samples": 0.0, "val/num_failed": 0.0, "val/num_missing": 3.0,
                 "val/success_rate": 0.0}


def test_overall_mean_is_sample_weighted_not_mean_of_source_means():
    # docs/evaluation.md §Denominators
    records = [rec(0, source="a", reward=1.0)] + [rec(i, source="b", reward=0.0) for i in range(1, 4)]
    m = summarize(state_of(records))
    assert m["val/a_reward"] == 1.0 and m["val/b_reward"] == 0.0
    assert m["val/reward"] == 0.25  # not (1 + 0) / 2


records_strategy = st.lists(
    st.tuples(st.integers(0, 6), st.integers(0, 3), st.sampled_from(["a", "b", "c_d"]), st.booleans(),
              st.dictionaries(st.sampled_from(["reward", "accuracy", "len"]),
                              st.floats(-10, 10, allow_nan=False, allow_infinity=False), max_size=3)),
    max_size=30, unique_by=lambda t: (t[0], t[1]))


@settings(max_examples=150, deadline=None)
@given(records_strategy)
def test_means_equal_a_direct_computation(rows):
    # docs/evaluation.md §Metrics, §Denominators, §Failed samples
    records = [rec(u, i, src, failed, **scores) for u, i, src, failed, scores in rows]
    m = summarize(state_of(records), expected_samples=40)
    keys = {"reward"} | {k for r in records for k in r.scores}
    for key in keys:
        vals = [0.0 if r.failed else r.scores.get(key, 0.0) for r in records]
        assert m[f"val/{key}"] == pytest.approx(sum(vals) / len(vals) if vals else 0.0)
        for src in {r.data_source for r in records}:
            sub = [0.0 if r.failed else r.scores.get(key, 0.0) for r in records if r.data_source == src]
            assert m[f"val/{src}_{key}"] == pytest.approx(sum(sub) / len(sub))
    assert m["val/num_samples"] == len(records)
    assert m["val/num_failed"] == sum(r.failed for r in records)
    assert m["val/num_missing"] == 40 - len(records)


# -- §pass@k and mean@k --------------------------------------------------------------------

def brute_force_pass_at_k(outcomes: list[bool], k: int) -> Fraction:
    """Fraction of the k-subsets of the n samples holding at least one correct sample."""
    subsets = list(itertools.combinations(outcomes, k))
    return Fraction(sum(any(s) for s in subsets), len(subsets))


@settings(max_examples=200, deadline=None)
@given(st.lists(st.booleans(), min_size=1, max_size=9), st.data())
def test_pass_at_k_equals_enumeration_over_subsets(outcomes, data):
    # docs/evaluation.md §pass@k and mean@k: the unbiased estimator
    k = data.draw(st.integers(1, len(outcomes)))
    assert pass_at_k(len(outcomes), sum(outcomes), k) == pytest.approx(float(brute_force_pass_at_k(outcomes, k)))


def test_pass_at_k_needs_k_samples():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


@settings(max_examples=100, deadline=None)
@given(st.integers(2, 5), st.lists(st.lists(st.sampled_from([0.0, 0.5, 1.0]), min_size=5, max_size=5),
                                   min_size=1, max_size=6), st.sampled_from([0.5, 1.0]))
def test_summarize_pass_at_k_against_brute_force(n, prompts, threshold):
    # docs/evaluation.md §pass@k and mean@k: mean over prompts; correct = reward >= success_threshold
    records = [rec(u, i, reward=rewards[i]) for u, rewards in enumerate(prompts) for i in range(n)]
    m = summarize(state_of(records), n_samples=n, success_threshold=threshold, expected_samples=n * len(prompts))
    for k in (1, n):
        expect = sum(brute_force_pass_at_k([r >= threshold for r in rewards[:n]], k) for rewards in prompts)
        assert m[f"val/pass@{k}"] == pytest.approx(float(expect / len(prompts)))
    assert m[f"val/mean@{n}"] == pytest.approx(sum(sum(r[:n]) for r in prompts) / (n * len(prompts)))
    assert m["val/num_prompts"] == len(prompts)


def test_pass_at_k_counts_failed_samples_as_incorrect():
    # docs/evaluation.md §Failed samples
    records = [rec("p", 0, reward=1.0), rec("p", 1, failed=True)]
    m = summarize(state_of(records), n_samples=2)
    assert m["val/pass@1"] == 0.5 and m["val/pass@2"] == 1.0
    m = summarize(state_of([rec("p", 0, failed=True), rec("p", 1, failed=True)]), n_samples=2)
    assert m["val/pass@1"] == 0.0 and m["val/pass@2"] == 0.0


def test_incomplete_prompt_does_not_crash_and_counts_missing_as_incorrect():
    # docs/evaluation.md §Missing samples: n = max(recorded, n_samples)
    m = summarize(state_of([rec("p", 0, reward=1.0)]), n_samples=4, expected_samples=4)
    assert m["val/num_missing"] == 3.0
    assert m["val/pass@1"] == pytest.approx(0.25)
    assert m["val/pass@4"] == 1.0


def test_pass_metrics_only_with_several_samples_per_prompt():
    # docs/evaluation.md §Metrics (Emitted column)
    m = summarize(state_of([rec(0, reward=1.0)]), n_samples=1)
    assert not any(k.startswith(("val/pass@", "val/mean@", "val/num_prompts")) for k in m)


# -- §Duplicates / reducer -----------------------------------------------------------------

def test_duplicate_sample_is_an_error():
    # docs/evaluation.md §Duplicates
    state = add_sample(EvalState(), rec("u", 0, reward=1.0))
    with pytest.raises(DuplicateSampleError):
        add_sample(state, rec("u", 0, reward=0.0))
    with pytest.raises(DuplicateSampleError):
        add_sample(state, rec("u", 0, failed=True))
    add_sample(state, rec("u", 1, reward=0.0))  # another sample of the same row is fine


def test_reducer_is_pure():
    # docs/evaluation.md §Samples: add_sample returns a new state
    s0 = EvalState()
    s1 = add_sample(s0, rec(0, reward=1.0))
    assert s0.samples == {} and len(s1.samples) == 1


class _Tracker:
    def __init__(self):
        self.errors = []

    def report_error(self, module, work, message, severity=None, details=None):
        self.errors.append(message)


def test_validator_refuses_a_duplicate_and_reports_it():
    # docs/evaluation.md §Duplicates: counted exactly once, reported as an error
    v = Validator({"n_samples": 1})
    v.set_activity_tracker(_Tracker())
    traj = {"uid": "0:0", "sample_index": 0, "data_source": "a", "score": {"reward": 1.0}}
    assert v.put_trajectory(dict(traj)) == "success"
    assert v.put_trajectory(dict(traj, score={"reward": 0.0})) == "fail"
    assert v.compute_metrics()["val/num_samples"] == 1.0
    assert v.compute_metrics()["val/reward"] == 1.0
    assert v._activity_tracker.errors and "counted twice" in v._activity_tracker.errors[0]


def test_validator_uses_the_same_summarize():
    # docs/evaluation.md §Samples: the Validator and `nexrl eval` share eval_core
    v = Validator({"n_samples": 2, "success_threshold": 0.5})
    trajs = [{"uid": "r0", "sample_index": 0, "score": {"reward": 1.0}},
             {"uid": "r0", "sample_index": 1, "failed": True, "error": "x", "score": {}},
             {"uid": "r1", "sample_index": 0, "data_source": "s", "score": {"reward": 0.5}},
             {"uid": "r1", "sample_index": 1, "data_source": "s", "score": {"reward": 0.0}}]
    for t in trajs:
        assert v.put_trajectory(t) == "success"
    state = state_of([SampleRecord.from_trajectory(t) for t in trajs])
    assert v.compute_metrics() == summarize(state, n_samples=2, success_threshold=0.5)
    v.clear()
    assert v.compute_metrics()["val/num_samples"] == 0.0


# -- doc/code drift guard --------------------------------------------------------------------

def documented_metrics() -> list[tuple[str, str]]:
    """(name template, emitted condition) for each row of the §Metrics table."""
    text = DOC.read_text(encoding="utf-8")
    section = text.split("## Metrics", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in section.splitlines():
        m = re.match(r"\|\s*`(val/[^`]+)`\s*\|.*\|\s*([^|]+?)\s*\|\s*$", line)
        if m:
            rows.append((m.group(1), m.group(2)))
    return rows


def expand(template: str, score_keys, sources, n: int) -> set[str]:
    names = {template.replace("<n>", str(n))}
    if "<data_source>" in template:
        names = {x.replace("<data_source>", s) for x in names for s in sources}
    if "<score_key>" in template:
        names = {x.replace("<score_key>", k) for x in names for k in score_keys}
    return names


def emitted(condition: str, n: int, expected_known: bool, sources: set[str]) -> bool:
    if condition == "always":
        return True
    unless_default = ", unless `default` is the only data source"
    if condition.endswith(unless_default) or condition == unless_default[2:]:
        if sources == {"default"}:
            return False
        condition = condition[:-len(unless_default)] if condition.endswith(unless_default) else "always"
        return emitted(condition, n, expected_known, sources)
    if "n > 1" in condition:
        return n > 1
    if "expected" in condition:
        return expected_known
    if condition == "when a row has a `tag`":
        return False  # these samples have none (test_seed_features.py covers the tagged metrics)
    raise AssertionError(f"docs/evaluation.md §Metrics: unparsed Emitted condition {condition!r}")


def test_doc_table_is_parseable():
    rows = documented_metrics()
    names = [name for name, _ in rows]
    assert "val/<score_key>" in names and "val/num_samples" in names and "val/pass@<n>" in names
    assert len(rows) >= 9


@pytest.mark.parametrize("sources", [("a", "b"), ("a", "a"), ("default", "default"), ("default", "b")])
@pytest.mark.parametrize("n,expected_known", [(1, False), (1, True), (3, True), (3, False)])
def test_summarize_emits_exactly_the_documented_metrics(n, expected_known, sources):
    # docs/evaluation.md §Metrics: the table is the complete list
    records = [rec(u, i, src, reward=1.0, accuracy=0.0) for u, src in enumerate(sources) for i in range(n)]
    records.append(rec(2, 0, sources[0], failed=True))
    score_keys = {"reward", "accuracy"}
    m = summarize(state_of(records), n_samples=n, expected_samples=(3 * n) if expected_known else None)
    documented = set()
    for template, condition in documented_metrics():
        if emitted(condition, n, expected_known, set(sources)):
            documented |= expand(template, score_keys, set(sources), n)
    assert set(m) == documented


# -- domains (multi-domain data) ---------------------------------------------------------------------

def test_domain_metrics_cover_the_domains_samples_and_pass_at_k_its_prompts():
    # docs/evaluation.md §Metrics: <data_source> ranges over data sources and domains
    def drec(uid, idx, source, domain, reward):
        return SampleRecord(uid=uid, sample_index=idx, data_source=source, scores={"reward": reward}, domain=domain)

    outcomes = {("m0", "gsm8k", "math"): [1.0, 0.0, 0.0], ("m1", "aime", "math"): [0.0, 0.0, 0.0],
                ("c0", "code", "code"): [1.0, 1.0, 0.0]}
    records = [drec(uid, i, src, dom, r) for (uid, src, dom), rs in outcomes.items() for i, r in enumerate(rs)]
    m = summarize(state_of(records), n_samples=3)
    assert m["val/math_reward"] == pytest.approx(1 / 6)  # both of the domain's data sources
    assert m["val/gsm8k_reward"] == pytest.approx(1 / 3) and m["val/aime_reward"] == 0.0
    assert m["val/code_reward"] == pytest.approx(2 / 3)  # a data source named like a domain: the domain's
    for k in (1, 3):
        math = (brute_force_pass_at_k([True, False, False], k) + brute_force_pass_at_k([False] * 3, k)) / 2
        assert m[f"val/math_pass@{k}"] == pytest.approx(float(math))
        assert m[f"val/code_pass@{k}"] == pytest.approx(float(brute_force_pass_at_k([True, True, False], k)))
    assert m["val/math_mean@3"] == pytest.approx(1 / 6)
    assert SampleRecord.from_trajectory({"uid": "u", "domain": "math", "score": {"reward": 1.0}}).domain == "math"
