"""rloo, reinforce_plus_plus and gae (nexrl_core.algorithms, torch-free) against plain-Python
formulas written out here (1e-6), on random rewards, values and masks with holes; their
invariants; and the registry's ``requires`` / ``recommended_defaults``."""

from __future__ import annotations

import math
from typing import Annotated

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core import Option, hookimpl
from nexrl_core import algorithms as al
from nexrl_core.errors import ConfigError
from nexrl_core.launch.recipe import check_algorithm
from nexrl_core.plugins import PluginManager
from nexrl_core.trainer import BaseTrainer

TOL = 1e-6
prop = settings(max_examples=60, deadline=None)
floats = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def token_batches(draw, min_rows=1, max_rows=6, max_len=6):
    """(rewards [B][T], values [B][T], mask [B][T], group ids [B]) as plain Python lists; masks may
    have holes inside a row (a multi-turn trajectory's tool output)."""
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    rewards = [[draw(floats) for _ in range(length)] for _ in range(rows)]
    values = [[draw(floats) for _ in range(length)] for _ in range(rows)]
    mask = [[draw(st.booleans()) for _ in range(length)] for _ in range(rows)]
    groups = [draw(st.sampled_from(["a", "b", 7])) for _ in range(rows)]
    return rewards, values, mask, groups


def f64(x):
    return np.asarray(x, dtype=np.float64)


def assert_close(array, expected):
    flat = np.asarray(array, dtype=np.float64).reshape(-1).tolist()
    exp = f64(expected).reshape(-1).tolist()
    assert len(flat) == len(exp)
    for a, b in zip(flat, exp):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (flat, exp)


def inputs(rewards, mask, groups, values=None):
    return al.AdvantageInputs(f64(rewards), f64(mask), groups, None if values is None else f64(values))


# ---------------------------------------------------------------- reference formulas


def ref_rloo(rewards, mask, groups):
    scores = [sum(r for r, m in zip(row, mrow) if m) for row, mrow in zip(rewards, mask)]
    out = []
    for i, s in enumerate(scores):
        others = [scores[j] for j in range(len(scores)) if groups[j] == groups[i] and j != i]
        a = s - sum(others) / len(others) if others else 0.0
        out.append([a if m else 0.0 for m in mask[i]])
    return out


def ref_whiten(rows, mask, eps):
    flat = [x for row, mrow in zip(rows, mask) for x, m in zip(row, mrow) if m]
    if not flat:
        return [[0.0] * len(r) for r in rows]
    mean = sum(flat) / len(flat)
    std = math.sqrt(sum((x - mean) ** 2 for x in flat) / (len(flat) - 1)) if len(flat) > 1 else 0.0
    return [[(x - mean) / (std + eps) if m else 0.0 for x, m in zip(row, mrow)] for row, mrow in zip(rows, mask)]


def ref_returns(rewards, mask, gamma):
    """G_t = sum over the row's valid tokens k >= t of gamma^(number of valid tokens between) r_k."""
    out = []
    for row, mrow in zip(rewards, mask):
        valid = [t for t, m in enumerate(mrow) if m]
        g = [0.0] * len(row)
        for pos, t in enumerate(valid):
            g[t] = sum(gamma ** (n) * row[k] for n, k in enumerate(valid[pos:]))
        out.append(g)
    return out


def ref_gae(rewards, values, mask, gamma, lam):
    advantages, returns = [], []
    for row, vrow, mrow in zip(rewards, values, mask):
        valid = [t for t, m in enumerate(mrow) if m]
        deltas = {}
        for pos, t in enumerate(valid):
            next_v = vrow[valid[pos + 1]] if pos + 1 < len(valid) else 0.0
            deltas[t] = row[t] + gamma * next_v - vrow[t]
        adv = [0.0] * len(row)
        for pos, t in enumerate(valid):
            adv[t] = sum((gamma * lam) ** n * deltas[k] for n, k in enumerate(valid[pos:]))
        advantages.append(adv)
        returns.append([adv[t] + vrow[t] if m else 0.0 for t, m in enumerate(mrow)])
    return advantages, returns


# ---------------------------------------------------------------- rloo


@prop
@given(token_batches())
def test_rloo_matches_reference(batch):
    rewards, _, mask, groups = batch
    adv, ret = al.rloo(inputs(rewards, mask, groups))
    assert_close(adv, ref_rloo(rewards, mask, groups))
    assert np.array_equal(adv, ret)


@prop
@given(token_batches(min_rows=2), st.data())
def test_rloo_baseline_excludes_the_sample(batch, data):
    """Changing row i's own reward moves its advantage one for one: its baseline does not see it
    (a group mean would move it by (n - 1) / n); each other member of the group moves by -1/(n-1)."""
    rewards, _, mask, groups = batch
    i = data.draw(st.integers(0, len(rewards) - 1))
    t = next((k for k, m in enumerate(mask[i]) if m), None)
    n = groups.count(groups[i])
    if t is None or n < 2:
        return
    before, _ = al.rloo(inputs(rewards, mask, groups))
    bumped = [list(r) for r in rewards]
    bumped[i][t] += 1.0
    after, _ = al.rloo(inputs(bumped, mask, groups))
    assert after[i, t] - before[i, t] == pytest.approx(1.0, abs=TOL)
    for j, g in enumerate(groups):
        valid = [k for k, m in enumerate(mask[j]) if m]
        if j != i and g == groups[i] and valid:
            assert after[j, valid[0]] - before[j, valid[0]] == pytest.approx(-1.0 / (n - 1), abs=TOL)


@prop
@given(token_batches(min_rows=2))
def test_rloo_advantages_sum_to_zero_per_group(batch):
    rewards, _, mask, groups = batch
    adv, _ = al.rloo(inputs(rewards, mask, groups))
    rows = [next((a for a, m in zip(arow, mrow) if m), 0.0) for arow, mrow in zip(adv.tolist(), mask)]
    for g in set(groups):
        members = [i for i, x in enumerate(groups) if x == g]
        if all(any(mask[i]) for i in members):
            assert abs(sum(rows[i] for i in members)) <= 1e-6 * max(1.0, len(members))


def test_rloo_is_a_scaled_group_centring():
    rewards = [[1.0], [0.0], [0.0], [1.0], [5.0]]
    adv, _ = al.rloo(inputs(rewards, [[1]] * 5, ["g", "g", "g", "g", "solo"]))
    dr, _ = al.dr_grpo(inputs(rewards, [[1]] * 5, ["g", "g", "g", "g", "solo"]))
    assert_close(adv, 4 / 3 * dr)  # n / (n - 1) times the group-centred score
    assert adv[4, 0] == 0.0  # a group of one has no baseline


# ---------------------------------------------------------------- reinforce_plus_plus


@prop
@given(token_batches(), st.sampled_from([1.0, 0.9]), st.sampled_from([1e-6, 0.1]))
def test_reinforce_plus_plus_matches_reference(batch, gamma, eps):
    rewards, _, mask, groups = batch
    adv, ret = al.reinforce_plus_plus(inputs(rewards, mask, groups), gamma=gamma, epsilon=eps)
    want_returns = ref_returns(rewards, mask, gamma)
    assert_close(ret, want_returns)
    assert_close(adv, ref_whiten(want_returns, mask, eps))


@prop
@given(token_batches(min_rows=2, max_len=4))
def test_reinforce_plus_plus_normalises_over_the_batch(batch):
    rewards, _, mask, groups = batch
    adv, _ = al.reinforce_plus_plus(inputs(rewards, mask, groups), epsilon=0.0)
    valid = np.array(mask, dtype=bool)
    if valid.sum() < 2 or np.ptp(adv[valid]) == 0:
        return
    assert adv[valid].mean() == pytest.approx(0.0, abs=1e-9)
    assert adv[valid].std(ddof=1) == pytest.approx(1.0, abs=1e-9)
    assert np.abs(adv[~valid]).max(initial=0.0) == 0.0


def test_reinforce_plus_plus_kl_penalty_makes_returns_token_level():
    """Outcome 1 on the last token, -beta*KL on each: the return of token t adds the penalties of
    the tokens from t on, so earlier tokens see lower returns (the penalty travels backwards)."""
    kl_rewards = np.array([[-0.1, -0.2, 1.0 - 0.3]])
    _, ret = al.reinforce_plus_plus(inputs(kl_rewards, [[1, 1, 1]], ["g"]))
    assert_close(ret, [[0.4, 0.5, 0.7]])
    assert al.reinforce_plus_plus.recommended_defaults == {"use_kl_in_reward": True}


# ---------------------------------------------------------------- gae


@prop
@given(token_batches(), st.sampled_from([1.0, 0.95]), st.sampled_from([1.0, 0.95, 0.0]),
       st.booleans())
def test_gae_matches_reference(batch, gamma, lam, whiten):
    rewards, values, mask, groups = batch
    adv, ret = al.gae(inputs(rewards, mask, groups, values), gamma=gamma, lam=lam, whiten_advantages=whiten,
                      epsilon=1e-6)
    want_adv, want_ret = ref_gae(rewards, values, mask, gamma, lam)
    assert_close(ret, want_ret)
    assert_close(adv, ref_whiten(want_adv, mask, 1e-6) if whiten else want_adv)


@prop
@given(token_batches())
def test_gae_with_lambda_one_is_the_return_minus_the_value(batch):
    rewards, values, mask, groups = batch
    adv, ret = al.gae(inputs(rewards, mask, groups, values), gamma=1.0, lam=1.0, whiten_advantages=False)
    returns = ref_returns(rewards, mask, 1.0)
    assert_close(ret, returns)  # R_t = A_t + V_t = the Monte-Carlo return
    assert_close(adv, [[g - v if m else 0.0 for g, v, m in zip(grow, vrow, mrow)]
                       for grow, vrow, mrow in zip(returns, values, mask)])


def test_gae_needs_values_and_declares_it():
    with pytest.raises(ValueError, match="gae needs the critic's values"):
        al.gae(inputs([[1.0]], [[1]], ["g"]))
    with pytest.raises(ValueError, match="shape"):
        al.gae(inputs([[1.0, 0.0]], [[1, 1]], ["g"], values=[[1.0]]))
    fn = al.AlgorithmFunction.create("advantage_estimator", "gae", al.gae, "nexrl-core")
    assert fn.requires == ("values",)
    assert fn.options == {"gamma": 1.0, "lam": 0.95, "whiten_advantages": True, "epsilon": 1e-6}


def test_masked_whiten_keeps_the_dtype_of_rewards():
    adv, _ = al.reinforce_plus_plus(al.AdvantageInputs(np.array([[1.0, 0.0], [0.0, 0.0]], dtype=np.float32),
                                                       np.ones((2, 2), dtype=np.float32), ["a", "b"]))
    assert adv.dtype == np.float32
    assert_close(al.masked_whiten(f64([[3.0]]), f64([[1.0]])), [[0.0]])  # one valid entry: no spread


# ---------------------------------------------------------------- registry: requires, recommended defaults


def _needs_values(data: al.AdvantageInputs, *, scale: float = 1.0):
    return data.values * scale, data.values


_needs_values.requires = ("values",)


def _recommends(data: al.AdvantageInputs):
    return data.token_level_rewards, data.token_level_rewards


_recommends.recommended_defaults = {"ppo_epochs": 3, "mode": "b"}


def _copy_loss(log_prob, old_log_prob, advantages, response_mask, context, *, mode: str = "a",
               bound: Annotated[float, Option(help="a bound", gt=1.0)] = 2.0,
               cap: Annotated[float, Option(ge=0.0)] = 1.0):
    """A loss for the tests.

    :param mode: which mode.
    :param bound: the docstring's help, replaced by the annotation's.
    :param cap: a cap, with its bound from the annotation
        and its help from these two lines.
    """
    return 0.0, {}


class _Plugin:
    @hookimpl
    def nexrl_advantage_estimators(self):
        return {"needs_values": _needs_values, "recommends": _recommends}

    @hookimpl
    def nexrl_policy_losses(self):
        return {"copy": _copy_loss}


class _NoCritic(BaseTrainer):
    ALGORITHM_OPTIONS = {"type": Option("grpo", str), "policy_loss": Option("copy", str),
                         "ppo_epochs": Option(1, int, ge=1)}
    ALGORITHM_SELECTORS = {"type": "advantage_estimator", "policy_loss": "policy_loss"}

    def train(self, trajectories):
        return {}


class _WithCritic(_NoCritic):
    ALGORITHM_INPUTS = {"values": {"critic_lr": Option(1e-5, float, gt=0)}}


def _pm() -> PluginManager:
    pm = PluginManager(load_entrypoints=False)
    pm.register(_Plugin(), name="estimators", distribution="nexrl-estimators")
    return pm


def test_an_estimator_needing_values_is_refused_by_a_trainer_without_a_critic():
    problems = check_algorithm({"type": "needs_values"}, _NoCritic, _pm())
    assert problems == ["algorithm.type: advantage estimator 'needs_values' needs values, which trainer "
                        "'_NoCritic' does not compute (it computes: nothing beyond rewards)"]
    with pytest.raises(ConfigError, match="needs values"):
        al.select_algorithms(_NoCritic, {"type": "gae"}, al.AlgorithmRegistry.from_plugin_manager(_pm()))


def test_the_critic_keys_are_accepted_only_with_an_estimator_that_needs_values():
    pm = _pm()
    assert check_algorithm({"type": "needs_values", "critic_lr": 0.1}, _WithCritic, pm) == []
    problems = check_algorithm({"type": "grpo", "critic_lr": 0.1}, _WithCritic, pm)
    assert len(problems) == 1 and problems[0].startswith("algorithm.critic_lr: unknown key")
    problems = check_algorithm({"type": "needs_values", "critic_lr": -1.0}, _WithCritic, pm)
    assert len(problems) == 1 and "algorithm.critic_lr" in problems[0]
    selection = al.select_algorithms(_WithCritic, {"type": "needs_values"}, al.AlgorithmRegistry.from_plugin_manager(pm))
    assert selection.requires("values") and selection.options["critic_lr"] == 1e-5
    assert not al.select_algorithms(_WithCritic, {}, al.AlgorithmRegistry.from_plugin_manager(pm)).requires("values")


def test_recommended_defaults_apply_to_the_trainers_and_the_losss_keys_unless_set():
    registry = al.AlgorithmRegistry.from_plugin_manager(_pm())
    selection = al.select_algorithms(_NoCritic, {"type": "recommends"}, registry)
    assert selection.options["ppo_epochs"] == 3 and selection.options["mode"] == "b"
    selection = al.select_algorithms(_NoCritic, {"type": "recommends", "ppo_epochs": 1, "mode": "a"}, registry)
    assert selection.options["ppo_epochs"] == 1 and selection.options["mode"] == "a"


def test_annotated_options_carry_bounds_and_help():
    registry = al.AlgorithmRegistry.from_plugin_manager(_pm())
    declared = registry.get("policy_loss", "copy", "algorithm.policy_loss").declared()
    assert declared["bound"].gt == 1.0 and declared["bound"].help == "a bound" and declared["bound"].default == 2.0
    # An annotation without help keeps the docstring's; a plain parameter takes the docstring's too.
    assert declared["cap"].ge == 0.0 and declared["cap"].type is float
    assert declared["cap"].help == "a cap, with its bound from the annotation and its help from these two lines."
    assert declared["mode"].help == "which mode." and declared["mode"].ge is None
    assert check_algorithm({"cap": -1.0}, _NoCritic, _pm())[0].startswith("algorithm.cap: ")
    problems = check_algorithm({"bound": 0.5}, _NoCritic, _pm())
    assert len(problems) == 1 and problems[0].startswith("algorithm.bound: ") and "> 1" in problems[0]
    assert check_algorithm({"bound": 1.5}, _NoCritic, _pm()) == []


def test_builtin_estimators_are_registered():
    names = al.AlgorithmRegistry.from_plugin_manager(PluginManager(load_entrypoints=False)).names(
        "advantage_estimator")
    assert {"grpo", "dr_grpo", "rloo", "reinforce_plus_plus", "gae"} <= set(names)
