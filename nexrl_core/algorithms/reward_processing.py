"""Reward and sample processing before advantages: numpy arrays in, numpy arrays out.

The seed's (ROLL's) order for one domain's rows of a batch::

    get_sample_level_mask  ->  reward_postprocess  ->  compute_token_reward  ->  compute_advantage

The first two live here (the last two are :func:`~nexrl_core.algorithms.scores_to_token_level`
with the KL penalty, and the advantage estimators). Every function is pure; the running
statistics of ``norm: running`` are a value passed in and returned (:class:`RunningMoments`).
:func:`process_rewards` applies both steps domain by domain with each domain's settings, and
:class:`RewardProcessor` keeps the running statistics between steps for a trainer (and in its
checkpoint).

Shapes: ``B`` rows (one response each). ``rewards[B]`` are the evaluator's scalar rewards,
``group_ids[B]`` name each row's prompt group, ``truncated[B]`` marks responses that hit the
token limit.

The settings are the ``algorithm.reward_processing`` recipe keys
(:data:`REWARD_PROCESSING_OPTIONS`); ``algorithm.reward_processing.domains.<domain>`` overrides
any of them for one domain.
"""

from __future__ import annotations

from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, get_args

import numpy as np

from ..config.options import Option, option_defaults
from ..config.settings import Settings, setting
from .advantages import group_stats

NormMode = Literal["none", "group", "batch", "running"]
OverlongMode = Literal["keep", "mask", "score"]
NORM_MODES: tuple[str, ...] = get_args(NormMode)
OVERLONG_MODES: tuple[str, ...] = get_args(OverlongMode)


def _positive(value: float | None) -> str | None:
    return None if value is None or value > 0 else f"expected a positive number or null, got {value!r}"


# A domain's overrides inherit these keys: with domains, the top-level ones may act there.
_NORMALISES = (".norm != none or .domains", ".norm != null or .domains")


@dataclass(frozen=True, kw_only=True)
class RewardSettings(Settings):
    """One domain's reward processing (the top-level keys of ``reward_processing``, or a domain's)."""

    overlong: OverlongMode = setting("keep", "responses cut off by the token limit: keep (train on them as scored) | "
                                             "mask (leave them out of the loss) | score (their reward becomes "
                                             "overlong_reward)")
    overlong_reward: float = setting(0.0, "the reward of a cut-off response with overlong: score",
                                     needs=".overlong == score or .domains")
    mask_flat_groups: bool = setting(False, "leave groups whose rewards are all equal out of the loss")
    # str, not NormMode | None: null is accepted (as none) but is not one of the modes a message lists.
    norm: str | None = setting("none", "reward normalisation: none | group (per prompt) | batch (the domain's rows "
                                       "of the batch) | running (every reward seen so far)", choices=NORM_MODES)
    norm_mean: bool = setting(True, "normalising subtracts the mean", needs=_NORMALISES)
    norm_std: bool = setting(True, "normalising divides by the standard deviation (+ epsilon)", needs=_NORMALISES)
    epsilon: float = setting(1e-6, "added to the standard deviation", gt=0, needs=_NORMALISES)
    clip: float | None = setting(None, "clamp rewards to [-clip, clip] after normalising (null: no clip)",
                                 check=_positive)
    scale: float = setting(1.0, "multiply rewards by this after clipping (a domain's weight)")


REWARD_OPTIONS: dict[str, Option] = RewardSettings.options()


@dataclass(frozen=True, kw_only=True)
class RewardProcessingSettings(RewardSettings):
    """``reward_processing``: the keys of :class:`RewardSettings` and each domain's overrides of them."""

    # A domain's overrides are partial (the others inherit the top-level values), so each is a
    # mapping the recipe check holds to REWARD_OPTIONS, key by key.
    domains: dict[str, object] = setting({}, "per-domain overrides of these keys: {<domain>: {norm: group, ...}}",
                                         values=Option(options=REWARD_OPTIONS, help="the keys above, for one domain"))


REWARD_PROCESSING_OPTIONS: dict[str, Option] = RewardProcessingSettings.options()

REWARD_PROCESSING_DEFAULTS: dict[str, Any] = option_defaults(REWARD_OPTIONS)
_POSTPROCESS_KEYS = ("overlong", "overlong_reward", "norm", "norm_mean", "norm_std", "epsilon", "clip", "scale")


# -- running statistics ------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunningMoments:
    """Count, mean and sum of squared deviations of every value seen (Chan et al.'s parallel
    update of Welford's algorithm): combining batches gives exactly the statistics of their union."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def update(self, values: np.ndarray) -> RunningMoments:
        values = np.asarray(values, dtype=np.float64)
        n = int(values.size)
        if n == 0:
            return self
        batch_mean = float(values.mean())
        batch_m2 = float(((values - batch_mean) ** 2).sum())
        total = self.count + n
        delta = batch_mean - self.mean
        mean = self.mean + delta * n / total
        m2 = self.m2 + batch_m2 + delta * delta * self.count * n / total
        return RunningMoments(total, mean, m2)

    @property
    def std(self) -> float:
        """Unbiased (``n - 1``) standard deviation; 0 below two values."""
        return float(np.sqrt(self.m2 / (self.count - 1))) if self.count > 1 else 0.0

    def to_dict(self) -> dict[str, float]:
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RunningMoments:
        return cls(int(data["count"]), float(data["mean"]), float(data["m2"]))


# -- the two steps -------------------------------------------------------------------------------------

def get_sample_level_mask(rewards: np.ndarray, group_ids: Sequence[Hashable], truncated: np.ndarray, *,
                          overlong: str = "keep", mask_flat_groups: bool = False) -> np.ndarray:
    """``[B]`` float mask: 1 for rows the loss trains on, 0 for rows it leaves out.

    - ``overlong: mask``: rows whose response was cut off by the token limit get 0 (DAPO's
      overlong filtering);
    - ``mask_flat_groups``: rows of a group whose rewards are all equal get 0 (no signal to learn
      from; a group of one is flat).

    A masked row still counts in its group's statistics and in the normalisation statistics: it
    is a sample that was drawn, only not trained on.
    """
    rewards = np.asarray(rewards, dtype=np.float64)
    mask = np.ones(rewards.shape[0], dtype=np.float64)
    if overlong == "mask":
        mask[np.asarray(truncated, dtype=bool)] = 0.0
    if mask_flat_groups:
        mask[flat_group_rows(rewards, group_ids)] = 0.0
    return mask


def flat_group_rows(rewards: np.ndarray, group_ids: Sequence[Hashable]) -> np.ndarray:
    """``[B]`` bool: the row's group has all rewards equal."""
    rewards = np.asarray(rewards, dtype=np.float64)
    lowest: dict[Hashable, float] = {}
    highest: dict[Hashable, float] = {}
    for g, r in zip(group_ids, rewards.tolist()):
        lowest[g] = min(lowest.get(g, r), r)
        highest[g] = max(highest.get(g, r), r)
    return np.array([lowest[g] == highest[g] for g in group_ids], dtype=bool)


def reward_postprocess(rewards: np.ndarray, group_ids: Sequence[Hashable], truncated: np.ndarray,
                       running: RunningMoments | None = None, *, overlong: str = "keep",
                       overlong_reward: float = 0.0, norm: str | None = "none", norm_mean: bool = True,
                       norm_std: bool = True, epsilon: float = 1e-6, clip: float | None = None,
                       scale: float = 1.0) -> tuple[np.ndarray, RunningMoments, dict[str, float]]:
    """One domain's rewards, in this order:

    1. ``overlong: score``: a cut-off response's reward becomes ``overlong_reward``;
    2. normalisation ``norm`` with ``mu``/``sigma`` from the row's prompt group (``group``), the
       rows given (``batch``) or every reward seen so far, these included (``running``)::

           r = (r - mu) / (sigma + epsilon)     sigma: unbiased (n - 1); 0 for a single value

       ``norm_mean: false`` drops ``- mu``, ``norm_std: false`` drops the division;
    3. ``clip``: ``r = min(max(r, -clip), clip)``;
    4. ``scale``: ``r = scale * r``.

    Returns ``(rewards[B] float64, running statistics after this batch, metrics)``; metrics:
    ``reward_clip_frac`` (rows the clip changed, with ``clip``), ``reward_running_mean`` /
    ``reward_running_std`` (with ``running``).
    """
    out = np.asarray(rewards, dtype=np.float64).copy()
    running = running or RunningMoments()
    metrics: dict[str, float] = {}
    if overlong == "score":
        out[np.asarray(truncated, dtype=bool)] = float(overlong_reward)
    norm = norm or "none"
    if norm not in NORM_MODES:
        raise ValueError(f"norm {norm!r} is not one of {', '.join(NORM_MODES)}")
    if norm != "none" and out.size:
        if norm == "group":
            mean, std, _ = group_stats(out, group_ids)
        elif norm == "batch":
            mean = np.full_like(out, out.mean())
            std = np.full_like(out, out.std(ddof=1) if out.size > 1 else 0.0)
        else:
            running = running.update(out)
            mean, std = np.full_like(out, running.mean), np.full_like(out, running.std)
            metrics.update(reward_running_mean=running.mean, reward_running_std=running.std)
        if norm_mean:
            out = out - mean
        if norm_std:
            out = out / (std + epsilon)
    if clip is not None:
        metrics["reward_clip_frac"] = float((np.abs(out) > clip).mean()) if out.size else 0.0
        out = np.clip(out, -clip, clip)
    return out * float(scale), running, metrics


# -- per domain ------------------------------------------------------------------------------------------

def domain_settings(options: Mapping[str, Any], domain: str | None) -> dict[str, Any]:
    """The settings of ``domain``: the defaults, then ``options``' own keys, then the domain's
    overrides (``options["domains"][domain]``)."""
    settings = dict(REWARD_PROCESSING_DEFAULTS)
    settings.update({k: v for k, v in options.items() if k in REWARD_OPTIONS})
    domains = options["domains"] if "domains" in options else REWARD_PROCESSING_OPTIONS["domains"].default_value()
    overrides = domains.get(domain) if domain is not None else None
    settings.update(overrides or {})
    return settings


@dataclass(frozen=True)
class ProcessedRewards:
    """What :func:`process_rewards` returns."""

    rewards: np.ndarray  # [B] float64, post-processed
    sample_mask: np.ndarray  # [B] float64, 1: trained on
    running: dict[str | None, RunningMoments]  # per domain, after this batch
    metrics: dict[str, float]  # per domain: "<domain>/<name>" (no domain: "<name>")


def process_rewards(rewards: np.ndarray, group_ids: Sequence[Hashable], truncated: np.ndarray,
                    domains: Sequence[str | None], options: Mapping[str, Any],
                    running: Mapping[str | None, RunningMoments] | None = None) -> ProcessedRewards:
    """:func:`get_sample_level_mask` then :func:`reward_postprocess`, for each domain's rows with
    that domain's settings (:func:`domain_settings`). Rows without a domain (``None``) use the
    top-level settings. Metrics per domain ``d`` are named ``d/<name>``: ``processed_reward_mean``,
    ``masked_frac`` (rows left out of the loss), ``truncated_frac`` and those of
    :func:`reward_postprocess`; rows without a domain give the bare names."""
    rewards = np.asarray(rewards, dtype=np.float64)
    truncated = np.asarray(truncated, dtype=bool)
    group_ids = list(group_ids)
    if not (len(group_ids) == len(domains) == rewards.shape[0] == truncated.shape[0]):
        raise ValueError(f"rewards ({rewards.shape[0]}), group_ids ({len(group_ids)}), truncated "
                         f"({truncated.shape[0]}) and domains ({len(domains)}) must have one entry per row")
    out = rewards.copy()
    mask = np.ones_like(rewards)
    states = dict(running or {})
    metrics: dict[str, float] = {}
    for domain in dict.fromkeys(domains):  # first-seen order
        rows = np.array([d == domain for d in domains], dtype=bool)
        settings = domain_settings(options, domain)
        ids = [g for g, keep in zip(group_ids, rows) if keep]
        mask[rows] = get_sample_level_mask(rewards[rows], ids, truncated[rows], overlong=settings["overlong"],
                                           mask_flat_groups=settings["mask_flat_groups"])
        post = {k: settings[k] for k in _POSTPROCESS_KEYS}
        out[rows], states[domain], extra = reward_postprocess(rewards[rows], ids, truncated[rows],
                                                              states.get(domain), **post)
        prefix = "" if domain is None else f"{domain}/"
        metrics[f"{prefix}processed_reward_mean"] = float(out[rows].mean())
        metrics[f"{prefix}masked_frac"] = float(1.0 - mask[rows].mean())
        metrics[f"{prefix}truncated_frac"] = float(truncated[rows].mean())
        metrics.update({f"{prefix}{k}": v for k, v in extra.items()})
    return ProcessedRewards(out, mask, states, metrics)


def response_truncated(trajectory: Mapping[str, Any], response_tokens: int) -> bool:
    """The response was cut off by the token limit (what ``overlong`` acts on): the backend says
    so (``finish_reason`` ``length``), or, when it does not say, the response has the
    ``max_tokens`` of its sampling record (``trajectory["sampling"]``)."""
    reason = trajectory.get("finish_reason")
    if reason is not None:
        return reason == "length"
    sampling = trajectory.get("sampling")
    limit = sampling.get("max_tokens") if isinstance(sampling, Mapping) else None
    return limit is not None and bool(limit) and response_tokens >= int(limit)


class RewardProcessor:
    """:func:`process_rewards` with the running statistics kept between calls (a trainer holds
    one; :meth:`state_dict` goes into its checkpoint, so a resumed run normalises as an
    uninterrupted one)."""

    def __init__(self, options: RewardProcessingSettings | Mapping[str, Any] | None = None):
        self.options = options.to_dict() if isinstance(options, RewardProcessingSettings) else dict(options or {})
        self.running: dict[str | None, RunningMoments] = {}

    def __call__(self, rewards: np.ndarray, group_ids: Sequence[Hashable], truncated: np.ndarray,
                 domains: Sequence[str | None]) -> ProcessedRewards:
        result = process_rewards(rewards, group_ids, truncated, domains, self.options, self.running)
        self.running = dict(result.running)
        return result

    def state_dict(self) -> dict[str, Any]:
        # JSON keys are strings: rows without a domain are stored under "".
        return {"" if d is None else d: m.to_dict() for d, m in self.running.items() if m.count}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.running = {(d or None): RunningMoments.from_dict(m) for d, m in state.items()}
