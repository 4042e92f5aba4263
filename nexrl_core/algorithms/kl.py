"""KL estimators, KL controllers and the KL penalty in the reward.

:func:`kl_penalty` is written once against operations numpy arrays and torch tensors share, so
a numpy caller (the reward penalty, the rollout-mismatch metrics) and a torch caller needing
gradients (a KL loss term) use the same formulas; torch is never imported here.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np

from ..config.options import option_defaults
from ..config.settings import Settings, setting

KL_KINDS = {"kl": "k1", "k1": "k1", "abs": "abs", "mse": "k2", "k2": "k2", "low_var_kl": "k3", "k3": "k3"}


def array_namespace(x: Any) -> Any:
    """``torch`` for a torch tensor (already imported by whoever made it), else ``numpy``."""
    if type(x).__module__.split(".", 1)[0] == "torch":
        return sys.modules["torch"]
    return np


def kl_penalty(logprob: Any, ref_logprob: Any, kind: str = "kl") -> Any:
    """Per-token KL estimate between a policy and a reference, from tokens sampled by the policy
    (Schulman, "Approximating KL divergence", 2020). With ``d = logprob - ref_logprob``:

    - ``kl``/``k1``: ``d`` (unbiased, high variance, can be negative);
    - ``abs``: ``|d|``;
    - ``mse``/``k2``: ``d^2 / 2``;
    - ``low_var_kl``/``k3``: ``exp(-d) + d - 1`` (unbiased, never negative), clamped to ``[-10, 10]``.

    Works on numpy arrays and on torch tensors (gradients flow); returns the same kind.
    """
    name = KL_KINDS.get(kind)
    if name is None:
        raise ValueError(f"kl_penalty kind {kind!r} is unknown; valid kinds: {sorted(KL_KINDS)}")
    diff = logprob - ref_logprob
    if name == "k1":
        return diff
    if name == "abs":
        return abs(diff)
    if name == "k2":
        return 0.5 * diff * diff
    xp = array_namespace(diff)
    # Clamping the log-ratio first keeps exp() finite, so gradients never become inf * 0 = nan;
    # it does not change the value once the output clamp applies.
    log_ratio = xp.clip(-diff, -20.0, 20.0)
    return xp.clip(xp.exp(log_ratio) - log_ratio - 1.0, -10.0, 10.0)


class FixedKLController:
    """Constant KL coefficient."""

    def __init__(self, kl_coef: float):
        self.value = float(kl_coef)

    def update(self, current_kl: float, n_steps: int) -> None:
        pass


class AdaptiveKLController:
    """Proportional controller of Ziegler et al. (2019, arXiv:1909.08593): moves the coefficient so
    the KL tracks ``target_kl``: ``beta *= 1 + clip(KL / target - 1, -0.2, 0.2) * n_steps / horizon``."""

    def __init__(self, init_kl_coef: float, target_kl: float, horizon: float):
        if target_kl <= 0 or horizon <= 0:
            raise ValueError(f"kl_ctrl: adaptive control needs target_kl > 0 and horizon > 0, got {target_kl}, {horizon}")
        self.value = float(init_kl_coef)
        self.target = float(target_kl)
        self.horizon = float(horizon)

    def update(self, current_kl: float, n_steps: int) -> None:
        proportional_error = min(max(float(current_kl) / self.target - 1.0, -0.2), 0.2)
        self.value *= 1.0 + proportional_error * n_steps / self.horizon


@dataclass(frozen=True, kw_only=True)
class KlCtrlSettings(Settings):
    """``kl_ctrl``: how the KL coefficient of the reward penalty moves."""

    type: Literal["fixed", "adaptive"] = setting("fixed", "fixed: constant coefficient; adaptive: steered towards "
                                                          "target_kl")
    kl_coef: float = setting(0.001, "KL coefficient (the initial one when adaptive)", ge=0)
    target_kl: float = setting(0.1, "adaptive: the KL the coefficient steers towards", gt=0,
                               needs=".type == adaptive")
    horizon: float = setting(10000.0, "adaptive: samples over which the coefficient adapts", gt=0,
                             needs=".type == adaptive")


KL_CTRL_OPTIONS = KlCtrlSettings.options()
KL_CTRL_DEFAULTS = option_defaults(KL_CTRL_OPTIONS)


def get_kl_controller(config: KlCtrlSettings | Mapping[str, Any] | None) -> FixedKLController | AdaptiveKLController:
    """A controller from ``kl_ctrl`` settings, or a mapping of them (keys and defaults: :data:`KL_CTRL_DEFAULTS`)."""
    cfg = {**KL_CTRL_DEFAULTS, **(config.to_dict() if isinstance(config, KlCtrlSettings) else dict(config or {}))}

    def number(name: str) -> float:
        value = cfg[name]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"kl_ctrl.{name}: expected a number, got {value!r}")
        return float(value)

    if cfg["type"] == "fixed":
        return FixedKLController(number("kl_coef"))
    if cfg["type"] == "adaptive":
        return AdaptiveKLController(number("kl_coef"), number("target_kl"), number("horizon"))
    raise ValueError(f"kl_ctrl.type: {cfg['type']!r} is not one of adaptive, fixed")


def apply_kl_penalty(
    token_level_scores: np.ndarray,
    logprob: np.ndarray,
    ref_logprob: np.ndarray,
    response_mask: np.ndarray,
    kl_ctrl: FixedKLController | AdaptiveKLController,
    kind: str = "kl",
) -> tuple[np.ndarray, dict[str, float]]:
    """Reward post-processing: ``rewards = scores - beta * KL`` on valid tokens (Ziegler et al.
    2019), then ``kl_ctrl`` is updated with the batch KL.

    The batch KL is the mean over rows of each row's token-mean KL. Metrics report that KL
    (``kl_penalty``) and the coefficient that was applied (``kl_coef``, before the update).
    """
    scores = np.asarray(token_level_scores)
    mask = np.asarray(response_mask, dtype=np.float64)
    kld = kl_penalty(np.asarray(logprob, dtype=np.float64), np.asarray(ref_logprob, dtype=np.float64), kind) * mask
    beta = kl_ctrl.value
    rewards = (scores - beta * kld).astype(scores.dtype if np.issubdtype(scores.dtype, np.floating) else np.float64)
    row_kl = kld.sum(axis=-1) / np.maximum(mask.sum(axis=-1), 1)
    current_kl = float(row_kl.mean()) if row_kl.size else 0.0
    kl_ctrl.update(current_kl, n_steps=scores.shape[0])
    return rewards, {"kl_penalty": current_kl, "kl_coef": beta}
