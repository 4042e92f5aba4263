"""Policy losses on torch tensors (they need autograd), registered in nexrl-core's algorithm
registry through ``nexrl_policy_losses`` and selected with ``algorithm.policy_loss``.

Shapes: ``B`` rows of one micro-batch, ``T`` response tokens; ``response_mask`` is 1 on tokens
that count. A loss returns this micro-batch's *share* of the whole batch's loss (the shares of a
batch's micro-batches add up to its loss, see :class:`LossContext`) and its metrics. The rest of
the RL math (advantages, KL estimators, rollout correction) is torch-free, in
:mod:`nexrl_core.algorithms`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

import torch

LossAggMode = Literal["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"]
LOSS_AGG_MODES: tuple[str, ...] = get_args(LossAggMode)


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
    - ``seq-mean-token-sum-norm`` (Dr. GRPO): token sum / ``max_response_length``, mean over sequences.

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
    else:
        if not max_response_length:
            raise ValueError("loss_agg_mode 'seq-mean-token-sum-norm' needs max_response_length (a fixed normaliser)")
        seq_losses = token_sums / max_response_length
    seqs = (token_counts > 0).sum() if batch_num_seqs is None else torch.as_tensor(batch_num_seqs, dtype=loss_mat.dtype)
    return seq_losses.sum() / seqs.to(loss_mat.dtype).clamp(min=1)


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
    # Clamping the log-ratio keeps exp() finite for wildly off-policy tokens.
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    if context.token_weights is not None:
        pg_losses = pg_losses * context.token_weights.detach().to(pg_losses.dtype)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, context.max_response_length,
                    context.batch_num_seqs, context.batch_num_tokens)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(pg_losses.dtype), response_mask).item(),
            "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return loss, metrics
