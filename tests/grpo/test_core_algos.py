"""Property tests: every function against a plain-Python formula written out here."""

from __future__ import annotations

import math
import statistics

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_grpo import core_algos as ca

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


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def assert_close(tensor, expected):
    flat = tensor.reshape(-1).tolist()
    exp = torch.tensor(expected, dtype=torch.float64).reshape(-1).tolist()
    assert len(flat) == len(exp)
    for a, b in zip(flat, exp):
        assert abs(a - b) <= TOL * max(1.0, abs(b)), (flat, exp)


# ---------------------------------------------------------------- reference formulas


def ref_scores(values, mask):
    return [sum(v for v, m in zip(row, mrow) if m) for row, mrow in zip(values, mask)]


def ref_grpo(values, mask, groups, eps=1e-6, norm=True):
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


def ref_agg(values, mask, mode, max_len=None):
    rows = [(sum(v for v, m in zip(r, mr) if m), sum(mr)) for r, mr in zip(values, mask)]
    if mode == "token-mean":
        n = sum(c for _, c in rows)
        return sum(s for s, _ in rows) / max(n, 1)
    nonempty = [(s, c) for s, c in rows if c > 0]
    if mode == "seq-mean-token-mean":
        per_seq = [s / c for s, c in nonempty]
    else:
        per_seq = [s / max_len for s, _ in nonempty]
    return sum(per_seq) / max(len(per_seq), 1)


# ---------------------------------------------------------------- tests


@prop
@given(token_batches())
def test_scores_to_token_level_puts_score_on_last_valid_token(batch):
    values, mask, _ = batch
    scores = [row[0] for row in values]
    out = ca.scores_to_token_level(t64(scores), torch.tensor(mask))
    expected = []
    for s, mrow in zip(scores, mask):
        row = [0.0] * len(mrow)
        valid = [i for i, m in enumerate(mrow) if m]
        if valid:
            row[valid[-1]] = s
        expected.append(row)
    assert_close(out, expected)


@prop
@given(token_batches(), st.booleans())
def test_grpo_advantage_matches_reference(batch, norm):
    values, mask, groups = batch
    adv, ret = ca.compute_grpo_outcome_advantage(t64(values), t64(mask), groups, norm_adv_by_std=norm)
    assert_close(adv, ref_grpo(values, mask, groups, norm=norm))
    assert torch.equal(adv, ret)


def test_grpo_group_of_one_and_constant_group_get_zero():
    rewards = t64([[1.0, 0.0], [3.0, 0.0], [2.0, 0.0], [2.0, 0.0]])
    mask = t64([[1, 1], [1, 1], [1, 1], [1, 1]])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, ["solo", "pair", "same", "same"])
    assert adv.abs().max().item() == 0.0


def test_grpo_std_is_unbiased_everywhere():
    scores = t64([0.0, 1.0, 1.0, 4.0])
    mean, std, count = ca.compute_group_stats(scores, [0, 0, 0, 0])
    assert std[0].item() == pytest.approx(statistics.stdev([0.0, 1.0, 1.0, 4.0]), abs=1e-12)
    assert mean[0].item() == pytest.approx(1.5) and count[0].item() == 4
    adv = ca.compute_grpo_scalar_advantage(scores, [0, 0, 0, 0], epsilon=0.0)
    assert adv.std().item() == pytest.approx(1.0, abs=1e-12)


def test_grpo_masked_tokens_do_not_count():
    rewards = t64([[1.0, 100.0], [0.0, 100.0]])
    mask = t64([[1, 0], [1, 0]])
    adv, _ = ca.compute_grpo_outcome_advantage(rewards, mask, ["g", "g"])
    assert adv[:, 1].abs().max().item() == 0.0
    assert adv[0, 0].item() == pytest.approx(0.5 / math.sqrt(0.5), rel=1e-5)


def test_group_ids_length_checked():
    with pytest.raises(ValueError, match="group_ids"):
        ca.compute_grpo_scalar_advantage(t64([1.0, 2.0]), ["a"])


@prop
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=8), st.sampled_from(["kl", "abs", "mse", "low_var_kl", "k3"]))
def test_kl_penalty_matches_reference(pairs, kind):
    logp = [p for p, _ in pairs]
    ref = [r for _, r in pairs]
    out = ca.kl_penalty(t64(logp), t64(ref), kind)
    expected = []
    for a, b in zip(logp, ref):
        if kind == "kl":
            expected.append(a - b)
        elif kind == "abs":
            expected.append(abs(a - b))
        elif kind == "mse":
            expected.append(0.5 * (a - b) ** 2)
        else:
            kl = b - a
            expected.append(min(max(math.exp(kl) - kl - 1, -10.0), 10.0))
    assert_close(out, expected)


def test_low_var_kl_is_clamped_and_has_finite_gradient():
    logp = t64([0.0, 0.0]).requires_grad_()
    out = ca.kl_penalty(logp, t64([200.0, -200.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()


def test_unknown_kl_kind_names_valid_ones():
    with pytest.raises(ValueError, match="low_var_kl"):
        ca.kl_penalty(t64([0.0]), t64([0.0]), "full")


def test_adaptive_controller_moves_toward_target():
    ctrl = ca.AdaptiveKLController(init_kl_coef=0.1, target_kl=0.05, horizon=100)
    ctrl.update(current_kl=0.5, n_steps=10)  # KL far above target: error clipped at +0.2
    assert ctrl.value == pytest.approx(0.1 * (1 + 0.2 * 10 / 100))
    high = ctrl.value
    ctrl.update(current_kl=0.04, n_steps=10)  # below target: coefficient shrinks
    assert ctrl.value == pytest.approx(high * (1 + (0.04 / 0.05 - 1) * 10 / 100))
    ctrl.update(current_kl=0.05, n_steps=10)
    assert ctrl.value == pytest.approx(high * (1 + (0.04 / 0.05 - 1) * 10 / 100))


def test_get_kl_controller():
    fixed = ca.get_kl_controller({"type": "fixed", "kl_coef": 0.3})
    fixed.update(10.0, 5)
    assert isinstance(fixed, ca.FixedKLController) and fixed.value == 0.3
    adaptive = ca.get_kl_controller({"type": "adaptive", "kl_coef": 0.2, "target_kl": 1.0, "horizon": 50})
    assert isinstance(adaptive, ca.AdaptiveKLController) and adaptive.horizon == 50
    with pytest.raises(ValueError, match="kl_ctrl.type"):
        ca.get_kl_controller({"type": "pid"})


@prop
@given(token_batches(), st.floats(0.0, 1.0))
def test_apply_kl_penalty_matches_reference(batch, beta):
    values, mask, _ = batch
    ref_lp = [[v * 0.5 for v in row] for row in values]
    scores = [[1.0] * len(row) for row in values]
    rewards, metrics = ca.apply_kl_penalty(t64(scores), t64(values), t64(ref_lp), t64(mask), ca.FixedKLController(beta))
    expected, row_kls = [], []
    for srow, vrow, rrow, mrow in zip(scores, values, ref_lp, mask):
        kls = [(v - r) if m else 0.0 for v, r, m in zip(vrow, rrow, mrow)]
        expected.append([s - beta * k for s, k in zip(srow, kls)])
        row_kls.append(sum(kls) / max(sum(mrow), 1))
    assert_close(rewards, expected)
    assert metrics["kl_penalty"] == pytest.approx(sum(row_kls) / len(row_kls), abs=TOL)
    assert metrics["kl_coef"] == beta


@prop
@given(token_batches(), st.sampled_from(ca.LOSS_AGG_MODES))
def test_agg_loss_matches_reference(batch, mode):
    values, mask, _ = batch
    out = ca.agg_loss(t64(values), torch.tensor(mask), mode, max_response_length=8)
    assert out.item() == pytest.approx(ref_agg(values, mask, mode, 8), abs=TOL)


@prop
@given(token_batches(min_rows=2), st.sampled_from(ca.LOSS_AGG_MODES), st.integers(1, 3))
def test_agg_loss_micro_batch_shares_sum_to_full_loss(batch, mode, mb):
    values, mask, _ = batch
    v, m = t64(values), t64(mask)
    full = ca.agg_loss(v, m, mode, max_response_length=8)
    seqs = (m.sum(-1) > 0).sum().item()
    tokens = m.sum().item()
    shares = sum(
        ca.agg_loss(v[i : i + mb], m[i : i + mb], mode, 8, batch_num_seqs=seqs, batch_num_tokens=tokens)
        for i in range(0, len(values), mb)
    )
    assert shares.item() == pytest.approx(full.item(), abs=TOL)


def test_agg_loss_modes_differ_as_expected():
    # Row 0: one token of loss 1; row 1: three tokens of loss 3.
    loss = t64([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 0.0]])
    mask = t64([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert ca.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 3) / 2)
    assert ca.agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)  # long rows weigh more
    assert ca.agg_loss(loss, mask, "seq-mean-token-sum-norm", max_response_length=4).item() == pytest.approx((1 / 4 + 9 / 4) / 2)


def test_agg_loss_errors():
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        ca.agg_loss(t64([[1.0]]), t64([[1.0]]), "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        ca.agg_loss(t64([[1.0]]), t64([[1.0]]), "seq-mean-token-sum-norm")


@prop
@given(token_batches(), st.sampled_from(ca.LOSS_AGG_MODES), st.floats(0.05, 0.4), st.floats(0.05, 0.4))
def test_policy_loss_matches_reference(batch, mode, low, high):
    values, mask, _ = batch
    old = [[v * 0.1 for v in row] for row in values]
    new = [[v * 0.1 + 0.05 * ((i + j) % 5 - 2) for j, v in enumerate(row)] for i, row in enumerate(values)]
    adv = [[(v - 0.3) for v in row] for row in values]
    loss, metrics = ca.compute_policy_loss(t64(old), t64(new), t64(adv), t64(mask), low, high, mode, max_response_length=8)
    losses, clipped, kls = [], [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        lrow = []
        for o, n, a, m in zip(orow, nrow, arow, mrow):
            r = math.exp(n - o)
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            lrow.append(max(l1, l2))
            if m:
                clipped.append(1.0 if l2 > l1 else 0.0)
                kls.append(o - n)
        losses.append(lrow)
    assert loss.item() == pytest.approx(ref_agg(losses, mask, mode, 8), abs=TOL)
    n = max(len(kls), 1)
    assert metrics["pg_clipfrac"] == pytest.approx(sum(clipped) / n, abs=TOL)
    assert metrics["ppo_kl"] == pytest.approx(sum(kls) / n, abs=TOL)


def test_policy_loss_gradient_is_zero_when_clipped():
    old = t64([[0.0, 0.0]])
    new = t64([[0.5, -0.5]]).requires_grad_()  # ratios e^0.5 > 1.2 and e^-0.5 < 0.8
    loss, metrics = ca.compute_policy_loss(old, new, t64([[1.0, -1.0]]), t64([[1, 1]]))
    loss.backward()
    assert metrics["pg_clipfrac"] == 1.0
    assert new.grad.abs().max().item() == 0.0


@prop
@given(token_batches())
def test_masked_mean_matches_reference(batch):
    values, mask, _ = batch
    flat = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    assert ca.masked_mean(t64(values), torch.tensor(mask)).item() == pytest.approx(sum(flat) / max(len(flat), 1), abs=TOL)
