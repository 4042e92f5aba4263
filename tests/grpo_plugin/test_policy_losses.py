"""dual_clip, gspo, topr, the KL loss term and the critic's value loss against plain-Python formulas
written out here (1e-6), in every aggregation mode; their gradients against autograd of the
papers' objectives; on-policy invariants; micro-batch shares adding up to the batch loss."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from nexrl_core import algorithms
from nexrl_core.plugins import PluginManager
from nexrl_grpo import losses
from nexrl_grpo.losses import LossContext
from tests.grpo_plugin.test_losses import ref_agg, t64, token_batches

TOL = 1e-6
prop = settings(max_examples=60, deadline=None)
MODES = st.sampled_from(losses.LOSS_AGG_MODES)


def _logps(values):
    """(old, new, advantages) derived from a drawn batch: ratios around 1, advantages of both signs."""
    old = [[v * 0.1 - 1.0 for v in row] for row in values]
    new = [[o + 0.07 * ((i + 2 * j) % 7 - 3) for j, o in enumerate(row)] for i, row in enumerate(old)]
    adv = [[v - 0.3 for v in row] for row in values]
    return old, new, adv


def _row_adv(values):
    """One advantage per row (an outcome estimator's), of both signs."""
    return [[row[0] - 0.3] * len(row) for row in values]


def _clip(x, low, high):
    return min(max(x, low), high)


# ---------------------------------------------------------------- dual-clip


def ref_dual_clip(old, new, adv, mask, low, high, c, mode):
    rows, clipped, lower, kls = [], [], [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        lrow = []
        for o, n, a, m in zip(orow, nrow, arow, mrow):
            r = math.exp(n - o)
            l1, l2 = -a * r, -a * _clip(r, 1 - low, 1 + high)
            loss = max(l1, l2)
            dual = a < 0 and loss > -a * c
            lrow.append(-a * c if dual else loss)
            if m:
                clipped.append(float(l2 > l1))
                lower.append(float(dual))
                kls.append(o - n)
        rows.append(lrow)
    n = max(len(kls), 1)
    return ref_agg(rows, mask, mode, 8), sum(clipped) / n, sum(lower) / n, sum(kls) / n


@prop
@given(token_batches(), MODES, st.floats(0.05, 0.3), st.floats(0.05, 0.3), st.floats(1.05, 1.5))
def test_dual_clip_matches_reference(batch, mode, low, high, c):
    values, mask = batch
    old, new, adv = _logps(values)
    new = [[n + (0.6 if (i + j) % 3 == 0 else 0.0) for j, n in enumerate(row)] for i, row in enumerate(new)]
    loss, metrics = losses.dual_clip(t64(new), t64(old), t64(adv), t64(mask), LossContext(max_response_length=8),
                                     clip_ratio_low=low, clip_ratio_high=high, clip_ratio_c=c, loss_agg_mode=mode)
    want, clipfrac, lower, kl = ref_dual_clip(old, new, adv, mask, low, high, c, mode)
    assert loss.item() == pytest.approx(want, abs=TOL)
    assert metrics["pg_clipfrac"] == pytest.approx(clipfrac, abs=TOL)
    assert metrics["pg_clipfrac_lower"] == pytest.approx(lower, abs=TOL)
    assert metrics["ppo_kl"] == pytest.approx(kl, abs=TOL)


def test_dual_clip_bounds_a_negative_advantage_tokens_loss_and_its_gradient():
    old = t64([[0.0, 0.0, 0.0]])
    new = t64([[math.log(5.0), math.log(5.0), math.log(1.1)]]).requires_grad_()  # ratios 5, 5, 1.1
    adv = t64([[-1.0, 1.0, -1.0]])
    loss, metrics = losses.dual_clip(new, old, adv, t64([[1, 1, 1]]), LossContext(), clip_ratio_c=3.0,
                                     loss_agg_mode="token-mean")
    # token 0: min(max(5, 1.2), 3) = 3 (dual bound, no gradient); token 1: max(-5, -1.2) = -1.2 (clipped);
    # token 2: max(1.1, 1.1) = 1.1 (inside the range, gradient -A r = 1.1)
    assert loss.item() == pytest.approx((3.0 - 1.2 + 1.1) / 3)
    loss.backward()
    torch.testing.assert_close(new.grad, t64([[0.0, 0.0, 1.1 / 3]]))
    assert metrics["pg_clipfrac_lower"] == pytest.approx(1 / 3)
    ppo, _ = losses.ppo_clip(new.detach(), old, adv, t64([[1, 1, 1]]), LossContext(), loss_agg_mode="token-mean")
    assert ppo.item() == pytest.approx((5.0 - 1.2 + 1.1) / 3)  # plain PPO does not bound token 0


# ---------------------------------------------------------------- GSPO


def ref_gspo(old, new, adv, mask, low, high, mode):
    rows, clipped, kls = [], [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        diffs = [n - o for o, n, m in zip(orow, nrow, mrow) if m]
        s = math.exp(sum(diffs) / len(diffs)) if diffs else 1.0
        lrow = []
        for o, n, a, m in zip(orow, nrow, arow, mrow):
            l1, l2 = -a * s, -a * _clip(s, 1 - low, 1 + high)
            lrow.append(max(l1, l2))
            if m:
                clipped.append(float(l2 > l1))
                kls.append(o - n)
        rows.append(lrow)
    n = max(len(kls), 1)
    return ref_agg(rows, mask, mode, 8), sum(clipped) / n, sum(kls) / n


@prop
@given(token_batches(), MODES, st.sampled_from([(3e-4, 4e-4), (0.02, 0.05), (0.2, 0.2)]), st.booleans())
def test_gspo_matches_reference(batch, mode, clip, per_row):
    values, mask = batch
    old, new, adv = _logps(values)
    if per_row:
        adv = _row_adv(values)
    low, high = clip
    loss, metrics = losses.gspo(t64(new), t64(old), t64(adv), t64(mask), LossContext(max_response_length=8),
                                clip_ratio_low=low, clip_ratio_high=high, loss_agg_mode=mode)
    want, clipfrac, kl = ref_gspo(old, new, adv, mask, low, high, mode)
    assert loss.item() == pytest.approx(want, abs=TOL)
    assert metrics["pg_clipfrac"] == pytest.approx(clipfrac, abs=TOL)
    assert metrics["ppo_kl"] == pytest.approx(kl, abs=TOL)


@prop
@given(token_batches(), st.sampled_from([(3e-4, 4e-4), (0.05, 0.08)]))
def test_gspo_gradient_is_that_of_the_sequence_objective(batch, clip):
    """With one advantage per row and seq-mean-token-mean, the token form's gradient equals the
    gradient of the paper's -mean_i min(s_i A_i, clip(s_i) A_i), s_i a function of the whole row."""
    values, mask = batch
    old, new, _ = _logps(values)
    adv = _row_adv(values)
    low, high = clip
    logp = t64(new).requires_grad_()
    loss, _ = losses.gspo(logp, t64(old), t64(adv), t64(mask), LossContext(), clip_ratio_low=low,
                          clip_ratio_high=high)
    loss.backward()
    ref = t64(new).requires_grad_()
    terms = []
    for i, mrow in enumerate(mask):
        valid = [j for j, m in enumerate(mrow) if m]
        if not valid:
            continue
        s = torch.exp(sum(ref[i, j] - old[i][j] for j in valid) / len(valid))
        a = adv[i][0]
        terms.append(-torch.minimum(s * a, torch.clamp(s, 1 - low, 1 + high) * a))
    if not terms:
        return
    (sum(terms) / len(terms)).backward()
    torch.testing.assert_close(logp.grad, ref.grad, atol=1e-9, rtol=1e-7)


# ---------------------------------------------------------------- TOPR


def ref_topr(old, new, adv, mask, mode):
    rows, weights = [], []
    for orow, nrow, arow, mrow in zip(old, new, adv, mask):
        rho = math.exp(sum(n - o for o, n, m in zip(orow, nrow, mrow) if m))
        lrow = []
        for _o, n, a, m in zip(orow, nrow, arow, mrow):
            w = 1.0 if a >= 0 else min(rho, 1.0)
            lrow.append(-a * w * n)
            if m and a < 0:
                weights.append(w)
        rows.append(lrow)
    return ref_agg(rows, mask, mode, 8), (sum(weights) / len(weights) if weights else 1.0), rows


@prop
@given(token_batches(), MODES)
def test_topr_matches_reference_and_its_weights_carry_no_gradient(batch, mode):
    values, mask = batch
    old, new, adv = _logps(values)
    logp = t64(new).requires_grad_()
    loss, metrics = losses.topr(logp, t64(old), t64(adv), t64(mask), LossContext(max_response_length=8),
                                loss_agg_mode=mode)
    want, weight_mean, _ = ref_topr(old, new, adv, mask, mode)
    assert loss.item() == pytest.approx(want, abs=TOL)
    assert metrics["topr_negative_weight_mean"] == pytest.approx(weight_mean, abs=TOL)
    loss.backward()
    # d/dlogp of -A w logp with w a constant: -A w, spread by the aggregation's weights.
    constant = [[(-a * (1.0 if a >= 0 else min(math.exp(sum(n - o for o, n, m in zip(orow, nrow, mrow) if m)), 1.0)))
                 for a in arow] for orow, nrow, arow, mrow in zip(old, new, adv, mask)]
    ref = t64(new).requires_grad_()
    losses.agg_loss(t64(constant) * ref, t64(mask), mode, 8).backward()
    torch.testing.assert_close(logp.grad, ref.grad, atol=1e-9, rtol=1e-7)


def test_topr_keeps_positive_samples_and_tapers_negative_ones():
    old = t64([[-1.0, -1.0], [-1.0, -1.0]])
    new = t64([[-2.0, -2.0], [-2.0, -2.0]]).requires_grad_()  # both rows: rho = e^-2
    adv = t64([[1.0, 1.0], [-1.0, -1.0]])
    loss, metrics = losses.topr(new, old, adv, t64([[1, 1], [1, 1]]), LossContext(), loss_agg_mode="token-mean")
    loss.backward()
    rho = math.exp(-2.0)
    torch.testing.assert_close(new.grad, t64([[-0.25, -0.25], [0.25 * rho, 0.25 * rho]]))
    assert metrics["topr_negative_weight_mean"] == pytest.approx(rho)
    # A ratio above 1 is truncated to 1 for negative samples.
    up = t64([[0.0, 0.0]]).requires_grad_()
    loss, metrics = losses.topr(up, t64([[-1.0, -1.0]]), t64([[-1.0, -1.0]]), t64([[1, 1]]), LossContext())
    assert metrics["topr_negative_weight_mean"] == 1.0


# ---------------------------------------------------------------- on-policy invariants


@prop
@given(token_batches(), MODES, st.sampled_from(["ppo_clip", "dual_clip", "gspo", "topr"]))
def test_every_loss_is_the_plain_policy_gradient_on_policy(batch, mode, name):
    """Old log-probs = current ones: each loss's gradient is that of -A logp aggregated, and the
    ratio losses read no clipping and no KL."""
    values, mask = batch
    logp = t64([[-abs(v) - 0.1 for v in row] for row in values]).requires_grad_()
    adv = t64([[v * 0.7 for v in row] for row in values])
    loss, metrics = losses.POLICY_LOSSES[name](logp, logp.detach(), adv, t64(mask),
                                               LossContext(max_response_length=8), loss_agg_mode=mode)
    assert metrics["ppo_kl"] == 0.0
    if name != "topr":
        assert metrics["pg_clipfrac"] == 0.0
        assert loss.item() == pytest.approx(ref_agg((-adv).tolist(), mask, mode, 8), abs=TOL)
    loss.backward()
    want = logp.detach().clone().requires_grad_()
    losses.agg_loss(-adv * want, t64(mask), mode, 8).backward()
    torch.testing.assert_close(logp.grad, want.grad)


@prop
@given(token_batches(min_rows=2), MODES, st.integers(1, 3), st.sampled_from(["ppo_clip", "dual_clip", "gspo", "topr"]))
def test_micro_batch_shares_add_up_to_the_batch_loss(batch, mode, size, name):
    values, mask = batch
    old, new, adv = _logps(values)
    fn = losses.POLICY_LOSSES[name]
    o, n, a, m = t64(old), t64(new), t64(adv), t64(mask)
    full, _ = fn(n, o, a, m, LossContext(max_response_length=8), loss_agg_mode=mode)
    context = LossContext(batch_num_seqs=float((m.sum(-1) > 0).sum()), batch_num_tokens=float(m.sum()),
                          max_response_length=8)
    shares = sum(fn(n[i:i + size], o[i:i + size], a[i:i + size], m[i:i + size], context, loss_agg_mode=mode)[0]
                 for i in range(0, len(values), size))
    assert float(shares) == pytest.approx(full.item(), abs=TOL)


# ---------------------------------------------------------------- KL loss term and value loss


def ref_kl(a, b, kind):
    d = a - b
    return {"k1": d, "abs": abs(d), "k2": 0.5 * d * d,
            "k3": _clip(math.exp(_clip(-d, -20, 20)) - _clip(-d, -20, 20) - 1, -10, 10)}[algorithms.KL_KINDS[kind]]


@prop
@given(token_batches(), MODES, st.sampled_from(sorted(algorithms.KL_KINDS)))
def test_kl_loss_matches_reference(batch, mode, kind):
    values, mask = batch
    _, new, _ = _logps(values)
    ref = [[v * 0.05 - 1.0 for v in row] for row in values]
    share, token_mean = losses.kl_loss(t64(new), t64(ref), t64(mask), LossContext(max_response_length=8), kind, mode)
    kl = [[ref_kl(n, r, kind) for n, r in zip(nrow, rrow)] for nrow, rrow in zip(new, ref)]
    assert share.item() == pytest.approx(ref_agg(kl, mask, mode, 8), abs=TOL)
    assert token_mean == pytest.approx(ref_agg(kl, mask, "token-mean"), abs=TOL)


def test_kl_loss_pulls_towards_the_reference():
    logp = t64([[-1.0, -2.0]]).requires_grad_()
    share, _ = losses.kl_loss(logp, t64([[-1.5, -1.5]]), t64([[1, 1]]), LossContext(), "k2", "token-mean")
    share.backward()
    torch.testing.assert_close(logp.grad, t64([[0.25, -0.25]]))  # d/dx of (x - ref)^2 / 4


def ref_value_loss(values, old, returns, mask, clip, mode):
    rows, clipped = [], []
    for vrow, orow, rrow, mrow in zip(values, old, returns, mask):
        lrow = []
        for v, o, r, m in zip(vrow, orow, rrow, mrow):
            unclipped = (v - r) ** 2
            if clip is None:
                lrow.append(0.5 * unclipped)
                is_clipped = False
            else:
                vc = o + _clip(v - o, -clip, clip)
                lrow.append(0.5 * max(unclipped, (vc - r) ** 2))
                is_clipped = (vc - r) ** 2 > unclipped
            if m:
                clipped.append(float(is_clipped))
        rows.append(lrow)
    return ref_agg(rows, mask, mode, 8), ref_agg(rows, mask, "token-mean"), sum(clipped) / max(len(clipped), 1)


@prop
@given(token_batches(), MODES, st.sampled_from([None, 0.2, 1.0]))
def test_value_loss_matches_reference(batch, mode, clip):
    values, mask = batch
    old = [[v * 0.5 + 0.1 for v in row] for row in values]
    returns = [[v * 0.3 - 0.2 * j for j, v in enumerate(row)] for row in values]
    loss, metrics = losses.value_loss(t64(values), t64(old), t64(returns), t64(mask),
                                      LossContext(max_response_length=8), clip, mode)
    want, token_mean, clipfrac = ref_value_loss(values, old, returns, mask, clip, mode)
    assert loss.item() == pytest.approx(want, abs=TOL)
    assert metrics["vf_loss"] == pytest.approx(token_mean, abs=TOL)
    assert metrics["vf_clipfrac"] == pytest.approx(clipfrac, abs=TOL)


def test_the_registered_losses_are_those_of_the_losses_module():
    """nexrl-grpo registers its losses by path (torch is imported when a recipe selects one): the
    names and functions are losses.POLICY_LOSSES'."""
    registry = algorithms.AlgorithmRegistry.from_plugin_manager(PluginManager())
    grpo = [n for n in registry.names("policy_loss") if registry.get("policy_loss", n, "x").distribution == "nexrl-grpo"]
    assert grpo == sorted(losses.POLICY_LOSSES)
    assert all(registry.get("policy_loss", n, "x").fn is losses.POLICY_LOSSES[n] for n in grpo)


def test_new_losses_are_registered_with_their_options():
    registry = algorithms.AlgorithmRegistry.from_plugin_manager(PluginManager())
    assert {"ppo_clip", "dual_clip", "gspo", "topr"} <= set(registry.names("policy_loss"))
    dual = registry.get("policy_loss", "dual_clip", "algorithm.policy_loss")
    assert dual.distribution == "nexrl-grpo" and dual.declared()["clip_ratio_c"].gt == 1.0
    # Every key of every built-in estimator and loss has its help (the recipe reference shows it).
    for kind in ("advantage_estimator", "policy_loss"):
        for name in registry.names(kind):
            fn = registry.get(kind, name, "x")
            if fn.distribution in ("nexrl-core", "nexrl-grpo"):
                assert all(opt.help for opt in fn.declared().values()), (kind, name, fn.declared())
    assert registry.get("policy_loss", "gspo", "x").options == {
        "clip_ratio_low": 3e-4, "clip_ratio_high": 4e-4, "loss_agg_mode": "seq-mean-token-mean"}
    assert registry.get("policy_loss", "topr", "x").options == {"loss_agg_mode": "seq-mean-token-mean"}
