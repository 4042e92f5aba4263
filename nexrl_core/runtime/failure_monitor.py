"""Failure that reads as success: a run whose training samples mostly fail must stop.

A failed sample (the rollout or the evaluator raised, a bad reward...) is recorded and the
run goes on; that is right for a few, wrong when an evaluator raises on every sample and the
trainer trains on nothing. :class:`FailedSampleMonitor` keeps the outcome of the last
``window`` training samples the trainer consumed and says when more than ``max_fraction`` of
them failed (``runtime_monitor.failed_samples``), naming the evaluator and the commonest error.
"""

from __future__ import annotations

import threading
from collections import Counter, deque
from collections.abc import Mapping
from typing import Any

from ..config.schema import RecipeSettings, RolloutWorkerSettings, RuntimeMonitorSettings, TrajectoryPoolSettings


def most_common_error(failures: list[tuple[str, str]]) -> str:
    """``cause (count): first message of that cause`` for the commonest cause, or ''."""
    if not failures:
        return ""
    counts = Counter(cause for cause, _ in failures)
    cause, count = counts.most_common(1)[0]
    example = next(message for c, message in failures if c == cause)
    return f"{cause} ({count} of {len(failures)}): {_short(example)}"


def _short(text: str, limit: int = 240) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


class FailedSampleMonitor:
    """Outcomes of the recent training samples; thread-safe (the trainer writes, the monitor reads)."""

    def __init__(self, max_fraction: float = 0.5, window: int = 64, min_samples: int = 1,
                 evaluator: str | None = None, enabled: bool = True):
        self.max_fraction = float(max_fraction)
        self.window = int(window)
        self.min_samples = max(1, min(int(min_samples), self.window))
        self.evaluator = evaluator
        self.enabled = enabled
        self._recent: deque[tuple[str, str] | None] = deque(maxlen=self.window)  # None: a usable sample
        self._lock = threading.Lock()
        self._verdict: str | None = None

    @classmethod
    def from_config(cls, settings: RecipeSettings | Mapping[str, Any]) -> FailedSampleMonitor:
        """``runtime_monitor.failed_samples`` of the run (of the recipe mapping: the three sections it reads)."""
        if isinstance(settings, RecipeSettings):
            monitor, workers, pool = settings.runtime_monitor, settings.rollout_worker, settings.trajectory_pool
        else:
            monitor = RuntimeMonitorSettings.of(settings["runtime_monitor"], "runtime_monitor")
            workers = RolloutWorkerSettings.own(settings["rollout_worker"], "rollout_worker")
            pool = TrajectoryPoolSettings.of(settings["trajectory_pool"], "trajectory_pool")
        failed, evaluator = monitor.failed_samples, workers.evaluator
        return cls(max_fraction=failed.max_fraction, window=failed.window, min_samples=pool.batch_size,
                   evaluator=evaluator.type if evaluator is not None else None, enabled=failed.enabled)

    def observe(self, num_ok: int, failures: list[tuple[str, str]]) -> None:
        """One training step: ``num_ok`` usable samples and the (cause, message) of each failed one."""
        with self._lock:
            self._recent.extend(failures)
            self._recent.extend([None] * int(num_ok))
            if self.enabled and self._verdict is None:
                self._verdict = self._judge()

    def _judge(self) -> str | None:
        seen = len(self._recent)
        failed = [f for f in self._recent if f is not None]
        if seen < self.min_samples or len(failed) <= self.max_fraction * seen:
            return None
        evaluator = f"evaluator '{self.evaluator}'" if self.evaluator else "no evaluator"
        return (f"{len(failed)} of the last {seen} training samples failed (more than "
                f"runtime_monitor.failed_samples.max_fraction={self.max_fraction:g}); rollout_worker.evaluator: "
                f"{evaluator}; most common error: {most_common_error(failed)}")

    def verdict(self) -> str | None:
        """Why the run must stop, once the failed fraction passed the threshold (then stays set)."""
        with self._lock:
            return self._verdict
