"""Validator: collects validation trajectories and reports the seed's metrics."""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import Any

from loguru import logger

from .config.schema import ValidateSettings
from .errors import ErrorSeverity
from .protocols import TaskSource, wired
from .runtime.eval_core import DuplicateSampleError, EvalState, SampleRecord, add_sample, summarize
from .runtime.execute import execute
from .runtime.module import NexRLModule
from .types import Trajectory


class Validator(NexRLModule):
    def __init__(self, settings: ValidateSettings | Mapping[str, Any] | None = None):
        """``settings``: the run's (a mapping, as a test writes one, is read as the recipe's section)."""
        super().__init__()
        settings = ValidateSettings.of(settings, "validate")
        self._n_samples = settings.n_samples
        self._success_threshold = settings.success_threshold
        self._state = EvalState()
        self._trajectories: list[Trajectory] = []
        self._lock = threading.Lock()
        self._validate_dataloader: TaskSource | None = None
        self.last_metrics: dict[str, float] = {}

    def _health_locks(self) -> dict[str, Any]:
        return {"validator": self._lock}

    def set_module_references(self, validate_dataloader: TaskSource | None) -> None:
        self._validate_dataloader = validate_dataloader

    def put_trajectory(self, trajectory: Trajectory) -> str:
        record = SampleRecord.from_trajectory(trajectory)
        with self._lock:
            try:
                self._state = add_sample(self._state, record)
            except DuplicateSampleError as exc:
                if self._activity_tracker is not None:
                    self._activity_tracker.report_error("validator", "put_trajectory", str(exc), ErrorSeverity.ERROR)
                return "fail"
            self._trajectories.append(trajectory)
        return "success"

    def put_trajectories(self, trajectories: list[Trajectory]) -> list[str]:
        """:meth:`put_trajectory` for each, in order (one call for several)."""
        return [self.put_trajectory(t) for t in trajectories]

    def is_complete(self) -> bool:
        return bool(execute(wired(self._validate_dataloader, "validation data loader").is_finished)) and \
            self._activity_tracker.is_rollout_worker_quiescent()

    def expected_samples(self) -> int | None:
        if self._validate_dataloader is None:
            return None
        return execute(self._validate_dataloader.num_rows) * self._n_samples

    def compute_metrics(self) -> dict[str, float]:
        with self._lock:
            state = self._state
        return summarize(state, expected_samples=self.expected_samples(), n_samples=self._n_samples,
                         success_threshold=self._success_threshold)

    def compute_and_log_metrics(self, step: int | None = None) -> dict[str, float]:
        metrics = self.compute_metrics()
        if metrics.get("val/num_missing"):
            logger.error(f"validation is missing {int(metrics['val/num_missing'])} samples")
        if self._activity_tracker is not None:
            if step is None:
                step = self._activity_tracker.get_training_step()
            self._activity_tracker.experiment_logger_post("metrics", data=metrics, step=step)
        self.last_metrics = metrics
        return metrics

    def trajectories(self) -> list[Trajectory]:
        with self._lock:
            return list(self._trajectories)

    def clear(self) -> None:
        with self._lock:
            self._state = EvalState()
            self._trajectories = []
