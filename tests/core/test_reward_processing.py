"""Reward and sample processing (nexrl_core.algorithms.reward_processing), torch-free: each function
against a plain-Python formula written out here (``statistics``, loops; 1e-6), the seed's order,
per-domain settings, the running statistics and their checkpoint, and the recipe keys."""

from __future__ import annotations

import statistics

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core import Option
from nexrl_core import algorithms as al
from nexrl_core.config.options import check_options

TOL = 1e-6
prop = settings(max_examples=60, deadline=None)
rewards_st = st.floats(min_value=-3.0, max_value=3.0, allow_nan=False, allow_infinity=False)


@st.composite
def batches(draw, min_rows=1, max_rows=10):
    """(rewards, group ids, truncated) as plain lists; rewards drawn from few values so groups are
    sometimes flat."""
    rows = draw(st.integers(min_rows, max_rows))
    pool = draw(st.lists(rewards_st, min_size=1, max_size=3))
    rewards = [draw(st.sampled_from(pool)) for _ in range(rows)]
    groups = [draw(st.sampled_from(["g0", "g1", "g2", 3])) for _ in range(rows)]
    truncated = [draw(st.booleans()) for _ in range(rows)]
    return rewards, groups, truncated


def close(got, want):
    got = np.asarray(got, dtype=np.float64).tolist()
    assert len(got) == len(want)
    for a, b in zip(got, want):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (got, want)


def sd(values):
    return statistics.stdev(values) if len(values) > 1 else 0.0


# ---------------------------------------------------------------- reference formulas (independent)

def ref_postprocess(rewards, groups, truncated, history=(), *, overlong="keep", overlong_reward=0.0, norm="none",
                    norm_mean=True, norm_std=True, epsilon=1e-6, clip=None, scale=1.0):
    r = [overlong_reward if (overlong == "score" and t) else x for x, t in zip(rewards, truncated)]
    if norm in ("group", "batch", "running"):
        out = []
        for i, x in enumerate(r):
            if norm == "group":
                pool = [y for y, g in zip(r, groups) if g == groups[i]]
            elif norm == "batch":
                pool = r
            else:
                pool = list(history) + r
            mu, sigma = statistics.fmean(pool), sd(pool)
            y = x - mu if norm_mean else x
            out.append(y / (sigma + epsilon) if norm_std else y)
        r = out
    if clip is not None:
        r = [min(max(x, -clip), clip) for x in r]
    return [scale * x for x in r]


def ref_mask(rewards, groups, truncated, *, overlong="keep", mask_flat_groups=False):
    out = []
    for i in range(len(rewards)):
        keep = 1.0
        if overlong == "mask" and truncated[i]:
            keep = 0.0
        if mask_flat_groups and len({x for x, g in zip(rewards, groups) if g == groups[i]}) == 1:
            keep = 0.0
        out.append(keep)
    return out


settings_st = st.fixed_dictionaries({
    "overlong": st.sampled_from(al.OVERLONG_MODES),
    "overlong_reward": st.sampled_from([0.0, -1.0]),
    "norm": st.sampled_from(al.NORM_MODES),
    "norm_mean": st.booleans(),
    "norm_std": st.booleans(),
    "clip": st.sampled_from([None, 0.5, 2.0]),
    "scale": st.sampled_from([1.0, 0.5, -2.0]),
})


# ---------------------------------------------------------------- the functions

@prop
@given(batches(), settings_st, st.lists(rewards_st, max_size=6))
def test_reward_postprocess_matches_the_formula(batch, options, history):
    rewards, groups, truncated = batch
    running = al.RunningMoments().update(np.array(history))
    got, after, metrics = al.reward_postprocess(np.array(rewards), groups, np.array(truncated), running, **options)
    close(got, ref_postprocess(rewards, groups, truncated, history, **options))
    if options["norm"] == "running":
        scored = ref_postprocess(rewards, groups, truncated, overlong=options["overlong"],
                                 overlong_reward=options["overlong_reward"])
        assert after.count == len(history) + len(rewards)
        assert metrics["reward_running_mean"] == pytest.approx(statistics.fmean(list(history) + scored))
        assert metrics["reward_running_std"] == pytest.approx(sd(list(history) + scored))
    else:
        assert after == running  # the statistics move only with norm: running
    if options["clip"] is not None:
        before_clip = ref_postprocess(rewards, groups, truncated, history, **{**options, "clip": None, "scale": 1.0})
        assert metrics["reward_clip_frac"] == pytest.approx(
            sum(abs(x) > options["clip"] for x in before_clip) / len(rewards))


@prop
@given(batches(), st.sampled_from(al.OVERLONG_MODES), st.booleans())
def test_sample_mask_matches_the_formula(batch, overlong, flat):
    rewards, groups, truncated = batch
    got = al.get_sample_level_mask(np.array(rewards), groups, np.array(truncated), overlong=overlong,
                                   mask_flat_groups=flat)
    close(got, ref_mask(rewards, groups, truncated, overlong=overlong, mask_flat_groups=flat))


def test_group_normalisation_centres_each_group_and_a_single_value_gives_zero():
    out, _, _ = al.reward_postprocess(np.array([1.0, 0.0, 0.0, 0.0, 5.0]), ["a", "a", "a", "a", "b"],
                                      np.zeros(5, bool), norm="group")
    assert abs(out[:4].sum()) < 1e-9
    assert statistics.stdev(out[:4].tolist()) == pytest.approx(1.0, abs=1e-5)  # (r - mu) / sigma: unit spread
    assert out[4] == 0.0  # a group of one has no spread: centred to 0, no division blow-up


@prop
@given(st.lists(st.lists(rewards_st, min_size=0, max_size=7), min_size=1, max_size=5))
def test_running_moments_equal_the_statistics_of_everything_seen(chunks):
    moments = al.RunningMoments()
    for chunk in chunks:
        moments = moments.update(np.array(chunk))
    seen = [x for chunk in chunks for x in chunk]
    assert moments.count == len(seen)
    if seen:
        assert moments.mean == pytest.approx(statistics.fmean(seen), abs=1e-9)
        assert moments.std == pytest.approx(sd(seen), abs=1e-9)
    assert al.RunningMoments.from_dict(moments.to_dict()) == moments


def test_overlong_score_happens_before_normalisation_and_flat_check_sees_raw_rewards():
    # The seed's order: the mask is decided on the evaluator's rewards, the reward is post-processed
    # after (a cut-off response scored -1 joins its group's statistics as -1).
    rewards, groups, trunc = np.array([1.0, 1.0]), ["g", "g"], np.array([False, True])
    mask = al.get_sample_level_mask(rewards, groups, trunc, overlong="score", mask_flat_groups=True)
    assert mask.tolist() == [0.0, 0.0]
    out, _, _ = al.reward_postprocess(rewards, groups, trunc, overlong="score", overlong_reward=-1.0,
                                      norm="group", norm_std=False)
    assert out.tolist() == [1.0, -1.0]


# ---------------------------------------------------------------- per domain

def test_process_rewards_applies_each_domains_settings_to_its_rows_only():
    rewards = np.array([1.0, 0.0, 1.0, 1.0, 0.0, 0.5, 0.5])
    groups = ["m0", "m0", "c0", "c0", "c1", "c1", "x"]
    domains = ["math", "math", "code", "code", "code", "code", None]
    truncated = np.array([False, False, True, False, False, False, False])
    options = {"norm": "group", "norm_std": False,
               "domains": {"code": {"norm": "batch", "clip": 0.4, "scale": 2.0, "overlong": "mask",
                                    "mask_flat_groups": True}}}
    result = al.process_rewards(rewards, groups, truncated, domains, options)
    code = [1.0, 1.0, 0.0, 0.5]
    close(result.rewards, ref_postprocess([1.0, 0.0], ["m0", "m0"], [False, False], norm="group", norm_std=False)
          # code inherits the top-level norm_std: false and overrides the rest
          + ref_postprocess(code, groups[2:6], [True, False, False, False], norm="batch", norm_std=False, clip=0.4,
                            scale=2.0)
          + [0.0])  # no domain: the top-level settings (a group of one centres to 0)
    # code: row 2 truncated (masked), group c0 = [1, 1] is flat (masked); math keeps every row
    assert result.sample_mask.tolist() == [1, 1, 0, 0, 1, 1, 1]
    assert result.metrics["code/masked_frac"] == 0.5
    assert result.metrics["code/truncated_frac"] == 0.25
    assert result.metrics["math/masked_frac"] == 0.0
    assert "code/reward_clip_frac" in result.metrics and "math/reward_clip_frac" not in result.metrics
    assert result.metrics["processed_reward_mean"] == 0.0  # the row without a domain: bare names


def test_domain_settings_layer_defaults_top_level_and_domain():
    options = {"norm": "group", "clip": 1.0, "domains": {"code": {"clip": 3.0}}}
    assert al.domain_settings(options, "code")["clip"] == 3.0
    assert al.domain_settings(options, "math")["clip"] == 1.0
    assert al.domain_settings(options, "code")["norm"] == "group"
    assert al.domain_settings({}, None)["scale"] == 1.0


def test_running_statistics_are_kept_per_domain_and_survive_a_checkpoint():
    options = {"norm": "running"}
    one = al.RewardProcessor(options)
    one(np.array([1.0, 0.0]), ["a", "a"], np.zeros(2, bool), ["x", "x"])
    one(np.array([3.0, 3.0]), ["b", "b"], np.zeros(2, bool), ["y", "y"])
    state = one.state_dict()
    assert state["x"]["count"] == 2 and state["y"]["count"] == 2  # domains never mix
    resumed = al.RewardProcessor(options)
    resumed.load_state_dict(state)
    batch = (np.array([0.0, 1.0, 2.0]), ["c", "c", "d"], np.zeros(3, bool), ["x", "x", "y"])
    np.testing.assert_array_equal(one(*batch).rewards, resumed(*batch).rewards)
    history = {"x": [1.0, 0.0, 0.0, 1.0], "y": [3.0, 3.0, 2.0]}
    for domain, seen in history.items():
        assert one.running[domain].mean == pytest.approx(statistics.fmean(seen))
        assert one.running[domain].std == pytest.approx(statistics.stdev(seen))


def test_defaults_change_nothing():
    rewards = np.array([0.25, 1.0, 0.0], dtype=np.float32)
    result = al.process_rewards(rewards, ["a", "a", "b"], np.ones(3, bool), ["d", "d", None], {})
    assert result.rewards.astype(np.float32).tobytes() == rewards.tobytes()
    assert result.sample_mask.tolist() == [1.0, 1.0, 1.0]


# ---------------------------------------------------------------- recipe keys

@pytest.mark.parametrize("section,expected", [
    ({"norm": "grop"}, "algorithm.reward_processing.norm: 'grop' is not one of none, group, batch, running; "
                       "did you mean 'group'?"),
    ({"clip": -1.0}, "algorithm.reward_processing.clip: expected a positive number or null, got -1.0"),
    ({"domains": {"code": {"scael": 2.0}}}, "algorithm.reward_processing.domains.code.scael: unknown key; did you "
                                           "mean 'algorithm.reward_processing.domains.code.scale'?"),
    ({"domains": {"code": {"overlong": "drop"}}}, "algorithm.reward_processing.domains.code.overlong: 'drop' is not "
                                                  "one of keep, mask, score"),
    ({"domains": {"code": 3}}, "algorithm.reward_processing.domains.code: expected a mapping, got an integer (3)"),
])
def test_bad_reward_processing_keys_are_one_line_naming_the_key(section, expected):
    declared = {"reward_processing": Option(options=al.REWARD_PROCESSING_OPTIONS)}
    problems = check_options({"reward_processing": section}, declared, "algorithm")
    assert problems == [expected]
