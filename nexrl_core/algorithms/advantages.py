"""Advantage estimators: numpy arrays in, numpy arrays out.

Shapes: ``B`` rows, ``T`` response tokens. Every estimator takes one :class:`AdvantageInputs`
and returns ``(advantages[B, T], returns[B, T])``, zero on masked tokens, in the dtype of the
rewards (the arithmetic runs in float64). Its keyword-only parameters are the ``algorithm.*``
recipe keys it reads (see :mod:`nexrl_core.algorithms.registry`).

Statistics use ONE estimator everywhere: the mean and the unbiased (Bessel, ``n - 1``) standard
deviation, per group (:func:`group_stats`) or over the batch's valid tokens (:func:`masked_whiten`).
A group of one sample has no spread to compare against and gets advantage 0.

Token-level recursions (discounted returns, GAE) run over each row's valid tokens only: a masked
token inside a response (a tool's output in a multi-turn trajectory) neither earns nor discounts.

An estimator may carry two attributes the registry reads (:mod:`nexrl_core.algorithms.registry`):
``recommended_defaults`` (defaults it recommends for other ``algorithm.*`` keys, used when the
recipe leaves them unset) and ``requires`` (fields of :class:`AdvantageInputs` beyond rewards,
mask and groups that the trainer must fill, e.g. ``("values",)`` for a critic).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read.

    :ivar token_level_rewards: ``[B, T]`` reward of each response token (an outcome reward sits
        on the last valid token, see :func:`scores_to_token_level`; a KL penalty may be spread
        over all tokens).
    :ivar response_mask: ``[B, T]``, 1 on tokens that count.
    :ivar group_ids: ``B`` hashable ids; rows with the same id answer the same prompt.
    :ivar values: ``[B, T]`` critic values ``V_t`` of the state before response token ``t``, for
        estimators that declare ``requires = ("values",)`` (None otherwise).
    """

    token_level_rewards: np.ndarray
    response_mask: np.ndarray
    group_ids: Sequence[Hashable]
    values: np.ndarray | None = None

    def __post_init__(self) -> None:
        rewards, mask = np.asarray(self.token_level_rewards), np.asarray(self.response_mask)
        if rewards.ndim != 2 or rewards.shape != mask.shape:
            raise ValueError(f"token_level_rewards {rewards.shape} and response_mask {mask.shape} must be the "
                             f"same [B, T] shape")
        if len(self.group_ids) != rewards.shape[0]:
            raise ValueError(f"group_ids has {len(self.group_ids)} entries for {rewards.shape[0]} rows")


def scores_to_token_level(scores: np.ndarray, response_mask: np.ndarray) -> np.ndarray:
    """Each row's scalar score on its last valid response token, zeros elsewhere: ``[B] -> [B, T]``.

    A row with no valid token cannot carry a score and stays all zero.
    """
    scores = np.asarray(scores)
    mask = np.asarray(response_mask).astype(bool)
    out = np.zeros(mask.shape, dtype=np.result_type(scores.dtype, np.float32))
    has_token = mask.any(axis=-1)
    last = mask.shape[-1] - 1 - np.argmax(mask[:, ::-1], axis=-1)
    rows = np.nonzero(has_token)[0]
    out[rows, last[rows]] = scores[rows]
    return out


def group_stats(scores: np.ndarray, group_ids: Sequence[Hashable]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-row ``(group mean, group unbiased std, group size)`` of scalar ``scores[B]`` (float64).

    The std of a group of one is reported as 0.
    """
    scores = np.asarray(scores, dtype=np.float64)
    if len(group_ids) != scores.shape[0]:
        raise ValueError(f"group_ids has {len(group_ids)} entries for {scores.shape[0]} rows")
    index: dict[Hashable, int] = {}
    idx = np.array([index.setdefault(g, len(index)) for g in group_ids], dtype=np.int64)
    counts = np.bincount(idx, minlength=len(index)).astype(np.float64)
    mean = (np.bincount(idx, weights=scores, minlength=len(index)) / np.maximum(counts, 1))[idx]
    # Two passes (mean first, then squared deviations) for accuracy.
    squares = np.bincount(idx, weights=(scores - mean) ** 2, minlength=len(index))
    var = np.where(counts > 1, squares / np.maximum(counts - 1, 1), 0.0)
    return mean, np.sqrt(var)[idx], counts[idx]


def _outcome_scores(data: AdvantageInputs) -> tuple[np.ndarray, np.ndarray]:
    mask = np.asarray(data.response_mask, dtype=np.float64)
    return (np.asarray(data.token_level_rewards, dtype=np.float64) * mask).sum(axis=-1), mask


def _cast(values: np.ndarray, like: np.ndarray) -> np.ndarray:
    """``values`` in the dtype of the rewards (float64 for integer rewards)."""
    dtype = np.asarray(like).dtype if np.issubdtype(np.asarray(like).dtype, np.floating) else np.float64
    return np.asarray(values).astype(dtype)


def _broadcast(adv: np.ndarray, mask: np.ndarray, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    advantages = _cast(adv[:, None] * mask, like)
    return advantages, advantages.copy()


def grpo(data: AdvantageInputs, *, epsilon: float = 1e-6, norm_adv_by_std: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """GRPO (Shao et al. 2024, DeepSeekMath, arXiv:2402.03300), outcome supervision.

    Each row's score is the sum of its token rewards, ``s_i = sum_t r_it m_it``; within its group
    ``G`` (same prompt)::

        A_i = (s_i - mean_G(s)) / (std_G(s) + epsilon)      std: unbiased (n - 1)

    broadcast over the row's valid tokens. ``norm_adv_by_std: false`` drops the division.
    Groups of one get 0. Returns equal advantages, as GRPO has no value function to regress.

    :param epsilon: added to the std (a flat group then gets 0, not a division by zero).
    :param norm_adv_by_std: divide by the group std.
    """
    scores, mask = _outcome_scores(data)
    mean, std, count = group_stats(scores, data.group_ids)
    adv = scores - mean
    if norm_adv_by_std:
        adv = adv / (std + epsilon)
    adv = np.where(count > 1, adv, 0.0)
    return _broadcast(adv, mask, data.token_level_rewards)


def dr_grpo(data: AdvantageInputs) -> tuple[np.ndarray, np.ndarray]:
    """Dr. GRPO (Liu et al. 2025, "Understanding R1-Zero-Like Training", arXiv:2503.20783).

    GRPO without the std division, which biases updates towards groups of low spread::

        A_i = s_i - mean_G(s)

    The paper's other fix, a loss normalised by a constant instead of each response's length,
    is the loss aggregation ``seq-mean-token-sum-norm``: this estimator makes it the default
    ``algorithm.loss_agg_mode`` (a recipe that sets the key keeps its choice).
    """
    scores, mask = _outcome_scores(data)
    mean, _, count = group_stats(scores, data.group_ids)
    adv = np.where(count > 1, scores - mean, 0.0)
    return _broadcast(adv, mask, data.token_level_rewards)


dr_grpo.recommended_defaults = {"loss_agg_mode": "seq-mean-token-sum-norm"}  # type: ignore[attr-defined]


def rloo(data: AdvantageInputs) -> tuple[np.ndarray, np.ndarray]:
    """RLOO, REINFORCE with a leave-one-out baseline (Kool et al. 2019, "Buy 4 REINFORCE samples,
    get a baseline for free!"; Ahmadian et al. 2024, "Back to Basics", arXiv:2402.14740).

    Each row's baseline is the mean score of the *other* ``n - 1`` rows of its group, so it does
    not depend on the row's own sample (the gradient stays unbiased)::

        A_i = s_i - (sum_{j in G, j != i} s_j) / (n - 1)  =  n / (n - 1) * (s_i - mean_G(s))

    broadcast over the row's valid tokens. Groups of one get 0.
    """
    scores, mask = _outcome_scores(data)
    mean, _, count = group_stats(scores, data.group_ids)
    others = (mean * count - scores) / np.maximum(count - 1, 1)
    adv = np.where(count > 1, scores - others, 0.0)
    return _broadcast(adv, mask, data.token_level_rewards)


def masked_whiten(values: np.ndarray, mask: np.ndarray, epsilon: float = 1e-6) -> np.ndarray:
    """``(x - mean) / (std + epsilon)`` over the valid entries of ``values`` (the whole batch),
    unbiased std; 0 where ``mask`` is 0. Fewer than two valid entries have no spread: std 0 (and
    all zeros when ``epsilon`` is 0 too)."""
    values = np.asarray(values, dtype=np.float64)
    mask = np.asarray(mask, dtype=np.float64)
    n = mask.sum()
    mean = (values * mask).sum() / max(n, 1.0)
    var = ((values - mean) ** 2 * mask).sum() / (n - 1) if n > 1 else 0.0
    scale = np.sqrt(var) + epsilon
    return (values - mean) / scale * mask if scale > 0 else np.zeros_like(values)


def discounted_returns(token_level_rewards: np.ndarray, response_mask: np.ndarray, gamma: float = 1.0) -> np.ndarray:
    """``G_t = r_t + gamma * G_t'`` where ``t'`` is the row's next valid token (0 after the last),
    on valid tokens; 0 on masked ones. float64 ``[B, T]``."""
    rewards = np.asarray(token_level_rewards, dtype=np.float64)
    valid = np.asarray(response_mask).astype(bool)
    returns = np.zeros_like(rewards)
    running = np.zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        running = np.where(valid[:, t], rewards[:, t] + gamma * running, running)
        returns[:, t] = np.where(valid[:, t], running, 0.0)
    return returns


def reinforce_plus_plus(data: AdvantageInputs, *, gamma: float = 1.0, epsilon: float = 1e-6
                        ) -> tuple[np.ndarray, np.ndarray]:
    """REINFORCE++ (Hu 2025, arXiv:2501.03262): discounted token-level returns, normalised over the
    whole batch, with no critic and no per-prompt baseline.

    The token rewards carry the KL penalty on every token and the outcome on the last one,
    ``r_t = -beta * KL_t + [t = last] * s`` (the trainer's ``use_kl_in_reward``, which this
    estimator turns on by default). Then, over the valid tokens of every row of the batch::

        G_t = sum_{k >= t} gamma^(k - t) r_k
        A_t = (G_t - mean_batch(G)) / (std_batch(G) + epsilon)      std: unbiased

    Returns ``(A, G)``.

    :param gamma: discount per token.
    :param epsilon: added to the batch std.
    """
    mask = np.asarray(data.response_mask, dtype=np.float64)
    returns = discounted_returns(data.token_level_rewards, mask, gamma)
    advantages = masked_whiten(returns, mask, epsilon)
    return _cast(advantages, data.token_level_rewards), _cast(returns, data.token_level_rewards)


reinforce_plus_plus.recommended_defaults = {"use_kl_in_reward": True}  # type: ignore[attr-defined]


def gae(data: AdvantageInputs, *, gamma: float = 1.0, lam: float = 0.95, whiten_advantages: bool = True,
        epsilon: float = 1e-6) -> tuple[np.ndarray, np.ndarray]:
    """Generalised advantage estimation (Schulman et al. 2016, arXiv:1506.02438) with a learned
    value function ``V`` (the critic), as PPO uses it for LLMs (Ouyang et al. 2022).

    Over each row's valid tokens ``t`` (``t+1``: the next valid one; ``V`` and ``A`` are 0 after
    the last)::

        delta_t = r_t + gamma * V_{t+1} - V_t
        A_t     = delta_t + gamma * lam * A_{t+1}
        R_t     = A_t + V_t                      (the critic's regression target)

    then ``whiten_advantages`` normalises ``A`` over the batch's valid tokens:
    ``(A - mean) / (std + epsilon)``. Returns ``(A, R)``. Needs ``data.values``.

    :param gamma: discount per token.
    :param lam: GAE's lambda: 1 is the Monte-Carlo return minus ``V_t``, 0 the one-step TD error.
    :param whiten_advantages: normalise the advantages over the batch.
    :param epsilon: added to the std when whitening.
    """
    if data.values is None:
        raise ValueError("gae needs the critic's values (AdvantageInputs.values)")
    rewards = np.asarray(data.token_level_rewards, dtype=np.float64)
    values = np.asarray(data.values, dtype=np.float64)
    if values.shape != rewards.shape:
        raise ValueError(f"values {values.shape} must have the rewards' shape {rewards.shape}")
    valid = np.asarray(data.response_mask).astype(bool)
    advantages = np.zeros_like(rewards)
    next_value = np.zeros(rewards.shape[0])
    running = np.zeros(rewards.shape[0])
    for t in range(rewards.shape[1] - 1, -1, -1):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = np.where(valid[:, t], delta + gamma * lam * running, running)
        next_value = np.where(valid[:, t], values[:, t], next_value)
        advantages[:, t] = np.where(valid[:, t], running, 0.0)
    returns = (advantages + values) * valid
    if whiten_advantages:
        advantages = masked_whiten(advantages, valid, epsilon)
    return _cast(advantages, data.token_level_rewards), _cast(returns, data.token_level_rewards)


gae.requires = ("values",)  # type: ignore[attr-defined]
