"""``MetricsSink``: what a ``logger.backend`` receives (the ``nexrl_metrics_sinks`` hook registers them)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from typing import Any, ClassVar

from ..config.settings import Settings


class MetricsSink(ABC):
    """Base of a metrics sink (``logger.backend: <name>``), built as ``cls(config, run_dir)`` with the
    whole recipe and the run directory (None: the run writes no files).

    The run's recorder calls :meth:`log` once per metrics row; a sink that raises is reported once
    and the run goes on. Subclassing is optional (a class with the same methods is accepted), but
    gives the do-nothing defaults below.
    """

    #: the sink's own recipe keys, under ``logger.<name>``: a :class:`nexrl_core.Settings` class
    #: (None: it takes none)
    SETTINGS: ClassVar[type[Settings] | None] = None

    def __init__(self, config: Mapping[str, Any], run_dir: str | None) -> None:
        self.config = config
        self.run_dir = run_dir

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str) -> list[str]:
        """Problems of the sink's ``logger.<name>`` section, ``["<key>: why", ...]`` (``nexrl validate`` too)."""
        return []

    @abstractmethod
    def log(self, metrics: dict[str, Any], step: int) -> None:
        """One row of metrics for training step ``step``."""

    def truncate_after(self, step: int) -> None:
        """A resume from checkpoint ``step``: forget what was logged after it (a sink with its own history)."""

    def close(self) -> None:
        """The run is over: flush and release."""
