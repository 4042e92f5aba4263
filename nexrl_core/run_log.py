"""Run outputs: metrics.jsonl, errors.jsonl, log file, and experiment-logger sinks."""

from __future__ import annotations

import json
import math
import os
import sys
import threading
import time
from typing import Any

from loguru import logger


METRICS_FILE = "metrics.jsonl"
ERRORS_FILE = "errors.jsonl"
LOG_FILE = "run.log"


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    if hasattr(value, "item"):
        return value.item()
    return value


class RunRecorder:
    """Owns the run directory's record files; safe to call from any thread."""

    def __init__(self, run_dir: str, sinks: list[Any] | None = None, step_end_hook: Any = None):
        self.run_dir = run_dir
        os.makedirs(run_dir, exist_ok=True)
        self._sinks = list(sinks or [])
        self._step_end_hook = step_end_hook
        self._lock = threading.Lock()
        self._metrics_path = os.path.join(run_dir, METRICS_FILE)
        self._errors_path = os.path.join(run_dir, ERRORS_FILE)
        self.lost_items = 0

    # ActivityTracker.experiment_logger_post lands here.
    def post(self, backend: str = "metrics", data: dict[str, Any] | None = None, step: int | None = None,
             **kwargs: Any) -> None:
        if data:
            self.log_metrics(data, step if step is not None else 0)

    def log_metrics(self, data: dict[str, Any], step: int) -> None:
        row = {"step": int(step), **{k: _jsonable(v) for k, v in data.items()}}
        with self._lock:
            with open(self._metrics_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, sort_keys=True) + "\n")
        for sink in self._sinks:
            sink.log(dict(data), int(step))
        if self._step_end_hook is not None and any(k.startswith("train/") for k in data):
            self._step_end_hook(step=int(step), metrics=dict(data))

    def record_lost_item(self, task: dict[str, Any], cause: str, message: str, validating: bool = False,
                         step: int | None = None) -> None:
        """One line of errors.jsonl: an item that ended failed (see docs/reliability.md).

        ``step``: the training step that consumed the failed item, or for a validation
        sample the step (weight version) being validated.
        """
        row = {"time": time.time(), "cause": cause, "message": message, "validation": bool(validating),
               "step": step, "uid": task.get("uid"), "sample_index": task.get("sample_index"),
               "seq": task.get("seq"), "item": {k: v for k, v in task.items() if k not in ("seq",)}}
        with self._lock:
            self.lost_items += 1
            with open(self._errors_path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row, default=str) + "\n")

    def truncate_after(self, step: int) -> None:
        """For a resume from ``step``: keep what that checkpoint already covers.

        metrics.jsonl and errors.jsonl alike: training rows up to ``step`` stay;
        validation rows of ``step`` itself are dropped because the resumed run
        validates that step again. A torn last line (the process was killed
        mid-write) is dropped too.
        """
        with self._lock:
            for path, keep in ((self._metrics_path, _keep_metric_row(step)),
                               (self._errors_path, _keep_error_row(step))):
                if not os.path.exists(path):
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    rows = [line for line in f if line.strip()]
                kept = []
                for line in rows:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and keep(row):
                        kept.append(line if line.endswith("\n") else line + "\n")
                tmp = path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.writelines(kept)
                os.replace(tmp, path)

    def close(self) -> None:
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # a sink failing at exit must not hide the run's result
                logger.warning(f"closing {type(sink).__name__}: {exc}")


def _keep_metric_row(step: int):
    def keep(row: dict[str, Any]) -> bool:
        s = int(row.get("step", 0))
        return s < step or (s == step and not any(k.startswith("val/") for k in row))
    return keep


def _keep_error_row(step: int):
    def keep(row: dict[str, Any]) -> bool:
        if row.get("step") is None:  # written before rows carried a step: keep
            return True
        s = int(row["step"])
        return s < step or (s == step and not row.get("validation"))
    return keep


def setup_logging(run_dir: str | None, level: str = "INFO") -> None:
    from .runtime.logs import route_std_logging

    route_std_logging()
    logger.remove()
    logger.add(sys.stderr, level=level, format="<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}")
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        logger.add(os.path.join(run_dir, LOG_FILE), level="DEBUG", enqueue=False)
