"""nexrl-grpo's policy losses (torch) against plain-Python formulas written out here (1e-6), and
the core's KL estimators on torch tensors (the same function the numpy paths use)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core import algorithms
from nexrl_core.plugins import PluginManager
from nexrl_grpo import losses
from nexrl_grpo.losses import LossContext

TOL = 1e-6
prop = settings(max_examples=60, deadline=None)
floats = st.floats(min_value=-5.0, max_value=5.0, allow_nan=False, allow_infinity=False)


@st.composite
def token_batches(draw, min_rows=1, max_rows=6, max_len=6):
    rows = draw(st.integers(min_rows, max_rows))
    length = draw(st.integers(1, max_len))
    values = [[draw(floats) for _ in range(length)] for _ in range(rows)]
    mask = [[draw(st.booleans()) for _ in range(length)] for _ in range(rows)]
    return values, mask


def t64(x):
    return torch.tensor(x, dtype=torch.float64)


def ref_agg(values, mask, mode, max_len=None):
    rows = [(sum(v for v, m in zip(r, mr) if m), sum(mr)) for r, mr in zip(values, mask)]
    if mode == "token-mean":
        n = sum(c for _, c in rows)
        return sum(s for s, _ in rows) / max(n, 1)
    nonempty = [(s, c) for s, c in rows if c > 0]
    per_seq = {"seq-mean-token-mean": [s / c for s, c in nonempty], "seq-mean-token-sum": [s for s, _ in nonempty],
               "seq-mean-token-sum-norm": [s / max_len for s, _ in nonempty]}[mode]
    return sum(per_seq) / max(len(per_seq), 1)


@prop
@given(token_batches(), st.sampled_from(losses.LOSS_AGG_MODES))
def test_agg_loss_matches_reference(batch, mode):
    values, mask = batch
    out = losses.agg_loss(t64(values), torch.tensor(mask), mode, max_response_length=8)
    assert out.item() == pytest.approx(ref_agg(values, mask, mode, 8), abs=TOL)


@prop
@given(token_batches(min_rows=2), st.sampled_from(losses.LOSS_AGG_MODES), st.integers(1, 3))
def test_agg_loss_micro_batch_shares_sum_to_full_loss(batch, mode, mb):
    values, mask = batch
    v, m = t64(values), t64(mask)
    full = losses.agg_loss(v, m, mode, max_response_length=8)
    seqs, tokens = (m.sum(-1) > 0).sum().item(), m.sum().item()
    shares = sum(losses.agg_loss(v[i:i + mb], m[i:i + mb], mode, 8, batch_num_seqs=seqs, batch_num_tokens=tokens)
                 for i in range(0, len(values), mb))
    assert shares.item() == pytest.approx(full.item(), abs=TOL)


def test_agg_loss_modes_differ_as_expected_and_errors():
    loss = t64([[1.0, 0.0, 0.0, 0.0], [3.0, 3.0, 3.0, 0.0]])  # row 0: one token of 1; row 1: three of 3
    mask = t64([[1, 0, 0, 0], [1, 1, 1, 0]])
    assert losses.agg_loss(loss, mask, "seq-mean-token-mean").item() == pytest.approx((1 + 3) / 2)
    assert losses.agg_loss(loss, mask, "token-mean").item() == pytest.approx(10 / 4)
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum-norm", 4).item() == pytest.approx((1 / 4 + 9 / 4) / 2)
    assert losses.agg_loss(loss, mask, "seq-mean-token-sum").item() == pytest.approx((1 + 9) / 2)
    with pytest.raises(ValueError, match="seq-mean-token-mean"):
        losses.agg_loss(t64([[1.0]]), t64([[1.0]]), "sum")
    with pytest.raises(ValueError, match="max_response_length"):
        losses.agg_loss(t64([[1.0]]), t64([[1.0]]), "seq-mean-token-sum-norm")


def _ref_ppo(old, new, adv, mask, low, high, mode, weights=None):
    rows, clipped, kls = [], [], []
    for i, (orow, nrow, arow, mrow) in enumerate(zip(old, new, adv, mask)):
        lrow = []
        for j, (o, n, a, m) in enumerate(zip(orow, nrow, arow, mrow)):
            r = math.exp(n - o)
            l1, l2 = -a * r, -a * min(max(r, 1 - low), 1 + high)
            lrow.append(max(l1, l2) * (weights[i][j] if weights else 1.0))
            if m:
                clipped.append(1.0 if l2 > l1 else 0.0)
                kls.append(o - n)
        rows.append(lrow)
    n = max(len(kls), 1)
    return ref_agg(rows, mask, mode, 8), sum(clipped) / n, sum(kls) / n


@prop
@given(token_batches(), st.sampled_from(losses.LOSS_AGG_MODES), st.floats(0.05, 0.4), st.floats(0.05, 0.4),
       st.booleans())
def test_ppo_clip_matches_reference(batch, mode, low, high, weighted):
    values, mask = batch
    old = [[v * 0.1 for v in row] for row in values]
    new = [[v * 0.1 + 0.05 * ((i + j) % 5 - 2) for j, v in enumerate(row)] for i, row in enumerate(values)]
    adv = [[v - 0.3 for v in row] for row in values]
    weights = [[0.5 + ((i * 3 + j) % 4) * 0.5 for j in range(len(row))] for i, row in enumerate(values)] \
        if weighted else None
    context = LossContext(max_response_length=8, token_weights=t64(weights) if weighted else None)
    loss, metrics = losses.ppo_clip(t64(new), t64(old), t64(adv), t64(mask), context, clip_ratio_low=low,
                                    clip_ratio_high=high, loss_agg_mode=mode)
    want_loss, want_clip, want_kl = _ref_ppo(old, new, adv, mask, low, high, mode, weights)
    assert loss.item() == pytest.approx(want_loss, abs=TOL)
    assert metrics["pg_clipfrac"] == pytest.approx(want_clip, abs=TOL)
    assert metrics["ppo_kl"] == pytest.approx(want_kl, abs=TOL)


@prop
@given(token_batches(), st.sampled_from(losses.LOSS_AGG_MODES))
def test_ppo_clip_at_ratio_one_is_the_plain_policy_gradient(batch, mode):
    """On-policy (old = current, detached): the loss is -A aggregated, nothing is clipped, ppo_kl is 0,
    and the gradient is that of -A * logp."""
    values, mask = batch
    logp = t64([[-abs(v) - 0.1 for v in row] for row in values]).requires_grad_()
    adv = t64([[v * 0.7 for v in row] for row in values])
    loss, metrics = losses.ppo_clip(logp, logp.detach(), adv, t64(mask), LossContext(max_response_length=8),
                                    loss_agg_mode=mode)
    assert metrics["pg_clipfrac"] == 0.0 and metrics["ppo_kl"] == 0.0
    assert loss.item() == pytest.approx(ref_agg((-adv).tolist(), mask, mode, 8), abs=TOL)
    loss.backward()
    want = logp.detach().clone().requires_grad_()
    losses.agg_loss(-adv * want, t64(mask), mode, 8).backward()
    torch.testing.assert_close(logp.grad, want.grad)


def test_ppo_clip_gradient_is_zero_when_clipped_and_weights_carry_no_gradient():
    old = t64([[0.0, 0.0]])
    new = t64([[0.5, -0.5]]).requires_grad_()  # ratios e^0.5 > 1.2 and e^-0.5 < 0.8
    loss, metrics = losses.ppo_clip(new, old, t64([[1.0, -1.0]]), t64([[1, 1]]), LossContext())
    loss.backward()
    assert metrics["pg_clipfrac"] == 1.0 and new.grad.abs().max().item() == 0.0
    weights = t64([[2.0, 0.5]]).requires_grad_()
    logp = t64([[-1.0, -2.0]]).requires_grad_()
    loss, _ = losses.ppo_clip(logp, logp.detach(), t64([[1.0, 1.0]]), t64([[1, 1]]), LossContext(token_weights=weights))
    loss.backward()
    assert weights.grad is None
    torch.testing.assert_close(logp.grad, t64([[-1.0, -0.25]]))  # d/dlogp of -A w r, token mean of the row


@prop
@given(st.lists(st.tuples(floats, floats), min_size=1, max_size=8), st.sampled_from(sorted(algorithms.KL_KINDS)))
def test_core_kl_penalty_gives_the_same_numbers_on_torch_and_numpy(pairs, kind):
    logp, ref = [p for p, _ in pairs], [r for _, r in pairs]
    on_torch = algorithms.kl_penalty(t64(logp), t64(ref), kind)
    on_numpy = algorithms.kl_penalty(np.array(logp), np.array(ref), kind)
    assert isinstance(on_torch, torch.Tensor) and isinstance(on_numpy, np.ndarray)
    np.testing.assert_allclose(on_torch.numpy(), on_numpy, atol=1e-12)


def test_core_low_var_kl_on_torch_is_clamped_with_finite_gradient():
    logp = t64([0.0, 0.0]).requires_grad_()
    out = algorithms.kl_penalty(logp, t64([200.0, -200.0]), "low_var_kl")
    assert out.tolist() == [10.0, 10.0]
    out.sum().backward()
    assert torch.isfinite(logp.grad).all()


@prop
@given(token_batches())
def test_masked_mean_matches_reference(batch):
    values, mask = batch
    flat = [v for row, mrow in zip(values, mask) for v, m in zip(row, mrow) if m]
    assert losses.masked_mean(t64(values), torch.tensor(mask)).item() == pytest.approx(sum(flat) / max(len(flat), 1),
                                                                                       abs=TOL)


def test_ppo_clip_is_registered_with_its_options():
    pm = PluginManager()
    fn = algorithms.AlgorithmRegistry.from_plugin_manager(pm).get("policy_loss", "ppo_clip", "algorithm.policy_loss")
    assert fn.fn is losses.ppo_clip and fn.distribution == "nexrl-grpo"
    assert fn.options == {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2, "loss_agg_mode": "seq-mean-token-mean"}
    assert fn.choices == {"loss_agg_mode": losses.LOSS_AGG_MODES}
