"""The distillation keys every on-policy distillation trainer reads (``self_hosted_opd`` here,
``remote_api_opd`` in nexrl-tinker), and the token selections they make, on numpy alone: a trainer
that computes no loss itself (Tinker's service does) shares them without torch.

Per token ``x_t`` of a student sample, with ``s`` the student's log-prob and ``t`` the teacher's,
``k_t = s(x_t) - t(x_t)`` is the sampled reverse KL and ``-kl_coef * k_t`` the token's advantage:
a policy gradient whose reward is each token's negative reverse KL alone, which in expectation
over the student's samples is the gradient of ``KL(student || teacher)``. The tokens trained are
chosen by position in each sample (``token_range``) and by ``k_t`` among the batch's
(``kl_quantile_range``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from nexrl_core import Settings, setting

# Rounding slack of a fraction times a token count (0.29 * 100 is 28.999999999999996 in floats).
_FRACTION_EPS = 1e-9


@dataclass(frozen=True, kw_only=True)
class TokenRange(Settings):
    """Which part of each sample's trained tokens the loss trains on, by position."""

    start: float = setting(0.0, "first trained token, as a fraction of the sample's trained tokens (0: the first)",
                           ge=0.0, lt=1.0)
    end: float = setting(1.0, "end of the range (exclusive), as a fraction of the sample's trained tokens "
                              "(1: through the last)", gt=0.0, le=1.0)


@dataclass(frozen=True, kw_only=True)
class KlQuantileRange(Settings):
    """Which of the batch's tokens the loss trains on, by their reverse KL to the teacher."""

    start: float = setting(0.0, "lower quantile of the batch's per-token reverse KL (0: its minimum)", ge=0.0,
                           lt=1.0)
    end: float = setting(1.0, "upper quantile (1: its maximum); tokens between the two are trained", gt=0.0, le=1.0)


@dataclass(frozen=True, kw_only=True)
class DistillationSettings(Settings):
    """The ``algorithm.*`` keys of on-policy distillation, whichever trainer runs it."""

    kl_coef: float = setting(1.0, "weight of the per-token reverse KL to the teacher (NexRL's distillation_coeff)",
                             gt=0.0)
    token_range: TokenRange = setting(TokenRange, "train on part of each sample's tokens, by position "
                                                  "(NexRL's train_token_start_pct / train_token_end_pct)")
    kl_quantile_range: KlQuantileRange = setting(KlQuantileRange, "train on the tokens whose reverse KL lies between "
                                                                  "two quantiles of the batch's (NexRL's "
                                                                  "advantage_start_pct / advantage_end_pct)")


def range_problems(options: Mapping[str, Any]) -> list[str]:
    """An empty ``token_range`` or ``kl_quantile_range`` (start not below end) trains on nothing."""
    problems = []
    for key in ("token_range", "kl_quantile_range"):
        section = options[key]
        if section["start"] >= section["end"]:
            problems.append(f"algorithm.{key}: start ({section['start']}) must be below end ({section['end']}), "
                            f"or no token is left to train on")
    return problems


def token_range_mask(mask: np.ndarray, start: float, end: float) -> np.ndarray:
    """``[N, T]`` 0/1: of each row's set tokens (``mask`` > 0, ``n`` of them, in order), those with
    index ``i`` in ``[floor(start * n), floor(end * n))``; at least the first of them when that is
    empty, so a row with a trained token keeps one."""
    out = np.zeros(mask.shape, dtype=np.float32)
    for row in range(mask.shape[0]):
        positions = np.nonzero(mask[row] > 0)[0]
        n = len(positions)
        if not n:
            continue
        first = min(math.floor(start * n + _FRACTION_EPS), n - 1)
        last = min(max(math.floor(end * n + _FRACTION_EPS), first + 1), n)
        out[row, positions[first:last]] = 1.0
    return out


def kl_quantile_mask(kl: np.ndarray, mask: np.ndarray, start: float, end: float) -> np.ndarray:
    """``[N, T]`` 0/1: the set tokens of ``mask`` whose ``kl`` lies between the ``start`` and ``end``
    quantiles (linear interpolation) of the set tokens' values, both ends included."""
    chosen = mask > 0
    if not chosen.any():
        return np.zeros(mask.shape, dtype=np.float32)
    values = kl[chosen].astype(np.float64)
    low, high = np.quantile(values, [start, end])
    keep = chosen & (kl >= low) & (kl <= high)
    return keep.astype(np.float32)
