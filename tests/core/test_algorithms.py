"""The core's algorithm registry (nexrl_core.algorithms), torch-free: every function against a
plain-Python formula written out here (1e-6), its invariants, and the registry's rules."""

from __future__ import annotations

import math
import statistics
import subprocess
import sys
from typing import Literal

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core import Option, hookimpl
from nexrl_core import algorithms as al
from nexrl_core.errors import ConfigError, PluginError
from nexrl_core.launch.recipe import check_algorithm
from nexrl_core.plugins import PluginManager
from nexrl_core.trainer import BaseTrainer

TOL = 1e-6
prop = settings(max_examples=60, deadline=None)
floats = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def token_batches(draw, min_rows=1, max_rows=6, max_len=6):
    """(values [B][T], mask [B][T], group ids [B]) as plain Python lists."""
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    values = [[draw(floats) for _ in range(length)] for _ in range(rows)]
    mask = [[draw(st.booleans()) for _ in range(length)] for _ in range(rows)]
    groups = [draw(st.sampled_from(["a", "b", "c", 7])) for _ in range(rows)]
    return values, mask, groups


def f64(x):
    return np.asarray(x, dtype=np.float64)


def assert_close(array, expected):
    flat, exp = np.asarray(array, dtype=np.float64).reshape(-1).tolist(), f64(expected).reshape(-1).tolist()
    assert len(flat) == len(exp)
    for a, b in zip(flat, exp):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (flat, exp)


# ---------------------------------------------------------------- reference formulas


def ref_scores(values, mask):
    return [sum(v for v, m in zip(row, mrow) if m) for row, mrow in zip(values, mask)]


def ref_group_advantage(values, mask, groups, eps=1e-6, norm=True):
    scores = ref_scores(values, mask)
    adv = []
    for i, s in enumerate(scores):
        members = [scores[j] for j, g in enumerate(groups) if g == groups[i]]
        if len(members) == 1:
            a = 0.0
        else:
            mean = sum(members) / len(members)
            std = math.sqrt(sum((m - mean) ** 2 for m in members) / (len(members) - 1))
            a = (s - mean) / (std + eps) if norm else s - mean
        adv.append([a if m else 0.0 for m in mask[i]])
    return adv


def ref_kl(a, b, kind):
    if kind in ("kl", "k1"):
        return a - b
    if kind == "abs":
        return abs(a - b)
    if kind in ("mse", "k2"):
        return 0.5 * (a - b) ** 2
    r = b - a
    return min(max(math.exp(r) - r - 1, -10.0), 10.0)


def inputs(values, mask, groups):
    return al.AdvantageInputs(f64(values), f64(mask), groups)


# ---------------------------------------------------------------- advantages


@prop
@given(token_batches())
def test_scores_to_token_level_puts_score_on_last_valid_token(batch):
    values, mask, _ = batch
    scores = [row[0] for row in values]
    out = al.scores_to_token_level(f64(scores), np.array(mask))
    expected = []
    for s, mrow in zip(scores, mask):
        row = [0.0] * len(mrow)
        valid = [i for i, m in enumerate(mrow) if m]
        if valid:
            row[valid[-1]] = s
        expected.append(row)
    assert_close(out, expected)


@prop
@given(token_batches(), st.booleans(), st.sampled_from([1e-6, 0.1]))
def test_grpo_matches_reference(batch, norm, eps):
    values, mask, groups = batch
    adv, ret = al.grpo(inputs(values, mask, groups), epsilon=eps, norm_adv_by_std=norm)
    assert_close(adv, ref_group_advantage(values, mask, groups, eps, norm))
    assert np.array_equal(adv, ret)


@prop
@given(token_batches())
def test_dr_grpo_is_the_group_centred_score(batch):
    values, mask, groups = batch
    adv, _ = al.dr_grpo(inputs(values, mask, groups))
    assert_close(adv, ref_group_advantage(values, mask, groups, norm=False))


@prop
@given(token_batches(min_rows=2), st.sampled_from([al.grpo, al.dr_grpo]))
def test_group_advantages_sum_to_zero_per_group(batch, estimator):
    values, mask, groups = batch
    adv, _ = estimator(inputs(values, mask, groups))
    # Per row the advantage is one number on every valid token; recover it and sum per group.
    rows = [next((a for a, m in zip(arow, mrow) if m), 0.0) for arow, mrow in zip(adv.tolist(), mask)]
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        if all(any(mask[i]) for i in members):
            assert abs(sum(rows[i] for i in members)) <= 1e-6 * max(1.0, len(members))


def test_group_of_one_and_constant_group_get_zero():
    rewards = [[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [2.0, 0.0]]
    for estimator in (al.grpo, al.dr_grpo):
        adv, _ = estimator(inputs(rewards, [[1, 1]] * 4, ["solo", "pair", "same", "same"]))
        assert np.abs(adv).max() == 0.0


def test_grpo_std_is_unbiased():
    scores = f64([0.0, 1.0, 1.0, 4.0])
    mean, std, count = al.group_stats(scores, [0, 0, 0, 0])
    assert std[0] == pytest.approx(statistics.stdev([0.0, 1.0, 1.0, 4.0]), abs=1e-12)
    assert mean[0] == pytest.approx(1.5) and count[0] == 4
    adv, _ = al.grpo(inputs(scores[:, None], np.ones((4, 1)), [0] * 4), epsilon=0.0)
    assert np.std(adv[:, 0], ddof=1) == pytest.approx(1.0, abs=1e-12)


def test_masked_tokens_do_not_count_and_dtype_is_kept():
    rewards = np.array([[1.0, 100.0], [0.0, 100.0]], dtype=np.float32)
    adv, _ = al.grpo(al.AdvantageInputs(rewards, np.array([[1, 0], [1, 0]], dtype=np.float32), ["g", "g"]))
    assert adv.dtype == np.float32
    assert np.abs(adv[:, 1]).max() == 0.0
    assert adv[0, 0] == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)


def test_inputs_are_checked():
    with pytest.raises(ValueError, match="group_ids"):
        inputs([[1.0], [2.0]], [[1], [1]], ["a"])
    with pytest.raises(ValueError, match="same"):
        inputs([[1.0, 2.0]], [[1]], ["a"])


# ---------------------------------------------------------------- KL


@prop
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=8), st.sampled_from(sorted(al.KL_KINDS)))
def test_kl_penalty_matches_reference(pairs, kind):
    logp, ref = [p for p, _ in pairs], [r for _, r in pairs]
    assert_close(al.kl_penalty(f64(logp), f64(ref), kind), [ref_kl(a, b, kind) for a, b in pairs])


def test_low_var_kl_is_clamped_and_unknown_kind_names_valid_ones():
    assert al.kl_penalty(f64([0.0, 0.0]), f64([200.0, -200.0]), "k3").tolist() == [10.0, 10.0]
    with pytest.raises(ValueError, match="low_var_kl"):
        al.kl_penalty(f64([0.0]), f64([0.0]), "full")


def test_adaptive_controller_moves_toward_target():
    ctrl = al.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.5, n_steps=10)  # far above target: the error is clipped at +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    high = ctrl.value
    ctrl.update(current_kl=0.04, n_steps=10)  # below target: the coefficient shrinks
    assert ctrl.value == pytest.approx(high * (1 + (0.04 / 0.05 - 1) * 10 / 100))


def test_get_kl_controller():
    fixed = al.get_kl_controller({"type": "fixed", "kl_coef": 0.3})
    fixed.update(10.0, 5)
    assert isinstance(fixed, al.FixedKLController) and fixed.value == 0.3
    adaptive = al.get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 1.0, "horizon": 50})
    assert isinstance(adaptive, al.AdaptiveKLController) and adaptive.horizon == 50
    assert al.get_kl_controller({}).value == al.KL_CTRL_DEFAULTS["kl_coef"]
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        al.get_kl_controller({"type": "pid"})
    with pytest.raises(TypeError, match="kl_ctrl.kl_coef"):
        al.get_kl_controller({"kl_coef": "lots"})


@prop
@given(token_batches(), st.floats(0.0, 1.0), st.sampled_from(["kl", "k3"]))
def test_apply_kl_penalty_matches_reference(batch, beta, kind):
    values, mask, _ = batch
    ref_lp = [[v * 0.5 for v in row] for row in values]
    scores = [[1.0] * len(row) for row in values]
    rewards, metrics = al.apply_kl_penalty(f64(scores), f64(values), f64(ref_lp), f64(mask),
                                           al.FixedKLController(beta), kind)
    expected, row_kls = [], []
    for srow, vrow, rrow, mrow in zip(scores, values, ref_lp, mask):
        kls = [ref_kl(v, r, kind) if m else 0.0 for v, r, m in zip(vrow, rrow, mrow)]
        expected.append([s - beta * k for s, k in zip(srow, kls)])
        row_kls.append(sum(kls) / max(sum(mrow), 1))
    assert_close(rewards, expected)
    assert metrics["kl_penalty"] == pytest.approx(sum(row_kls) / len(row_kls), abs=TOL)
    assert metrics["kl_coef"] == beta


# ---------------------------------------------------------------- rollout mismatch and correction


@st.composite
def logprob_pairs(draw):
    values, mask, _ = draw(token_batches())
    lp = st.floats(min_value=-8.0, max_value=0.0, allow_nan=False)
    trainer = [[draw(lp) for _ in row] for row in values]
    rollout = [[draw(lp) for _ in row] for row in values]
    return trainer, rollout, mask


@prop
@given(logprob_pairs())
def test_mismatch_metrics_match_reference(pairs):
    trainer, rollout, mask = pairs
    got = al.rollout_mismatch_metrics(f64(trainer), f64(rollout), np.array(mask))
    diffs, k3s = [], []
    for trow, rrow, mrow in zip(trainer, rollout, mask):
        for t, r, m in zip(trow, rrow, mrow):
            if m:
                diffs.append(abs(t - r))
                d = t - r  # samples come from the rollout policy: k3 of KL(rollout || trainer)
                k3s.append(min(math.exp(d) - d - 1, 10.0))
    if not diffs:
        assert got == {"rollout_logprob_diff_mean": 0.0, "rollout_logprob_diff_max": 0.0, "rollout_kl_k3": 0.0}
        return
    assert got["rollout_logprob_diff_mean"] == pytest.approx(sum(diffs) / len(diffs), abs=TOL)
    assert got["rollout_logprob_diff_max"] == pytest.approx(max(diffs), abs=TOL)
    assert got["rollout_kl_k3"] == pytest.approx(sum(k3s) / len(k3s), abs=TOL)


@prop
@given(logprob_pairs())
def test_each_rows_own_mismatch_and_where_it_is(pairs):
    trainer, rollout, mask = pairs
    gap, position = al.rollout_mismatch_per_row(f64(trainer), f64(rollout), np.array(mask))
    for row, (trow, rrow, mrow) in enumerate(zip(trainer, rollout, mask)):
        diffs = [abs(t - r) if m else None for t, r, m in zip(trow, rrow, mrow)]
        valid = [d for d in diffs if d is not None]
        if not valid:
            assert math.isnan(gap[row]) and position[row] == -1
            continue
        assert gap[row] == pytest.approx(max(valid), abs=TOL)
        assert position[row] == diffs.index(max(valid))  # the first token where it is largest
    if np.array(mask).any():  # the rows' maxima hold the batch's
        whole = al.rollout_mismatch_metrics(f64(trainer), f64(rollout), np.array(mask))["rollout_logprob_diff_max"]
        assert np.nanmax(gap) == pytest.approx(whole, abs=TOL)


def test_a_samples_gap_is_the_largest_of_its_rows_and_names_the_segment():
    gaps, positions = np.array([0.2, 0.5, np.nan, 0.1, 0.3]), np.array([0, 4, -1, 2, 1])
    got = al.sample_logprob_gaps(gaps, positions, [0, 0, 1, 2, 2])  # trajectory 1: no trained token
    assert got == {0: (1, {"max": 0.5, "position": 4, "segment": 1}), 2: (4, {"max": 0.3, "position": 1, "segment": 1})}
    assert al.sample_logprob_gaps(gaps[:2], positions[:2], [0, 1]) == {0: (0, {"max": 0.2, "position": 0}),
                                                                       1: (1, {"max": 0.5, "position": 4})}


def test_mismatch_is_zero_on_policy():
    lp = f64([[-1.0, -2.0, -0.5]])
    got = al.rollout_mismatch_metrics(lp, lp.copy(), np.ones((1, 3)))
    assert got == {"rollout_logprob_diff_mean": 0.0, "rollout_logprob_diff_max": 0.0, "rollout_kl_k3": 0.0}


@prop
@given(logprob_pairs(), st.floats(1.0, 5.0))
def test_truncated_is_weights_match_reference(pairs, cap):
    trainer, rollout, mask = pairs
    weights, metrics = al.truncated_is_weights(f64(trainer), f64(rollout), np.array(mask), cap)
    expected, kept, capped = [], [], []
    for trow, rrow, mrow in zip(trainer, rollout, mask):
        row = []
        for t, r, m in zip(trow, rrow, mrow):
            w = min(math.exp(t - r), cap) if m else 0.0
            row.append(w)
            if m:
                kept.append(w)
                capped.append(1.0 if t - r > math.log(cap) else 0.0)  # the ratio exceeds the cap
        expected.append(row)
    assert_close(weights, expected)
    n = max(len(kept), 1)
    assert metrics["rollout_is_weight_mean"] == pytest.approx(sum(kept) / n, abs=TOL)
    assert metrics["rollout_is_capped_frac"] == pytest.approx(sum(capped) / n, abs=TOL)


def test_truncated_is_weights_are_one_on_policy_and_cap_is_checked():
    lp = f64([[-1.0, -2.0]])
    weights, metrics = al.truncated_is_weights(lp, lp.copy(), np.ones((1, 2)), 2.0)
    assert weights.tolist() == [[1.0, 1.0]] and metrics == {"rollout_is_weight_mean": 1.0, "rollout_is_capped_frac": 0.0}
    for bad in (0.5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="rollout_correction.cap"):
            al.truncated_is_weights(lp, lp, np.ones((1, 2)), bad)
    with pytest.raises(TypeError, match="rollout_correction.cap"):
        al.check_cap("two")


# ---------------------------------------------------------------- metric aggregation


def test_aggregation_rule_by_name():
    parts = [(0.25, {"x": 1.0, "d_max": 3.0, "d_min": 1.0}), (0.75, {"x": 3.0, "d_max": 2.0, "d_min": -1.0})]
    assert al.aggregate_metrics(parts) == {"x": 0.25 * 1 + 0.75 * 3, "d_max": 3.0, "d_min": -1.0}
    assert al.aggregate_metrics([(0.0, {"x": 1.0}), (0.0, {"x": 3.0})]) == {"x": 2.0}  # no tokens: plain mean
    assert al.aggregate_metrics([(0.5, {"x": 1.0}), (0.5, {"y": 4.0})]) == {"x": 1.0, "y": 4.0}


@prop
@given(logprob_pairs(), st.integers(1, 3))
def test_mismatch_metrics_of_micro_batches_aggregate_to_the_batch_metrics(pairs, size):
    """Token-weighted means and maxima combine exactly: the train service's rule loses nothing."""
    trainer, rollout, mask = f64(pairs[0]), f64(pairs[1]), np.array(pairs[2])
    total = mask.sum()
    if not total:
        return
    parts = [(mask[i:i + size].sum() / total,
              al.rollout_mismatch_metrics(trainer[i:i + size], rollout[i:i + size], mask[i:i + size]))
             for i in range(0, len(mask), size)]
    combined = al.aggregate_metrics(parts)
    whole = al.rollout_mismatch_metrics(trainer, rollout, mask)
    for name, value in whole.items():
        assert combined[name] == pytest.approx(value, abs=1e-9), name


# ---------------------------------------------------------------- registry


def test_options_are_keyword_only_parameters_with_defaults():
    grpo = al.AlgorithmFunction.create("advantage_estimator", "grpo", al.grpo, "nexrl-core")
    assert grpo.options == {"epsilon": 1e-6, "norm_adv_by_std": True}
    dr = al.AlgorithmFunction.create("advantage_estimator", "dr_grpo", al.dr_grpo, "nexrl-core")
    assert dr.options == {} and dr.recommended_defaults == {"loss_agg_mode": "seq-mean-token-sum-norm"}
    bound = grpo.bind({"epsilon": 0.5, "unrelated": 1})
    adv, _ = bound(inputs([[1.0], [0.0]], [[1], [1]], ["g", "g"]))
    assert adv[0, 0] == pytest.approx(0.5 / (math.sqrt(0.5) + 0.5))


def _shift_estimator(data: al.AdvantageInputs, *, shift: float = 1.0):
    """A third party's estimator: the raw score plus ``shift``."""
    scores = (data.token_level_rewards * data.response_mask).sum(-1) + shift
    adv = scores[:, None] * data.response_mask
    return adv, adv


def _copy_loss(log_prob, old_log_prob, advantages, response_mask, context, *, mode: str = "a"):
    return 0.0, {}


class _EstimatorPlugin:
    @hookimpl
    def nexrl_advantage_estimators(self):
        return {"shift": _shift_estimator}

    @hookimpl
    def nexrl_policy_losses(self):
        return {"copy": _copy_loss}


class _AlgoTrainer(BaseTrainer):
    """A torch-free trainer that reads an estimator and a loss by name (as nexrl-grpo's does)."""

    ALGORITHM_OPTIONS = {"type": Option("grpo", str), "policy_loss": Option("copy", str),
                         "ppo_epochs": Option(1, int, ge=1)}
    ALGORITHM_SELECTORS = {"type": "advantage_estimator", "policy_loss": "policy_loss"}

    def train(self, trajectories):
        return {}


def _pm() -> PluginManager:
    pm = PluginManager(load_entrypoints=False)
    pm.register(_EstimatorPlugin(), name="shift", distribution="nexrl-shift")
    return pm


def test_plugin_estimator_is_selected_by_name_and_its_keys_are_declared():
    pm = _pm()
    keys, problems = al.algorithm_keys(_AlgoTrainer, {"type": "shift", "shift": 2.0}, pm)
    assert problems == []
    assert {k: o.default_value() for k, o in keys.items()} == {"type": "grpo", "policy_loss": "copy", "ppo_epochs": 1,
                                                              "shift": 1.0, "mode": "a"}
    assert keys["shift"].type is float  # typed by the annotation
    selection = al.select_algorithms(_AlgoTrainer, {"type": "shift", "shift": 2.0},
                                     al.AlgorithmRegistry.from_plugin_manager(pm))
    assert selection.functions["type"].distribution == "nexrl-shift"
    adv, _ = selection.bound("type")(inputs([[1.0, 0.0]], [[1, 0]], ["g"]))
    assert adv.tolist() == [[3.0, 0.0]]
    # grpo's keys are not read when the shift estimator is selected
    keys, _ = al.algorithm_keys(_AlgoTrainer, {"type": "shift"}, pm)
    assert "epsilon" not in keys
    with pytest.raises(ConfigError, match="algorithm.epsilon: unknown key"):
        al.select_algorithms(_AlgoTrainer, {"type": "shift", "epsilon": 0.1}, al.AlgorithmRegistry.from_plugin_manager(pm))


def test_unknown_estimator_gets_did_you_mean_and_listing():
    keys, problems = al.algorithm_keys(_AlgoTrainer, {"type": "grpp"}, _pm())
    assert len(problems) == 1
    assert problems[0].startswith("algorithm.type: unknown advantage estimator 'grpp'. Did you mean 'grpo'?")
    assert "'shift' (nexrl-shift)" in problems[0] and "'dr_grpo' (nexrl-core)" in problems[0]
    with pytest.raises(ConfigError, match="Did you mean 'copy'"):
        al.select_algorithms(_AlgoTrainer, {"policy_loss": "cpy"}, al.AlgorithmRegistry.from_plugin_manager(_pm()))


def _choosy(data: al.AdvantageInputs, *, direction: Literal["up", "down"] = "up"):
    return _shift_estimator(data, shift=1.0 if direction == "up" else -1.0)


def test_literal_annotations_are_checked_choices():
    class Choosy:
        @hookimpl
        def nexrl_advantage_estimators(self):
            return {"choosy": _choosy}

    pm = _pm()
    pm.register(Choosy(), name="choosy", distribution="nexrl-choosy")
    fn = al.AlgorithmRegistry.from_plugin_manager(pm).get("advantage_estimator", "choosy", "algorithm.type")
    assert fn.choices == {"direction": ("up", "down")}
    problems = check_algorithm({"type": "choosy", "direction": "dwon"}, _AlgoTrainer, pm)
    assert len(problems) == 1 and problems[0].startswith("algorithm.direction: ") and "'down'" in problems[0]
    assert check_algorithm({"type": "choosy", "direction": "down"}, _AlgoTrainer, pm) == []
    with pytest.raises(ConfigError, match="algorithm.direction"):
        al.select_algorithms(_AlgoTrainer, {"type": "choosy", "direction": "dwon"},
                             al.AlgorithmRegistry.from_plugin_manager(pm))


def test_two_distributions_registering_one_estimator_name_is_an_error_naming_both():
    class Twin:
        @hookimpl
        def nexrl_advantage_estimators(self):
            return {"shift": lambda data, *, shift=0.0: (data, data)}

    pm = _pm()
    pm.register(Twin(), name="twin", distribution="nexrl-twin")
    with pytest.raises(PluginError) as info:
        pm.functions("advantage_estimator")
    assert "nexrl-shift" in str(info.value) and "nexrl-twin" in str(info.value) and "'shift'" in str(info.value)


def test_bad_function_registrations_are_reported_and_skipped():
    class Bad:
        @hookimpl
        def nexrl_advantage_estimators(self):
            def needs_value(data, *, scale):  # an option without a default cannot be a recipe key
                return data, data
            return {"a_class": dict, "not_callable": 3, "no_default": needs_value}

    pm = PluginManager(load_entrypoints=False)
    pm.register(Bad(), name="bad", distribution="nexrl-bad")
    assert set(pm.functions("advantage_estimator")) == {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"}
    bad = "\n".join(pm.bad_registrations)
    assert "'a_class'" in bad and "'not_callable'" in bad and "not a function" in bad
    assert "'no_default'" in bad and "['scale'] have no default" in bad
    described = {p["name"]: p for p in pm.describe()}
    assert described["core.algorithms"]["components"] == {
        "advantage_estimator": ["dr_grpo", "gae", "grpo", "reinforce_plus_plus", "rloo"]}


def test_algorithms_import_without_torch():
    code = "import sys, nexrl_core.algorithms, nexrl_core.builtins.algorithms; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == 0
