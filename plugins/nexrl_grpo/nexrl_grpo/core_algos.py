"""RL math for GRPO: tensors in, tensors out.

Shapes: ``B`` batch rows, ``T`` response length. ``response_mask`` is a float or bool ``[B, T]``
tensor, 1 on tokens that count. Only the KL controllers keep state.

Group statistics use ONE estimator everywhere: the group mean and the unbiased (Bessel,
``n - 1``) standard deviation, computed by :func:`compute_group_stats`. Groups of one sample have
no spread to compare against and get advantage 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from typing import Any

import torch

LOSS_AGG_MODES = ("seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm")

_KL_KINDS = {"kl": "kl", "k1": "kl", "abs": "abs", "mse": "mse", "k2": "mse", "low_var_kl": "low_var_kl", "k3": "low_var_kl"}


def masked_mean(values: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is set (0 when nothing is set)."""
    mask = mask.to(values.dtype)
    if dim is None:
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum(dim) / mask.sum(dim).clamp(min=1)


def scores_to_token_level(scores: torch.Tensor, response_mask: torch.Tensor) -> torch.Tensor:
    """Place each row's scalar score on its last valid response token; zeros elsewhere.

    A row with no valid token cannot carry a score and stays all zero.
    """
    mask = response_mask.bool()
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    last = torch.where(mask, positions, -1).max(dim=-1).values
    out = torch.zeros(mask.shape, dtype=scores.dtype, device=scores.device)
    has_token = last >= 0
    rows = torch.nonzero(has_token).squeeze(-1)
    out[rows, last[has_token]] = scores[has_token]
    return out


def _group_index(group_ids: Sequence[Hashable], device: torch.device) -> tuple[torch.Tensor, int]:
    index: dict[Hashable, int] = {}
    ids = [index.setdefault(g, len(index)) for g in group_ids]
    return torch.tensor(ids, dtype=torch.long, device=device), len(index)


def compute_group_stats(
    scores: torch.Tensor, group_ids: Sequence[Hashable]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-row ``(group mean, group unbiased std, group size)`` of scalar ``scores[B]``.

    The std of a group of one is reported as 0.
    """
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {scores.shape[0]} rows")
    idx, n_groups = _group_index(group_ids, scores.device)
    counts = torch.zeros(n_groups, dtype=scores.dtype, device=scores.device).index_add_(0, idx, torch.ones_like(scores))
    sums = torch.zeros_like(counts).index_add_(0, idx, scores)
    mean = (sums / counts)[idx]
    # Two passes (mean first, then squared deviations) for accuracy.
    sq = torch.zeros_like(counts).index_add_(0, idx, (scores - mean) ** 2)
    var = torch.where(counts > 1, sq / (counts - 1).clamp(min=1), torch.zeros_like(sq))
    return mean, var.sqrt()[idx], counts[idx]


def compute_grpo_scalar_advantage(
    scores: torch.Tensor,
    group_ids: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> torch.Tensor:
    """GRPO advantage of each scalar score ``[B]``: ``(s - mean) / (std + epsilon)`` within its group."""
    mean, std, count = compute_group_stats(scores, group_ids)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    return torch.where(count > 1, adv, torch.zeros_like(adv))


def compute_grpo_outcome_advantage(
    token_level_rewards: torch.Tensor,
    response_mask: torch.Tensor,
    group_ids: Sequence[Hashable],
    epsilon: float = 1e-6,
    norm_adv_by_std: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Outcome-level GRPO: ``(advantages[B,T], returns[B,T])``.

    Each row's score is the sum of its token rewards; its group-relative advantage is broadcast
    over the valid tokens (zero on masked ones). Returns equal advantages, as in GRPO there is
    no value function to regress.
    """
    mask = response_mask.to(token_level_rewards.dtype)
    scores = (token_level_rewards * mask).sum(dim=-1)
    adv = compute_grpo_scalar_advantage(scores, group_ids, epsilon, norm_adv_by_std)
    advantages = adv.unsqueeze(-1) * mask
    return advantages, advantages


def kl_penalty(logprob: torch.Tensor, ref_logprob: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token KL estimate between the policy and the reference.

    ``kl``/``k1``: ``logp - ref``; ``abs``: ``|logp - ref|``; ``mse``/``k2``: ``0.5 (logp - ref)^2``;
    ``low_var_kl``/``k3``: ``exp(ref - logp) - (ref - logp) - 1`` clamped to ``[-10, 10]``.
    """
    name = _KL_KINDS.get(kind)
    if name is None:
        raise ValueError(f"kl_penalty kind {kind!r} is unknown; valid kinds: {sorted(_KL_KINDS)}")
    diff = logprob - ref_logprob
    if name == "kl":
        return diff
    if name == "abs":
        return diff.abs()
    if name == "mse":
        return 0.5 * diff.square()
    # Clamping the log-ratio first keeps exp() finite so gradients never become inf * 0 = nan;
    # it does not change the value once the output clamp applies.
    log_ratio = (-diff).clamp(-20.0, 20.0)
    return (log_ratio.exp() - log_ratio - 1.0).clamp(-10.0, 10.0)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019): moves the coefficient so the KL tracks ``target_kl``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"AdaptiveKLController needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


def get_kl_controller(config: Mapping[str, Any] | Any) -> FixedKLController | AdaptiveKLController:
    """Build a controller from a ``kl_ctrl`` mapping: ``type`` (fixed|adaptive), ``kl_coef``, ``target_kl``, ``horizon``."""
    kind = config.get("type", "fixed")
    kl_coef = float(config.get("kl_coef", 0.001))
    if kind == "fixed":
        return FixedKLController(kl_coef)
    if kind == "adaptive":
        return AdaptiveKLController(kl_coef, float(config.get("target_kl", 0.1)), float(config.get("horizon", 10000)))
    raise ValueError(f"kl_ctrl.type {kind!r} is unknown; valid types: ['adaptive', 'fixed']")


def apply_kl_penalty(
    token_level_scores: torch.Tensor,
    old_log_prob: torch.Tensor,
    ref_log_prob: torch.Tensor,
    response_mask: torch.Tensor,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[torch.Tensor, dict[str, float]]:
    """``rewards = scores - beta * kl`` on valid tokens, then update ``kl_ctrl`` with the batch KL.

    The batch KL is the mean over rows of each row's token-mean KL. Metrics report that KL and
    the coefficient that was applied (before the update).
    """
    mask = response_mask.to(token_level_scores.dtype)
    kld = kl_penalty(old_log_prob, ref_log_prob, kind).to(token_level_scores.dtype) * mask
    beta = kl_ctrl.value
    rewards = token_level_scores - beta * kld
    current_kl = masked_mean(kld, mask, dim=-1).mean().item()
    kl_ctrl.update(current_kl, n_steps=token_level_scores.shape[0])
    return rewards, {"kl_penalty": current_kl, "kl_coef": beta}


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
    - ``token-mean`` (DAPO/BNPO): sum over all valid tokens / number of valid tokens.
    - ``seq-mean-token-sum-norm`` (Dr.GRPO): token sum / ``max_response_length``, mean over sequences.

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


def compute_policy_loss(
    old_log_prob: torch.Tensor,
    log_prob: torch.Tensor,
    advantages: torch.Tensor,
    response_mask: torch.Tensor,
    clip_ratio_low: float = 0.2,
    clip_ratio_high: float = 0.2,
    loss_agg_mode: str = "seq-mean-token-mean",
    max_response_length: int | None = None,
    batch_num_seqs: float | None = None,
    batch_num_tokens: float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """PPO clipped surrogate ``max(-A r, -A clip(r, 1-low, 1+high))`` aggregated by ``loss_agg_mode``.

    Metrics: ``pg_clipfrac`` (fraction of valid tokens where the clipped branch is active) and
    ``ppo_kl`` (token mean of ``old_logp - logp``).
    """
    # Clamping the log-ratio keeps exp() finite for wildly off-policy tokens.
    log_ratio = (log_prob - old_log_prob).clamp(-20.0, 20.0)
    ratio = log_ratio.exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_ratio_low, 1.0 + clip_ratio_high)
    pg_losses = torch.maximum(unclipped, clipped)
    loss = agg_loss(pg_losses, response_mask, loss_agg_mode, max_response_length, batch_num_seqs, batch_num_tokens)
    with torch.no_grad():
        metrics = {
            "pg_clipfrac": masked_mean((clipped > unclipped).to(pg_losses.dtype), response_mask).item(),
            "ppo_kl": masked_mean(-log_ratio, response_mask).item(),
        }
    return loss, metrics
