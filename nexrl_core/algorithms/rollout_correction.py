"""Rollout-vs-trainer log-prob mismatch: metrics and truncated importance sampling (numpy).

The rollout engine (vLLM, Tinker, a bf16 engine, a KV-cached decoder) and the trainer compute
the log-probs of the same sampled tokens with different numerics. The trainer optimises its own
policy, so the samples are slightly off-policy; these functions measure by how much and give the
per-token correction weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..config.options import option_defaults
from ..config.settings import Settings, setting
from .kl import kl_penalty


@dataclass(frozen=True, kw_only=True)
class RolloutCorrectionSettings(Settings):
    """``rollout_correction``: truncated importance sampling against the rollout's log-probs."""

    enabled: bool = setting(False, "weight each token's loss by its truncated importance ratio "
                                   "exp(trainer - rollout log-prob), capped at cap")
    cap: float = setting(2.0, "truncation of the importance weights", ge=1, needs=".enabled")


ROLLOUT_CORRECTION_OPTIONS = RolloutCorrectionSettings.options()
ROLLOUT_CORRECTION_DEFAULTS = option_defaults(ROLLOUT_CORRECTION_OPTIONS)


def _masked(trainer_logprob: np.ndarray, rollout_logprob: np.ndarray,
            response_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    trainer = np.asarray(trainer_logprob, dtype=np.float64)
    rollout = np.asarray(rollout_logprob, dtype=np.float64)
    if trainer.shape != rollout.shape:
        raise ValueError(f"trainer log-probs {trainer.shape} and rollout log-probs {rollout.shape} differ in shape")
    return trainer, rollout, np.asarray(response_mask).astype(bool)


def rollout_mismatch_metrics(trainer_logprob: np.ndarray, rollout_logprob: np.ndarray,
                             response_mask: np.ndarray) -> dict[str, float]:
    """Mismatch over the valid response tokens:

    - ``rollout_logprob_diff_mean``: mean of ``|logp_trainer - logp_rollout|``;
    - ``rollout_logprob_diff_max``: its maximum (aggregate across micro-batches as a max);
    - ``rollout_kl_k3``: mean k3 estimate of ``KL(pi_rollout || pi_trainer)`` (the tokens were
      sampled by the rollout policy): ``exp(d) - d - 1`` with ``d = logp_trainer - logp_rollout``.

    All 0 when no token is valid.
    """
    trainer, rollout, mask = _masked(trainer_logprob, rollout_logprob, response_mask)
    if not mask.any():
        return {"rollout_logprob_diff_mean": 0.0, "rollout_logprob_diff_max": 0.0, "rollout_kl_k3": 0.0}
    diff = np.abs(trainer - rollout)[mask]
    k3 = kl_penalty(rollout, trainer, "k3")[mask]
    return {"rollout_logprob_diff_mean": float(diff.mean()), "rollout_logprob_diff_max": float(diff.max()),
            "rollout_kl_k3": float(k3.mean())}


def rollout_mismatch_per_row(trainer_logprob: np.ndarray, rollout_logprob: np.ndarray,
                             response_mask: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Each row's own ``rollout_logprob_diff_max`` and where it is: ``(gap [B] float64, position [B]
    int64)``, the largest ``|logp_trainer - logp_rollout|`` over the row's valid tokens and the
    index of its first such token; NaN and -1 for a row without a valid token."""
    trainer, rollout, mask = _masked(trainer_logprob, rollout_logprob, response_mask)
    diff = np.where(mask, np.abs(trainer - rollout), -np.inf)
    if diff.ndim != 2 or diff.shape[1] == 0:
        return np.full(len(diff), np.nan), np.full(len(diff), -1, dtype=np.int64)
    position = diff.argmax(axis=-1)
    gap = diff[np.arange(len(diff)), position]
    valid = mask.any(axis=-1)
    return np.where(valid, gap, np.nan), np.where(valid, position, -1).astype(np.int64)


def sample_logprob_gaps(gaps: np.ndarray, positions: np.ndarray,
                        row_trajectory: list[int]) -> dict[int, tuple[int, dict[str, float | int]]]:
    """Each trajectory's own gap from its rows' (:func:`rollout_mismatch_per_row`; a trajectory of
    several sequences has a row each): ``trajectory -> (its row with the largest gap, record)``,
    the record ``{"max", "position"}`` plus ``"segment"`` (the row's place among the trajectory's)
    when it has several. A trajectory without a valid token has none."""
    best: dict[int, int] = {}
    slot: list[int] = []
    count: dict[int, int] = {}
    for row, traj in enumerate(row_trajectory):
        slot.append(count.get(traj, 0))
        count[traj] = slot[-1] + 1
        if np.isfinite(gaps[row]) and (traj not in best or gaps[row] > gaps[best[traj]]):
            best[traj] = row
    out: dict[int, tuple[int, dict[str, float | int]]] = {}
    for traj, row in best.items():
        record: dict[str, float | int] = {"max": float(gaps[row]), "position": int(positions[row])}
        if count[traj] > 1:
            record["segment"] = slot[row]
        out[traj] = (row, record)
    return out


def check_cap(cap: float) -> float:
    """``cap`` as a float; TypeError for a non-number, ValueError below 1 (it would down-weight
    on-policy tokens too) or not finite."""
    if isinstance(cap, bool) or not isinstance(cap, (int, float, np.floating, np.integer)):
        raise TypeError(f"rollout_correction.cap: expected a number, got {cap!r}")
    value = float(cap)
    if not math.isfinite(value) or value < 1.0:
        raise ValueError(f"rollout_correction.cap: must be a finite number >= 1, got {cap!r}")
    return value


def truncated_is_weights(trainer_logprob: np.ndarray, rollout_logprob: np.ndarray, response_mask: np.ndarray,
                         cap: float = 2.0) -> tuple[np.ndarray, dict[str, float]]:
    """Token-level truncated importance sampling (TIS; Yao et al. 2025, "Your efficient RL framework
    secretly brings you off-policy RL training"): each valid token's weight is::

        w_t = min(pi_trainer(y_t) / pi_rollout(y_t), cap) = min(exp(logp_trainer - logp_rollout), cap)

    and 0 on masked tokens. Multiplied (as a constant, no gradient) into the per-token
    policy-gradient loss, it turns the gradient of samples drawn by the rollout engine into one
    for the trainer's policy; the cap bounds the variance that rare large ratios would bring.

    :return: ``(weights [B, T] float64, metrics)``: ``rollout_is_weight_mean`` (mean weight over
        valid tokens) and ``rollout_is_capped_frac`` (share of valid tokens whose ratio exceeded
        the cap).
    """
    trainer, rollout, mask = _masked(trainer_logprob, rollout_logprob, response_mask)
    log_cap = math.log(check_cap(cap))
    log_ratio = trainer - rollout
    weights = np.where(mask, np.exp(np.minimum(log_ratio, log_cap)), 0.0)
    n = int(mask.sum())
    metrics = {"rollout_is_weight_mean": float(weights[mask].mean()) if n else 0.0,
               "rollout_is_capped_frac": float((log_ratio[mask] > log_cap).mean()) if n else 0.0}
    return weights, metrics
