"""User-facing errors and the seed's ErrorReporter."""

from __future__ import annotations

import threading
import time
import traceback
import uuid
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class NexRLError(Exception):
    """A problem the user can fix. The CLI prints the message alone, no traceback."""


class ConfigError(NexRLError):
    """A recipe key is missing, unknown, of the wrong type or inconsistent."""


class DataError(NexRLError):
    """A data file is missing, empty or malformed (message names ``file:line``)."""


class PluginError(NexRLError):
    """A plugin failed to load, conflicts with another or registered a bad class."""


def exit_code(exc: BaseException) -> int:
    """The ``nexrl`` command's exit code for an error: 2 bad input (nothing ran), 1 anything else."""
    return 2 if isinstance(exc, (ConfigError, DataError, PluginError)) else 1


class ErrorSeverity(Enum):
    INFO = "info"
    WARNING = "warning"
    ERROR = "error"
    CRITICAL = "critical"


@dataclass
class ErrorInfo:
    error_id: str
    timestamp: float
    module_name: str
    work_context: str
    severity: ErrorSeverity
    message: str
    details: dict[str, Any] = field(default_factory=dict)
    exception_type: str | None = None
    exception_traceback: str | None = None


class ErrorReporter:
    """Collects errors from every module; the controller's error policy reads its health."""

    def __init__(self, max_errors: int = 1000):
        self._errors: deque[ErrorInfo] = deque(maxlen=max_errors)
        self._counts = {s: 0 for s in ErrorSeverity}
        self._lock = threading.Lock()

    def report_exception(self, module_name: str, work_context: str, exception: BaseException,
                         severity: ErrorSeverity = ErrorSeverity.ERROR,
                         details: dict[str, Any] | None = None) -> str:
        tb = "".join(traceback.format_exception(type(exception), exception, exception.__traceback__))
        return self._add(module_name, work_context, f"{type(exception).__name__}: {exception}", severity,
                         details, type(exception).__name__, tb)

    def report_error(self, module_name: str, work_context: str, message: str,
                     severity: ErrorSeverity = ErrorSeverity.ERROR,
                     details: dict[str, Any] | None = None) -> str:
        return self._add(module_name, work_context, message, severity, details, None, None)

    def _add(self, module_name, work_context, message, severity, details, exc_type, tb) -> str:
        info = ErrorInfo(uuid.uuid4().hex[:12], time.time(), module_name, work_context, severity, message,
                         dict(details or {}), exc_type, tb)
        with self._lock:
            self._errors.append(info)
            self._counts[severity] += 1
        return info.error_id

    def errors(self) -> list[ErrorInfo]:
        with self._lock:
            return list(self._errors)

    def get_health_status(self) -> dict[str, Any]:
        with self._lock:
            counts = dict(self._counts)
            last = self._errors[-1] if self._errors else None
        if counts[ErrorSeverity.CRITICAL]:
            status = "critical"
        elif counts[ErrorSeverity.ERROR]:
            status = "error"
        elif counts[ErrorSeverity.WARNING]:
            status = "warning"
        else:
            status = "healthy"
        message = "no errors" if last is None else f"{last.module_name}/{last.work_context}: {last.message}"
        return {
            "status": status,
            "message": message,
            "recent_error_count": sum(counts.values()),
            "critical_level_count": counts[ErrorSeverity.CRITICAL],
            "error_level_count": counts[ErrorSeverity.ERROR],
            "warning_level_count": counts[ErrorSeverity.WARNING],
        }
