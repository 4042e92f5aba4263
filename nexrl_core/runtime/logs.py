"""Everything a run logs goes through loguru (and so into run.log), including what third-party
libraries log with the standard ``logging`` module."""

from __future__ import annotations

import logging

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
