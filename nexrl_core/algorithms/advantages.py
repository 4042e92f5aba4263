"""Advantage estimators: numpy arrays in, numpy arrays out.

Shapes: ``B`` rows, ``T`` response tokens. Every estimator takes one :class:`AdvantageInputs`
and returns ``(advantages[B, T], returns[B, T])``, zero on masked tokens, in the dtype of the
rewards (the arithmetic runs in float64). Its keyword-only parameters are the ``algorithm.*``
recipe keys it reads (see :mod:`nexrl_core.algorithms.registry`).

Group statistics use ONE estimator everywhere: the group mean and the unbiased (Bessel, ``n - 1``)
standard deviation of :func:`group_stats`. A group of one sample has no spread to compare against
and gets advantage 0.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class AdvantageInputs:
    """What an advantage estimator may read. Later estimators read more fields (critic values).

    :ivar token_level_rewards: ``[B, T]`` reward of each response token (an outcome reward sits
        on the last valid token, see :func:`scores_to_token_level`; a KL penalty may be spread
        over all tokens).
    :ivar response_mask: ``[B, T]``, 1 on tokens that count.
    :ivar group_ids: ``B`` hashable ids; rows with the same id answer the same prompt.
    :ivar values: ``[B, T]`` critic values, for value-based estimators (None otherwise).
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


def _broadcast(adv: np.ndarray, mask: np.ndarray, like: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    dtype = np.asarray(like).dtype if np.issubdtype(np.asarray(like).dtype, np.floating) else np.float64
    advantages = (adv[:, None] * mask).astype(dtype)
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


dr_grpo.loss_defaults = {"loss_agg_mode": "seq-mean-token-sum-norm"}  # type: ignore[attr-defined]
