"""ActivityTracker: in-flight work, module health, errors and experiment logging."""

from __future__ import annotations

import itertools
import threading
import time
from contextlib import contextmanager
from typing import Any, Iterator

from loguru import logger

from ..errors import ErrorReporter, ErrorSeverity
from .execute import execute


class ActivityTracker:
    """Central tracker; every module talks to it through an :class:`ActivityTrackerProxy`."""

    def __init__(self, config: Any = None, max_errors: int = 1000, experiment_logger: Any = None) -> None:
        self.experiment_logger = experiment_logger
        self._error_reporter = ErrorReporter(max_errors)
        self._cond = threading.Condition()
        self._in_flight: dict[str, tuple[str, str, float]] = {}
        self._tokens = itertools.count()
        self._modules: dict[str, Any] = {}
        self._rollout_workers: set[str] = set()
        self._training_step = 0

    # -- activity -------------------------------------------------------------
    def start(self, module: str, work: str) -> str:
        token = f"{module}:{next(self._tokens)}"
        with self._cond:
            self._in_flight[token] = (module, work, time.monotonic())
        return token

    def end(self, token: str) -> None:
        with self._cond:
            self._in_flight.pop(token, None)
            self._cond.notify_all()

    @contextmanager
    def track(self, module: str, work: str, auto_report_errors: bool = True) -> Iterator[None]:
        token = self.start(module, work)
        try:
            yield
        except Exception as exc:
            if auto_report_errors:
                self.report_exception(module, work, exc)
            raise
        finally:
            self.end(token)

    def is_quiescent(self) -> bool:
        with self._cond:
            return not self._in_flight

    def wait_quiescent(self, timeout: float | None = None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: not self._in_flight, timeout)

    def is_rollout_worker_quiescent(self) -> bool:
        with self._cond:
            return not any(m in self._rollout_workers for m, _, _ in self._in_flight.values())

    def get_running_status_summary(self) -> str:
        now = time.monotonic()
        with self._cond:
            items = sorted(self._in_flight.values(), key=lambda x: x[2])
        if not items:
            return "idle"
        return "; ".join(f"{m}/{w} for {now - t0:.1f}s" for m, w, t0 in items)

    # -- modules --------------------------------------------------------------
    def register_module(self, module_name: str, module_ref: Any, is_rollout_worker: bool = False) -> None:
        self._modules[module_name] = module_ref
        if is_rollout_worker:
            self._rollout_workers.add(module_name)

    def dead_modules(self, timeout: float = 5.0) -> list[str]:
        """Names of registered modules whose ``health_check`` fails or does not answer in time."""
        dead = []
        for name, ref in list(self._modules.items()):
            if not _answers_health_check(ref, timeout):
                dead.append(name)
        return dead

    def check_module_liveness(self, timeout: float = 5.0) -> bool:
        return not self.dead_modules(timeout)

    # -- errors ---------------------------------------------------------------
    @property
    def error_reporter(self) -> ErrorReporter:
        return self._error_reporter

    def report_exception(self, module: str, work: str, exception: BaseException,
                         severity: ErrorSeverity | None = None) -> str:
        logger.opt(exception=exception).error(f"{module}/{work}: {exception!r}")
        return self._error_reporter.report_exception(module, work, exception, severity or ErrorSeverity.ERROR)

    def report_error(self, module: str, work: str, message: str,
                     severity: ErrorSeverity = ErrorSeverity.ERROR, details: dict | None = None) -> str:
        logger.log(severity.name if severity.name != "CRITICAL" else "CRITICAL", f"{module}/{work}: {message}")
        return self._error_reporter.report_error(module, work, message, severity, details)

    def get_error_health_status(self) -> dict[str, Any]:
        return self._error_reporter.get_health_status()

    # -- training step and logging ---------------------------------------------
    def set_training_step(self, step: int) -> None:
        self._training_step = step

    def get_training_step(self) -> int:
        return self._training_step

    def experiment_logger_post(self, backend: str = "metrics", **kwargs: Any) -> None:
        if self.experiment_logger is not None:
            self.experiment_logger.post(backend, **kwargs)


def _answers_health_check(ref: Any, timeout: float) -> bool:
    result: list[bool] = []

    def call() -> None:
        try:
            result.append(bool(execute(ref.health_check)))
        except Exception:
            result.append(False)

    # A hung module must not hang the monitor: ask from a helper thread and stop waiting at timeout.
    t = threading.Thread(target=call, daemon=True, name="health-check")
    t.start()
    t.join(timeout)
    return bool(result and result[0])


class ActivityTrackerProxy:
    """What a module holds: forwards to the central tracker (local object or Ray actor)."""

    def __init__(self, central_tracker: Any):
        self._tracker = central_tracker

    @contextmanager
    def track(self, module: str, work: str, auto_report_errors: bool = True) -> Iterator[None]:
        token = execute(self._tracker.start, module, work)
        try:
            yield
        except Exception as exc:
            if auto_report_errors:
                execute(self._tracker.report_exception, module, work, exc)
            raise
        finally:
            execute(self._tracker.end, token)

    def is_rollout_worker_quiescent(self) -> bool:
        return execute(self._tracker.is_rollout_worker_quiescent)

    def report_exception(self, module: str, work: str, exception: BaseException,
                         severity: ErrorSeverity | None = None) -> str:
        return execute(self._tracker.report_exception, module, work, exception, severity)

    def report_error(self, module: str, work: str, message: str,
                     severity: ErrorSeverity = ErrorSeverity.ERROR, details: dict | None = None) -> str:
        return execute(self._tracker.report_error, module, work, message, severity, details)

    def set_training_step(self, step: int) -> None:
        execute(self._tracker.set_training_step, step)

    def get_training_step(self) -> int:
        return execute(self._tracker.get_training_step)

    def experiment_logger_post(self, backend: str = "metrics", **kwargs: Any) -> None:
        execute(self._tracker.experiment_logger_post, backend, **kwargs)
