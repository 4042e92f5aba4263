"""ActivityTracker: in-flight work, module health, errors and the run's records.

Modules reach the tracker only through an :class:`ActivityTrackerProxy` (its public methods
are everything a module may ask for); the controller only through ``execute`` on the
tracker's public methods. So the tracker can live in another process than both.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Mapping
from contextlib import contextmanager
from typing import Any, Iterator

from loguru import logger

from ..errors import ErrorInfo, ErrorReporter, ErrorSeverity
from .execute import ModuleUnavailable, RpcTimeout, execute, execute_with_timeout
from .logs import FailureLog, failure_signature, format_traceback


class ActivityTracker:
    """Central tracker; every module talks to it through an :class:`ActivityTrackerProxy`.

    ``experiment_logger``: the run's records (metrics.jsonl, errors.jsonl, the ``logger.backend``
    sinks), opened by the launcher in the tracker's process (nexrl_core.launch.parts); ``config``
    (the recipe) is the argument every role is built with.
    """

    def __init__(self, config: Mapping[str, Any] | None = None, max_errors: int = 1000,
                 experiment_logger: Any = None) -> None:
        self.experiment_logger = experiment_logger
        self._error_reporter = ErrorReporter(max_errors)
        self._failure_log = FailureLog()
        self._cond = threading.Condition()
        self._in_flight: dict[str, tuple[str, str, float]] = {}
        self._tokens = itertools.count()
        self._modules: dict[str, Any] = {}
        self._rollout_workers: set[str] = set()
        self._training_step = 0
        self._health_problems: dict[str, str] = {}
        self._run_stopping: set[str] = set()  # severities the controller's error policy ends the run on

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

    def wait_quiescent(self, timeout: float | None = None, ignore: list[str] | None = None) -> bool:
        """Wait until no work is in flight; work of the modules in ``ignore`` (dead ones, whose work
        will never end) does not count."""
        skip = set(ignore or ())
        with self._cond:
            return self._cond.wait_for(lambda: not any(m not in skip for m, _, _ in self._in_flight.values()),
                                       timeout)

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
        """Names of registered modules whose ``health_check`` fails, raises (a module that is gone)
        or does not answer within ``timeout`` seconds (why: :meth:`last_health_problems`)."""
        problems = {}
        for name, ref in list(self._modules.items()):
            problem = _health_problem(ref, timeout)
            if problem is not None:
                problems[name] = problem
        self._health_problems = problems
        return list(problems)

    def last_health_problems(self) -> dict[str, str]:
        """Module name -> why it failed the last :meth:`dead_modules` check."""
        return dict(self._health_problems)

    def check_module_liveness(self, timeout: float = 5.0) -> bool:
        return not self.dead_modules(timeout)

    # -- errors ---------------------------------------------------------------
    @property
    def error_reporter(self) -> ErrorReporter:
        return self._error_reporter

    def get_errors(self) -> list[ErrorInfo]:
        """Every error reported so far, oldest first."""
        return self._error_reporter.errors()

    def set_run_stopping_severities(self, severities: list[str]) -> None:
        """The severities (``error``, ``critical``) on which the controller's error policy ends the
        run (``runtime_monitor.exception_handling``). Such an error is shown once, in the run's
        final ``error:`` line; here it only goes to run.log, with its traceback."""
        self._run_stopping = {str(s) for s in severities}

    def report_exception(self, module: str, work: str, exception: BaseException,
                         severity: ErrorSeverity | None = None, console: bool = True) -> str:
        """Record an exception. The console gets one line per distinct error (no traceback, no local
        variables: they may hold secrets and prompts); run.log gets every one with its traceback.
        ``console=False``: the caller's error is shown elsewhere (a trainer's, in the run's final line)."""
        severity = severity or ErrorSeverity.ERROR
        self._log(severity, f"{module}/{work}: {type(exception).__name__}: {exception}",
                  failure_signature(f"{module}/{work}", str(exception), exception), format_traceback(exception),
                  console, "run.log")
        return self._error_reporter.report_exception(module, work, exception, severity)

    def report_error(self, module: str, work: str, message: str,
                     severity: ErrorSeverity = ErrorSeverity.ERROR, details: dict | None = None) -> str:
        """Record an error; ``details["signature"]`` marks one that may repeat (a failed sample):
        the console shows each signature once, run.log every occurrence (and ``details["traceback"]``)."""
        details = details or {}
        signature = details.get("signature")
        self._log(severity, message if signature is not None else f"{module}/{work}: {message}", signature,
                  details.get("traceback"), True, "run.log and errors.jsonl")
        return self._error_reporter.report_error(module, work, message, severity, details)

    def _log(self, severity: ErrorSeverity, message: str, signature: str | None, traceback_text: str | None,
             console: bool, records: str) -> None:
        if not console or severity.value in self._run_stopping:
            logger.debug(message + (f"\n{traceback_text}" if traceback_text else ""))
        elif signature is None:
            logger.log(severity.name, message)
            if traceback_text:
                logger.debug(f"traceback of the error above:\n{traceback_text}")
        else:
            self._failure_log.log(signature, message, traceback_text, severity.name, records=records)

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

    def recorded_rows(self, cursor: int = 0) -> tuple[list[dict[str, Any]], int]:
        """Metrics rows recorded since ``cursor`` and the next cursor: how the driver's listeners
        (the progress display) follow the run wherever the tracker lives."""
        rows_since = getattr(self.experiment_logger, "rows_since", None)
        return rows_since(cursor) if rows_since is not None else ([], cursor)

    # -- the run's records (errors.jsonl, samples.jsonl, resume) ------------------------
    def record_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Lines of samples.jsonl (see :meth:`nexrl_core.runtime.run_log.RunRecorder.record_samples`)."""
        if self.experiment_logger is not None and hasattr(self.experiment_logger, "record_samples"):
            self.experiment_logger.record_samples(step, samples)

    def record_lost_item(self, task: dict[str, Any], cause: str, message: str, validating: bool = False,
                         step: int | None = None, detail: dict[str, Any] | None = None) -> None:
        """One line of errors.jsonl (see :meth:`nexrl_core.runtime.run_log.RunRecorder.record_lost_item`)."""
        if self.experiment_logger is not None:
            self.experiment_logger.record_lost_item(task, cause, message, validating, step, detail)

    def truncate_records_after(self, step: int) -> None:
        """A resume from ``step``: drop records the resumed run writes again."""
        if self.experiment_logger is not None:
            self.experiment_logger.truncate_after(step)

    def failed_samples_verdict(self) -> str | None:
        """Why the run must stop because most recent training samples failed, or None
        (``runtime_monitor.failed_samples``, see :mod:`nexrl_core.runtime.failure_monitor`)."""
        monitor = getattr(self.experiment_logger, "failure_monitor", None)
        return monitor.verdict() if monitor is not None else None

    def close(self) -> None:
        """Close the run's records and sinks (the run is over)."""
        if self.experiment_logger is not None:
            self.experiment_logger.close()


def _health_problem(ref: Any, timeout: float) -> str | None:
    # A hung module must not hang the monitor (execute_with_timeout stops waiting); a module that
    # is gone raises from execute: both count as dead.
    try:
        if execute_with_timeout(timeout, ref.health_check):
            return None
    except RpcTimeout:
        return f"no answer within {timeout:g}s"
    except Exception as exc:
        return str(exc) if isinstance(exc, ModuleUnavailable) else f"{type(exc).__name__}: {exc}"
    try:  # the reason, where the module gives one
        why = execute_with_timeout(timeout, ref.health_problem) if hasattr(ref, "health_problem") else None
    except Exception:
        why = None
    return str(why) if why else "its health check says unhealthy"


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
                         severity: ErrorSeverity | None = None, console: bool = True) -> str:
        return execute(self._tracker.report_exception, module, work, exception, severity, console)

    def report_error(self, module: str, work: str, message: str,
                     severity: ErrorSeverity = ErrorSeverity.ERROR, details: dict | None = None) -> str:
        return execute(self._tracker.report_error, module, work, message, severity, details)

    def set_training_step(self, step: int) -> None:
        execute(self._tracker.set_training_step, step)

    def get_training_step(self) -> int:
        return execute(self._tracker.get_training_step)

    def experiment_logger_post(self, backend: str = "metrics", **kwargs: Any) -> None:
        execute(self._tracker.experiment_logger_post, backend, **kwargs)

    def record_lost_item(self, task: dict[str, Any], cause: str, message: str, validating: bool = False,
                         step: int | None = None, detail: dict[str, Any] | None = None) -> None:
        execute(self._tracker.record_lost_item, task, cause, message, validating, step, detail)

    def record_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        execute(self._tracker.record_samples, step, samples)
