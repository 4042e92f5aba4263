"""Policy losses on torch tensors (they need autograd), registered in nexrl-core's algorithm
registry through ``nexrl_policy_losses`` and selected with ``algorithm.policy_loss``.

Shapes: ``B`` rows of one micro-batch, ``T`` response tokens; ``response_mask`` is 1 on tokens
that count. A loss returns this micro-batch's *share* of the whole batch's loss (the shares of a
batch's micro-batches add up to its loss, see :class:`LossContext`) and its metrics. The rest of
the RL math (advantages, KL estimators, rollout correction) is torch-free, in
:mod:`nexrl_core.algorithms`; the KL loss term calls its estimator on tensors.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Literal, get_args

import torch

from nexrl_core import Option, algorithms

LossAggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)
# The log-ratio is clamped before exp(): finite ratios (and gradients) for wildly off-policy tokens.
MAX_LOG_RATIO = 20.0


@dataclass
class LossContext:
    """What a loss needs besides the micro-batch's tensors.

    :ivar batch_num_seqs: rows of the whole batch with a valid token (None: this micro-batch's).
    :ivar batch_num_tokens: valid tokens of the whole batch (None: this micro-batch's).
    :ivar max_response_length: the constant normaliser of ``seq-mean-token-sum-norm``.
    :ivar token_weights: ``[B, T]`` constant per-token weights multiplied into the per-token
        policy-gradient loss (the rollout correction's importance weights), or None.
    """

    batch_num_seqs: float | None = None
    batch_num_tokens: float | None = None
    max_response_length: int | None = None
    token_weights: torch.Tensor | None = None


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when nothing is set)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def agg_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    mode: str,
    max_response_length: int | None = None,
    batch_num_seqs: float | None = None,
    batch_num_tokens: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss ``[B, T]`` to a scalar.

    - ``seq-mean-token-mean`` (GRPO): token mean per sequence, then mean over sequences.
    - ``token-mean`` (DAPO): sum over all valid tokens / number of valid tokens.
    - ``seq-mean-token-sum``: token sum per sequence, then mean over sequences.
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): token sum / ``max_response_length`` (a constant),
      mean over sequences.

    Sequence means count only rows with at least one valid token. When ``loss_mat`` is one
    micro-batch of a larger batch, pass that batch's ``batch_num_seqs`` (rows with a valid token)
    and ``batch_num_tokens``: the result is then this micro-batch's share, and the shares sum
    exactly to the loss of the whole batch.
    """
    mask = loss_mask.to(loss_mat.dtype)
    if mode == "token-mean":
        denom = mask.sum() if batch_num_tokens is None else torch.as_tensor(batch_num_tokens, dtype=loss_mat.dtype)
        return (loss_mat * mask).sum() / denom.clamp(min=1)
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode {mode!r} is unknown; valid modes: {list(LOSS_AGG_MODES)}")
    token_counts = mask.sum(dim=-1)
    token_sums = (loss_mat * mask).sum(dim=-1)
    if mode == "seq-mean-token-mean":
        seq_losses = token_sums / token_counts.clamp(min=1)
    elif mode == "seq-mean-token-sum":
        seq_losses = token_sums
    else:
        if not max_response_length:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_length (a fixed normaliser)")
        seq_losses = token_sums / max_response_length
    seqs = (token_counts > 0).sum() if batch_num_seqs is None else torch.as_tensor(batch_num_seqs, dtype=loss_mat.dtype)
    return seq_losses.sum() / seqs.to(loss_mat.dtype).clamp(min=1)


def _aggregate(per_token: torch.Tensor, response_mask: torch.Tensor, context: LossContext, mode: str) -> torch.Tensor:
    """The rollout correction's constant weights, then this micro-batch's share of the batch loss."""
    if context.token_weights is not None:
        per_token = per_token * context.token_weights.detach().to(per_token.dtype)
    return agg_loss(per_token, response_mask, mode, context.max_response_length, context.batch_num_seqs,
                    context.batch_num_tokens)


def _clipped_surrogate(ratio: torch.Tensor, advantages: torch.Tensor, low: float, high: float
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """``max(-A r, -A clip(r, 1 - low, 1 + high))`` per token, and where the clipped branch wins."""
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - low, 1.0 + high)
    return torch.maximum(unclipped, clipped), clipped > unclipped


def _ppo_metrics(log_ratio: torch.Tensor, clipped: torch.Tensor, response_mask: torch.Tensor) -> dict[str, float]:
    with torch.no_grad():
        return {"pg_clipfrac": masked_mean(clipped.to(log_ratio.dtype), response_mask).item(),
                "ppo_kl": masked_mean(-log_ratio, response_mask).item()}


def ppo_clip(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347), with separate low/high
    clip ranges (DAPO's clip-higher, arXiv:2503.14476). Per token, with ``r = exp(logp - logp_old)``::

        L_t = max(-A_t r_t, -A_t clip(r_t, 1 - clip_ratio_low, 1 + clip_ratio_high)) * w_t

    (``w_t``: the rollout correction's weight, 1 without it), aggregated by ``loss_agg_mode``.

    Metrics: ``pg_clipfrac`` (share of valid tokens where the clipped branch is active) and
    ``ppo_kl`` (token mean of ``logp_old - logp``). On-policy (``logp_old`` is ``logp``
    detached) the ratio is exactly 1: both are 0 and the gradient is ``-A grad logp``.

    :param clip_ratio_low: lower clip range (the ratio is kept above ``1 - clip_ratio_low``).
    :param clip_ratio_high: upper clip range (the ratio is kept below ``1 + clip_ratio_high``).
    :param loss_agg_mode: how per-token losses reduce to the batch loss (:func:`agg_loss`).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    pg_losses, clipped = _clipped_surrogate(log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high)
    loss = _aggregate(pg_losses, response_mask, context, loss_agg_mode)
    return loss, _ppo_metrics(log_ratio, clipped, response_mask)


def dual_clip(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    *,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    clip_ratio_c: Annotated[float, Option(gt=1.0)] = 3.0,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """Dual-clip PPO (Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    Reinforcement Learning", arXiv:1912.09729): :func:`ppo_clip`, whose loss on a token with a
    negative advantage is also bounded, so one very off-policy token cannot dominate::

        L_t = max(-A r, -A clip(r, 1 - clip_ratio_low, 1 + clip_ratio_high))   A_t >= 0
        L_t = min(that, -A_t * clip_ratio_c)                                     A_t < 0

    times the rollout correction's weight, aggregated by ``loss_agg_mode``. The bound only
    matters when the ratio exceeds ``clip_ratio_c`` (> 1), so on-policy it is plain PPO.

    Metrics: those of :func:`ppo_clip` and ``pg_clipfrac_lower`` (share of valid tokens where
    the dual bound is active).

    :param clip_ratio_low: lower clip range (the ratio is kept above ``1 - clip_ratio_low``).
    :param clip_ratio_high: upper clip range (the ratio is kept below ``1 + clip_ratio_high``).
    :param clip_ratio_c: dual-clip bound: a negative-advantage token's loss is at most
        ``-A * clip_ratio_c``.
    :param loss_agg_mode: how per-token losses reduce to the batch loss (:func:`agg_loss`).
    """
    log_ratio = (log_prob - old_log_prob).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    pg_losses, clipped = _clipped_surrogate(log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high)
    bound = -advantages * clip_ratio_c
    dual = (advantages < 0) & (pg_losses > bound)
    pg_losses = torch.where(dual, bound, pg_losses)
    loss = _aggregate(pg_losses, response_mask, context, loss_agg_mode)
    metrics = _ppo_metrics(log_ratio, clipped, response_mask)
    metrics["pg_clipfrac_lower"] = masked_mean(dual.to(log_ratio.dtype), response_mask).item()
    return loss, metrics


def _sequence_log_ratio(log_prob: torch.Tensor, old_log_prob: torch.Tensor, response_mask: torch.Tensor,
                        mean: bool) -> torch.Tensor:
    """Per row ``[B, 1]``: the sum (or mean) over valid tokens of ``logp - logp_old``."""
    mask = response_mask.to(log_prob.dtype)
    total = ((log_prob - old_log_prob) * mask).sum(-1, keepdim=True)
    return total / mask.sum(-1, keepdim=True).clamp(min=1) if mean else total


def gspo(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    *,
    clip_ratio_low: float = 3e-4,
    clip_ratio_high: float = 4e-4,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """GSPO (Zheng et al. 2025, "Group Sequence Policy Optimization", arXiv:2507.18071): PPO's
    clipping on a *sequence-level* ratio, the geometric mean of the row's token ratios::

        s_i  = exp(mean_{t valid} (logp_it - logp_old_it))
        s_it = sg[s_i] * exp(logp_it - sg[logp_it])       (value s_i; gradient s_i * grad logp_it)
        L_t  = max(-A_t s_it, -A_t clip(s_it, 1 - clip_ratio_low, 1 + clip_ratio_high))

    (``sg``: stop-gradient; GSPO-token form), times the rollout correction's weight, aggregated
    by ``loss_agg_mode``. With ``seq-mean-token-mean`` (the default) and one advantage per row
    this is exactly the paper's sequence objective ``min(s_i A_i, clip(s_i) A_i)``, averaged
    over rows. The clip ranges are the paper's (a sequence ratio moves far less than a token's).

    Metrics: ``pg_clipfrac`` (share of valid tokens whose row is clipped) and ``ppo_kl``.

    :param clip_ratio_low: lower clip range of the sequence ratio (the paper's 3e-4).
    :param clip_ratio_high: upper clip range of the sequence ratio (the paper's 4e-4).
    :param loss_agg_mode: how per-token losses reduce to the batch loss (:func:`agg_loss`).
    """
    seq_log_ratio = _sequence_log_ratio(log_prob, old_log_prob, response_mask, mean=True)
    log_ratio = (seq_log_ratio.detach() + log_prob - log_prob.detach()).clamp(-MAX_LOG_RATIO, MAX_LOG_RATIO)
    pg_losses, clipped = _clipped_surrogate(log_ratio.exp(), advantages, clip_ratio_low, clip_ratio_high)
    loss = _aggregate(pg_losses, response_mask, context, loss_agg_mode)
    return loss, _ppo_metrics((log_prob - old_log_prob).detach(), clipped, response_mask)


def topr(
    log_prob: torch.Tensor,
    old_log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    *,
    loss_agg_mode: LossAggMode = "seq-mean-token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """TOPR, Tapered Off-Policy REINFORCE (Le Roux et al. 2025, arXiv:2503.14286): no ratio on
    what went well, a ratio truncated to ``[0, 1]`` on what went badly. With the trajectory's
    ratio ``rho_i = pi(y_i) / pi_old(y_i) = exp(sum_{t valid} (logp_it - logp_old_it))``::

        L_t = -A_t logp_t                          A_t >= 0   (supervised on good samples)
        L_t = -A_t sg[min(rho_i, 1)] logp_t        A_t < 0    (truncated IS on bad ones)

    times the rollout correction's weight, aggregated by ``loss_agg_mode``. On-policy
    (``rho = 1``) it is plain REINFORCE, ``-A grad logp``; off-policy, negative samples that
    the current policy already made unlikely stop pushing, and positive ones never vanish.

    Metrics: ``topr_negative_weight_mean`` (mean truncated ratio over valid tokens with a
    negative advantage; 1 when there is none) and ``ppo_kl``.

    :param loss_agg_mode: how per-token losses reduce to the batch loss (:func:`agg_loss`).
    """
    seq_log_ratio = _sequence_log_ratio(log_prob, old_log_prob, response_mask, mean=False).detach()
    truncated = seq_log_ratio.clamp(max=0.0).exp()  # min(rho, 1), without overflowing exp()
    negative = advantages < 0
    weights = torch.where(negative, truncated.expand_as(advantages), torch.ones_like(advantages))
    pg_losses = -advantages * weights * log_prob
    loss = _aggregate(pg_losses, response_mask, context, loss_agg_mode)
    with torch.no_grad():
        negative_mask = negative.to(response_mask.dtype) * response_mask
        metrics = {
            "topr_negative_weight_mean": masked_mean(weights, negative_mask).item() if negative_mask.any() else 1.0,
            "ppo_kl": masked_mean(old_log_prob - log_prob, response_mask).item(),
        }
    return loss, metrics


def behaviour_weights(proximal_log_prob: torch.Tensor, behaviour_log_prob: torch.Tensor, response_mask: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, dict[str, float]]:
    """The behaviour importance weight of decoupled PPO (``algorithm.objective: decoupled``; Fu et
    al. 2025, "AReaL", arXiv:2505.24298): per valid token, with ``logp_prox`` the proximal policy's
    log-prob (the weights the step started from) and ``logp_behav`` the log-prob the sampler
    reported under the weights that drew the token (tokens of one sample may come from several)::

        w_t = min(pi_prox(y_t) / pi_behav(y_t), cap) = min(exp(logp_prox - logp_behav), cap)

    and 0 on masked tokens, computed in float64 (:func:`nexrl_core.algorithms.truncated_is_weights`)
    and returned as a constant (no gradient) in ``proximal_log_prob``'s dtype and device, for
    :attr:`LossContext.token_weights`.

    Metrics: ``behav_imp_weight_mean`` and ``behav_imp_weight_max`` over valid tokens, and
    ``behav_imp_weight_capped_frac`` (share of valid tokens whose ratio exceeded ``cap``).
    """
    mask = response_mask.detach().cpu().numpy()
    weights, is_metrics = algorithms.truncated_is_weights(proximal_log_prob.detach().cpu().numpy(),
                                                          behaviour_log_prob.detach().cpu().numpy(), mask, cap)
    valid = mask.astype(bool)
    metrics = {"behav_imp_weight_mean": is_metrics["rollout_is_weight_mean"],
               "behav_imp_weight_max": float(weights[valid].max()) if valid.any() else 0.0,
               "behav_imp_weight_capped_frac": is_metrics["rollout_is_capped_frac"]}
    return torch.from_numpy(weights).to(device=proximal_log_prob.device, dtype=proximal_log_prob.dtype), metrics


def kl_loss(log_prob: torch.Tensor, ref_log_prob: torch.Tensor, response_mask: torch.Tensor, context: LossContext,
            kind: str, loss_agg_mode: str) -> tuple[torch.Tensor, float]:
    """KL to the reference policy as a loss term (GRPO's, Shao et al. 2024): the core's per-token
    estimator ``kind`` (:func:`nexrl_core.algorithms.kl_penalty`, gradients flow through
    ``log_prob``), aggregated like the policy loss. Returns (this micro-batch's share, its token
    mean for the metrics)."""
    kld = algorithms.kl_penalty(log_prob, ref_log_prob.detach(), kind)
    share = agg_loss(kld, response_mask, loss_agg_mode, context.max_response_length, context.batch_num_seqs,
                     context.batch_num_tokens)
    return share, masked_mean(kld.detach(), response_mask).item()


def value_loss(
    values: torch.Tensor,
    old_values: torch.Tensor,
    returns: torch.Tensor,
    response_mask: torch.Tensor,
    context: LossContext,
    value_clip: float | None = 0.5,
    loss_agg_mode: str = "token-mean",
) -> tuple[torch.Tensor, dict[str, float]]:
    """The critic's clipped value loss (PPO as in Ouyang et al. 2022; the clip keeps the value
    function near the one that computed the advantages). Per token::

        V_clip = V_old + clip(V - V_old, -value_clip, value_clip)
        L_t    = 0.5 * max((V - R)^2, (V_clip - R)^2)          value_clip null: 0.5 * (V - R)^2

    aggregated by ``loss_agg_mode``. Metrics: ``vf_loss`` (token mean of ``L``), ``vf_clipfrac``
    (share of tokens where the clipped branch is larger), ``vpred_mean``.
    """
    unclipped = (values - returns) ** 2
    if value_clip is None:
        per_token, clipped = 0.5 * unclipped, torch.zeros_like(unclipped, dtype=torch.bool)
    else:
        v_clip = old_values + (values - old_values).clamp(-value_clip, value_clip)
        clipped_sq = (v_clip - returns) ** 2
        per_token, clipped = 0.5 * torch.maximum(unclipped, clipped_sq), clipped_sq > unclipped
    loss = agg_loss(per_token, response_mask, loss_agg_mode, context.max_response_length, context.batch_num_seqs,
                    context.batch_num_tokens)
    with torch.no_grad():
        metrics = {"vf_loss": masked_mean(per_token, response_mask).item(),
                   "vf_clipfrac": masked_mean(clipped.to(values.dtype), response_mask).item(),
                   "vpred_mean": masked_mean(values, response_mask).item()}
    return loss, metrics


POLICY_LOSSES = {"ppo_clip": ppo_clip, "dual_clip": dual_clip, "gspo": gspo, "topr": topr}
