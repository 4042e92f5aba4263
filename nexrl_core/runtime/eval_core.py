"""The evaluation core: pure bookkeeping shared by training-time validation and `nexrl eval`.

The semantics (what a sample is, each metric's denominator, failed samples,
pass@k) are defined in docs/evaluation.md; this module implements exactly that
page and the tests in tests/core/test_eval_core.py cite it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

from ..types import trajectory_reward

#: a sample's data source when its row has no ``data_source`` field
DEFAULT_DATA_SOURCE = "default"


class DuplicateSampleError(ValueError):
    """The same (uid, sample_index) arrived twice: a sample must count exactly once."""


@dataclass(frozen=True)
class SampleRecord:
    uid: str
    sample_index: int
    data_source: str
    scores: dict[str, float]
    failed: bool = False
    error: str | None = None
    domain: str | None = None
    tag: str | None = None  # the row's ``tag`` (ROLL's grouping of validation metrics)

    @staticmethod
    def from_trajectory(traj: Mapping[str, Any]) -> SampleRecord:
        return SampleRecord(
            uid=str(traj.get("uid")),
            sample_index=int(traj.get("sample_index") or 0),
            data_source=str(traj.get("data_source") or DEFAULT_DATA_SOURCE),
            scores={} if traj.get("failed") else {k: float(v) for k, v in (traj.get("score") or {}).items()},
            failed=bool(traj.get("failed")),
            error=traj.get("error"),
            domain=None if traj.get("domain") is None else str(traj["domain"]),
            tag=_tag(traj),
        )


def _tag(traj: Mapping[str, Any]) -> str | None:
    task = traj.get("task")
    tag = traj.get("tag", task.get("tag") if isinstance(task, dict) else None)
    return None if tag is None else str(tag)


@dataclass(frozen=True)
class EvalState:
    samples: dict[tuple[str, int], SampleRecord] = field(default_factory=dict)


def add_sample(state: EvalState, record: SampleRecord) -> EvalState:
    """Reducer step: a new state with ``record`` added (duplicates are an error)."""
    key = (record.uid, record.sample_index)
    if key in state.samples:
        raise DuplicateSampleError(f"validation sample {key} was counted twice")
    return EvalState({**state.samples, key: record})


def summarize(state: EvalState, *, expected_samples: int | None = None, n_samples: int = 1,
              success_threshold: float = 1.0, prefix: str = "val/") -> dict[str, float]:
    """Metrics of docs/evaluation.md. Failed samples count in every denominator with score 0."""
    # In sample order, not arrival order: float sums must not depend on which worker finished first.
    records = [state.samples[key] for key in sorted(state.samples)]
    total = len(records)
    keys = sorted({k for r in records for k in r.scores} | {"reward"})
    out: dict[str, float] = {}
    for key in keys:
        out[f"{prefix}{key}"] = _mean([r.scores.get(key, 0.0) for r in records])
    subsets = _subsets(records)
    domains = {r.domain for r in records if r.domain is not None}
    for name, subset in subsets.items():
        # A domain has its own evaluator: only the keys its samples reported (another domain's
        # evaluator metrics are not zeros of this one).
        own = sorted({k for r in subset for k in r.scores} | {"reward"}) if name in domains else keys
        for key in own:
            out[f"{prefix}{name}_{key}"] = _mean([r.scores.get(key, 0.0) for r in subset])
    out[f"{prefix}num_samples"] = float(total)
    out[f"{prefix}num_failed"] = float(sum(r.failed for r in records))
    # every validation: the share of samples that count as solved (the seed's val_correct/all/mean)
    out[f"{prefix}success_rate"] = _success_rate(records, success_threshold)
    tags = sorted({r.tag for r in records if r.tag is not None})
    if tags:  # rows with a tag: success rate and reward per tag (a row without one is tagged "none")
        for tag in tags + (["none"] if any(r.tag is None for r in records) else []):
            subset = [r for r in records if (r.tag or "none") == tag]
            out[f"{prefix}{tag}/success_rate"] = _success_rate(subset, success_threshold)
            out[f"{prefix}{tag}/reward"] = _mean([r.scores.get("reward", 0.0) for r in subset])
            out[f"{prefix}{tag}/num_samples"] = float(len(subset))
    if expected_samples is not None:
        out[f"{prefix}num_missing"] = float(max(expected_samples - total, 0))
    if n_samples > 1:
        out[f"{prefix}num_prompts"] = float(len({r.uid for r in records}))
        out.update(_pass_metrics(records, n_samples, success_threshold, prefix))
        for name, subset in subsets.items():
            out.update(_pass_metrics(subset, n_samples, success_threshold, f"{prefix}{name}_"))
    return out


def _subsets(records: list[SampleRecord]) -> dict[str, list[SampleRecord]]:
    """The samples of each data source and of each domain, by name (a domain's name wins over a
    data source of the same name). None when the only one is ``default`` (rows without a
    ``data_source``): its metrics would repeat the overall ones under a name no data set has."""
    domains = {r.domain for r in records if r.domain is not None}
    out = {source: [r for r in records if r.data_source == source]
           for source in sorted({r.data_source for r in records}) if source not in domains}
    out.update({domain: [r for r in records if r.domain == domain] for domain in sorted(domains)})
    if set(out) == {DEFAULT_DATA_SOURCE}:
        return {}
    return dict(sorted(out.items()))


def _pass_metrics(records: list[SampleRecord], n_samples: int, success_threshold: float,
                  prefix: str) -> dict[str, float]:
    """``mean@n`` and the unbiased ``pass@1`` / ``pass@n`` of ``records``, averaged over prompts."""
    by_prompt: dict[str, list[SampleRecord]] = {}
    for r in records:
        by_prompt.setdefault(r.uid, []).append(r)
    out = {f"{prefix}mean@{n_samples}": _mean([r.scores.get("reward", 0.0) for r in records])}
    for k in sorted({1, n_samples}):
        # A prompt with fewer than n_samples recorded samples (an interrupted validation,
        # reported in num_missing) counts its missing samples as incorrect: never an overestimate.
        out[f"{prefix}pass@{k}"] = _mean([
            pass_at_k(max(len(group), n_samples),
                      sum(r.scores.get("reward", 0.0) >= success_threshold for r in group), k)
            for group in by_prompt.values()
        ])
    return out


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from ``n`` samples of which ``c`` are correct (Chen et al. 2021)."""
    if k > n:
        raise ValueError(f"pass@{k} needs at least {k} samples per prompt, got {n}")
    if n - c < k:
        return 1.0
    return 1.0 - comb(n - c, k) / comb(n, k)


def _success_rate(records: list[SampleRecord], success_threshold: float) -> float:
    """Samples whose reward reaches ``success_threshold``, over every sample (failed ones count 0)."""
    return _mean([float(r.scores.get("reward", 0.0) >= success_threshold) for r in records])


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0


# -- training metrics per domain (docs/evaluation.md §Training metrics per domain) --------------

def training_domain_metrics(trajectories: Sequence[Mapping[str, Any]],
                            dropped_groups: list[dict[str, Any]] | None = None) -> dict[str, float]:
    """Per-domain metrics of one training step, ``train/<domain>/<name>``, for the trajectories of
    the batch that carry a ``domain``. ``dropped_groups`` (dynamic sampling: ``{"domain",
    "rewards"}`` of each group dropped since the previous batch; None when dynamic sampling is
    off) adds ``dropped_groups`` and ``sampled_reward_mean``, per domain and overall."""
    used = [t for t in trajectories if not t.get("failed")]
    domains = sorted({str(t["domain"]) for t in trajectories if t.get("domain") is not None}
                     | {str(g["domain"]) for g in dropped_groups or [] if g.get("domain") is not None})
    out: dict[str, float] = {}
    for domain in domains:
        mine = [t for t in used if t.get("domain") == domain]
        p = f"train/{domain}/"
        out[f"{p}reward_mean"] = _mean([trajectory_reward(t) for t in mine])
        out[f"{p}num_trajectories"] = float(len(mine))
        out[f"{p}num_failed"] = float(sum(1 for t in trajectories if t.get("failed") and t.get("domain") == domain))
        out[f"{p}num_groups"] = float(len({t.get("uid") for t in trajectories if t.get("domain") == domain}))
        out[f"{p}response_length_mean"] = _mean([float(len(t.get("response_token_ids") or ())) for t in mine])
        for key in sorted({k for t in mine for k in (t.get("score") or {})} - {"reward"}):
            out[f"{p}{key}_mean"] = _mean([float((t.get("score") or {}).get(key, 0.0)) for t in mine])
    if dropped_groups is not None:
        out.update(_sampled_metrics(used, dropped_groups, "train/"))
        for domain in domains:
            out.update(_sampled_metrics([t for t in used if t.get("domain") == domain],
                                        [g for g in dropped_groups if g.get("domain") == domain],
                                        f"train/{domain}/"))
    return out


def _sampled_metrics(used: Sequence[Mapping[str, Any]], dropped: list[dict[str, Any]], prefix: str) -> dict[str, float]:
    rewards = [trajectory_reward(t) for t in used] + [float(r) for g in dropped for r in g["rewards"]]
    return {f"{prefix}dropped_groups": float(len(dropped)), f"{prefix}sampled_reward_mean": _mean(rewards)}
