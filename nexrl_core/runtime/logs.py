"""Everything a run logs goes through loguru (and so into run.log), including what third-party
libraries log with the standard ``logging`` module; a failure that repeats (an evaluator raising
on many samples, a plugin hook failing every step) reaches the console once (:class:`FailureLog`)."""

from __future__ import annotations

import logging
import os
import re
import threading
import traceback
from types import FrameType

from loguru import logger

#: level from which records of the standard ``logging`` module are forwarded (libraries' chatter,
#: such as one INFO line per HTTP request, stays out)
STD_LOGGING_LEVEL = logging.WARNING


class ToLoguru(logging.Handler):
    """A ``logging`` handler that hands every record to loguru, naming the logger it came from."""

    def emit(self, record: logging.LogRecord) -> None:
        try:
            level: str | int = logger.level(record.levelname).name
        except ValueError:
            level = record.levelno
        frame: FrameType | None
        frame, depth = logging.currentframe(), 2  # point loguru at the caller, not at logging's internals
        while frame is not None and frame.f_code.co_filename == logging.__file__:
            frame, depth = frame.f_back, depth + 1
        logger.opt(depth=depth, exception=record.exc_info).log(level, f"{record.name}: {record.getMessage()}")


def route_std_logging(level: int = STD_LOGGING_LEVEL) -> None:
    """Forward records of the standard ``logging`` module (``level`` and above) to loguru.

    Idempotent. Libraries whose loggers keep their own handlers and do not propagate
    (``transformers`` does by default) are asked to propagate by the plugin that uses them.
    """
    root = logging.getLogger()
    for handler in [h for h in root.handlers if isinstance(h, ToLoguru)]:
        root.removeHandler(handler)
    root.addHandler(ToLoguru(level))
    if root.level == logging.NOTSET or root.level > level:
        root.setLevel(level)
    logging.captureWarnings(True)  # warnings.warn(...) of libraries: the 'py.warnings' logger


# -- failures that repeat --------------------------------------------------------------------------

def failure_location(exc: BaseException, prefer: str | None = None) -> str:
    """``file:line in function`` where ``exc`` was raised: the innermost frame under the folder
    ``prefer`` (a plugin's own code rather than the library it called), else the innermost frame."""
    frames = traceback.extract_tb(exc.__traceback__) if exc.__traceback__ is not None else []
    if not frames:
        return ""
    ours = [f for f in frames if prefer and os.path.abspath(f.filename).startswith(prefer.rstrip(os.sep) + os.sep)]
    frame = (ours or frames)[-1]
    return f"{_short_path(frame.filename)}:{frame.lineno} in {frame.name}"


def _short_path(path: str) -> str:
    marker = f"{os.sep}site-packages{os.sep}"
    if marker in path:
        return path.split(marker, 1)[1]
    rel = os.path.relpath(path)
    return rel if not rel.startswith("..") else path


def format_traceback(exc: BaseException) -> str:
    """The traceback as Python prints it, without local variables (they may hold secrets)."""
    return "".join(traceback.format_exception(type(exc), exc, exc.__traceback__)).rstrip()


def failure_signature(kind: str, message: str, exc: BaseException | None = None, prefer: str | None = None) -> str:
    """What makes two failures "the same error": the exception type and where it was raised, or,
    without an exception, the message with its numbers masked."""
    if exc is not None and exc.__traceback__ is not None:
        return f"{kind}|{type(exc).__name__}|{failure_location(exc, prefer)}"
    return f"{kind}|{re.sub(r'[0-9]+', '#', message)}"


class FailureLog:
    """Shows each distinct failure once on the console (``level``) and logs every occurrence to
    run.log (DEBUG), with the traceback of the first one. Thread-safe."""

    def __init__(self) -> None:
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()

    def log(self, signature: str, message: str, traceback_text: str | None = None, level: str = "WARNING",
            records: str = "run.log") -> bool:
        """Log one occurrence; True when it was the first of its signature."""
        with self._lock:
            count = self._seen.get(signature, 0) + 1
            self._seen[signature] = count
        if count > 1:
            logger.debug(f"{message} [occurrence {count} of this error]")
            return False
        logger.log(level, f"{message} [shown once: every occurrence is in {records}"
                          f"{', with the traceback in run.log' if traceback_text else ''}]")
        if traceback_text:
            logger.debug(f"traceback of the error above:\n{traceback_text}")
        return True

    def count(self, signature: str) -> int:
        with self._lock:
            return self._seen.get(signature, 0)


class _Demote(logging.Filter):
    def __init__(self, message_part: str, level: int):
        super().__init__()
        self.message_part, self.level = message_part, level

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno > self.level and self.message_part in record.getMessage():
            record.levelno, record.levelname = self.level, logging.getLevelName(self.level)
        return True


def demote_library_log(logger_name: str, message_part: str, level: str = "DEBUG") -> None:
    """Log the records of a library's standard ``logging`` logger whose message contains
    ``message_part`` at ``level`` instead: for routine protocol events a library reports as
    warnings (below WARNING they stay out of the console and run.log, see :data:`STD_LOGGING_LEVEL`)."""
    logging.getLogger(logger_name).addFilter(_Demote(message_part, logging.getLevelName(level)))
