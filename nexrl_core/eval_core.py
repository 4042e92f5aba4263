"""The evaluation core: pure bookkeeping shared by training-time validation and `nexrl eval`.

The semantics (what a sample is, each metric's denominator, failed samples,
pass@k) are defined in docs/evaluation.md; this module implements exactly that
page and the tests in tests/core/test_eval_core.py cite it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from math import comb
from typing import Any


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

    @staticmethod
    def from_trajectory(traj: dict[str, Any]) -> SampleRecord:
        return SampleRecord(
            uid=str(traj.get("uid")),
            sample_index=int(traj.get("sample_index") or 0),
            data_source=str(traj.get("data_source") or "default"),
            scores={} if traj.get("failed") else {k: float(v) for k, v in (traj.get("score") or {}).items()},
            failed=bool(traj.get("failed")),
            error=traj.get("error"),
        )


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
    sources = sorted({r.data_source for r in records})
    out: dict[str, float] = {}
    for key in keys:
        out[f"{prefix}{key}"] = _mean([r.scores.get(key, 0.0) for r in records])
    for source in sources:
        subset = [r for r in records if r.data_source == source]
        for key in keys:
            out[f"{prefix}{source}_{key}"] = _mean([r.scores.get(key, 0.0) for r in subset])
    out[f"{prefix}num_samples"] = float(total)
    out[f"{prefix}num_failed"] = float(sum(r.failed for r in records))
    if expected_samples is not None:
        out[f"{prefix}num_missing"] = float(max(expected_samples - total, 0))
    if n_samples > 1:
        by_prompt: dict[str, list[SampleRecord]] = {}
        for r in records:
            by_prompt.setdefault(r.uid, []).append(r)
        out[f"{prefix}num_prompts"] = float(len(by_prompt))
        out[f"{prefix}mean@{n_samples}"] = out[f"{prefix}reward"]
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


def _mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else 0.0
