"""Built-in experiment loggers: the console, Weights & Biases and TensorBoard (the last two need
their extras: ``pip install 'nexrl-core[wandb]'`` / ``'nexrl-core[tensorboard]'``)."""

from __future__ import annotations

import json
import os
import secrets
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

from loguru import logger

from ..config.schema import RecipeSettings
from ..config.settings import Settings, plain, setting
from ..errors import ConfigError
from ..markers import hookimpl
from ..runtime.run_log import STEP_LINE
from ..runtime.sinks import MetricsSink


class ConsoleSink(MetricsSink):
    """Each step's main metrics as one console line (run.log keeps it too)."""

    def log(self, metrics: dict[str, Any], step: int) -> None:
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
                          if k.startswith(("train/reward", "val/", "timing/step", "train/loss", "train/num")))
        logger.bind(**{STEP_LINE: True}).info(f"step {step}: {shown}")


@dataclass(frozen=True, kw_only=True)
class WandbSettings(Settings):
    """``logger.wandb``."""

    project: str | None = setting(None, "W&B project (default: WANDB_PROJECT, else project_name)")
    entity: str | None = setting(None, "W&B team or user (default: WANDB_ENTITY, else your default entity)")
    group: str | None = setting(None, "W&B run group (default: WANDB_RUN_GROUP)")
    name: str | None = setting(None, "W&B run name (default: experiment_name)")
    tags: list[str] = setting([], "tags of the W&B run")
    notes: str | None = setting(None, "a longer description of the W&B run")
    # str with choices, not Literal | None: a typo's message then lists the choices without null
    mode: str | None = setting(None, "online | offline | disabled (default: WANDB_MODE, else online when an API key "
                                     "is configured, else offline)", choices=("online", "offline", "disabled"))


class WandbSink(MetricsSink):
    """Weights & Biases (options under ``logger.wandb``), as wandb users expect it to behave.

    Project: ``logger.wandb.project``, else ``WANDB_PROJECT``, else ``project_name``. Entity and
    group: the recipe's, else wandb's own ``WANDB_ENTITY`` / ``WANDB_RUN_GROUP``. Run name:
    ``logger.wandb.name``, else ``experiment_name``. Mode: ``logger.wandb.mode``, else
    ``WANDB_MODE``, else online when an API key is configured (``WANDB_API_KEY`` or ``wandb
    login``) and offline without one (``wandb sync RUN_DIR/wandb/offline-run-*`` uploads it later).
    The run's id is kept in ``RUN_DIR/wandb_run.json``: a resumed nexrl run (``resume.mode``
    auto or from_path) continues the same wandb run. Every metric is plotted against
    ``global_step``, so steps a resume trains again are added, never refused by wandb.
    """

    SETTINGS: ClassVar[type[Settings] | None] = WandbSettings
    STEP_METRIC = "global_step"
    MISSING = "logger.backend: 'wandb' needs the wandb package: pip install 'nexrl-core[wandb]'"

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str) -> list[str]:
        return [] if _installed("wandb") else [cls.MISSING]

    @classmethod
    def network_use(cls, recipe: Mapping[str, Any]) -> str | None:
        """What of the network the sink reaches (ray.private_network)."""
        settings = WandbSettings.parse(_sink_section(recipe, "wandb"), "logger.wandb", own=True)[0]
        declared = settings.mode if settings is not None else None  # a bad value: the key checks say so
        return "wandb online (logger.wandb.mode / WANDB_MODE)" if _wandb_mode(declared) == "online" else None

    def __init__(self, config: Mapping[str, Any], run_dir: str | None):
        try:
            import wandb
        except ImportError:
            raise ConfigError(self.MISSING) from None
        from ..redaction import redact, redact_command

        recipe = RecipeSettings.own(config)
        self.settings = own = WandbSettings.own(_sink_section(config, "wandb"), "logger.wandb")
        mode = _wandb_mode(own.mode)
        resuming = recipe.resume.mode != "disable"
        self._id_file = os.path.join(run_dir, WANDB_RUN_FILE) if run_dir else None
        run_id = _read_run_id(self._id_file) if resuming else None
        project = own.project or os.environ.get("WANDB_PROJECT") or recipe.project_name
        kwargs: dict[str, Any] = dict(
            project=project, entity=own.entity, group=own.group, notes=own.notes,
            tags=list(own.tags) or None, name=str(own.name or recipe.experiment_name),
            dir=run_dir, mode=mode, config=redact(_plain(config)), id=run_id or secrets.token_hex(4),
            resume="allow")
        if mode == "offline" and not own.mode and not os.environ.get("WANDB_MODE"):
            logger.info(f"wandb: no API key configured, logging offline to {run_dir or '.'}/wandb "
                        f"(upload later with `wandb sync`)")
        # wandb records sys.argv in the run's metadata: it gets the command line as run.json has it
        argv, sys.argv = sys.argv, redact_command(sys.argv)
        try:
            self._run = wandb.init(**{k: v for k, v in kwargs.items() if v is not None})
        finally:
            sys.argv = argv
        self._run.define_metric(self.STEP_METRIC)
        self._run.define_metric("*", step_metric=self.STEP_METRIC)
        if self._id_file is not None:
            with open(self._id_file, "w", encoding="utf-8") as f:
                json.dump({"id": self._run.id, "project": project, "entity": own.entity, "mode": mode}, f)
                f.write("\n")

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log({**metrics, self.STEP_METRIC: int(step)})

    def close(self) -> None:
        self._run.finish()


WANDB_RUN_FILE = "wandb_run.json"


def _read_run_id(path: str | None) -> str | None:
    if path is None or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            value = json.load(f).get("id")
    except (OSError, ValueError, AttributeError):
        logger.warning(f"{path}: unreadable; this run starts a new wandb run")
        return None
    return str(value) if value else None


def _wandb_mode(declared: str | None) -> str:
    mode = declared or os.environ.get("WANDB_MODE") or ("online" if _wandb_key_configured() else "offline")
    return "offline" if mode == "dryrun" else mode  # dryrun: wandb's older name for offline


def _wandb_key_configured() -> bool:
    """An API key in the environment or in the netrc file ``wandb login`` writes."""
    if os.environ.get("WANDB_API_KEY"):
        return True
    import netrc
    from urllib.parse import urlparse

    host = urlparse(os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai")).hostname or "api.wandb.ai"
    try:
        return netrc.netrc(os.environ.get("NETRC")).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


@dataclass(frozen=True, kw_only=True)
class TensorBoardSettings(Settings):
    """``logger.tensorboard``."""

    log_dir: str | None = setting(None, "folder of the event files (default: RUN_DIR/tensorboard)")
    flush_secs: int = setting(10, "write buffered events at least this often (seconds)", ge=1)


class TensorBoardSink(MetricsSink):
    """TensorBoard event files (``logger.tensorboard.log_dir``, default ``RUN_DIR/tensorboard``):
    ``tensorboard --logdir RUN_DIR/tensorboard``. A resumed run purges the steps after its
    checkpoint from the view, so the curves continue from where the checkpoint left them."""

    SETTINGS: ClassVar[type[Settings] | None] = TensorBoardSettings

    MISSING = "logger.backend: 'tensorboard' needs the tensorboardX package: pip install 'nexrl-core[tensorboard]'"

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str) -> list[str]:
        from ..runtime.run_log import writable_dir_problem

        if not _installed("tensorboardX"):
            return [cls.MISSING]
        log_dir = TensorBoardSettings.own(section, path).log_dir
        problem = writable_dir_problem(log_dir, f"{path}.log_dir") if log_dir else None
        return [problem] if problem else []

    def __init__(self, config: Mapping[str, Any], run_dir: str | None):
        try:
            from tensorboardX import SummaryWriter
        except ImportError:
            raise ConfigError(self.MISSING) from None
        self.settings = TensorBoardSettings.own(_sink_section(config, "tensorboard"), "logger.tensorboard")
        self.log_dir = self.settings.log_dir or os.path.join(run_dir or ".", "tensorboard")
        self._writer_cls = SummaryWriter
        self._writer: Any = None
        self._purge_step: int | None = None

    def _writer_now(self) -> Any:
        if self._writer is None:
            self._writer = self._writer_cls(logdir=self.log_dir, flush_secs=self.settings.flush_secs,
                                            purge_step=self._purge_step)
        return self._writer

    def truncate_after(self, step: int) -> None:
        """A resume from checkpoint ``step``: TensorBoard drops the earlier run's events after it."""
        if self._writer is None:
            self._purge_step = int(step) + 1

    def log(self, metrics: dict[str, Any], step: int) -> None:
        writer = self._writer_now()
        for key, value in metrics.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                writer.add_scalar(key, float(value), int(step))

    def log_text(self, title: str, content: str, step: int) -> None:
        self._writer_now().add_text(title or "text", content, int(step))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


def _installed(module: str) -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _sink_section(recipe: Mapping[str, Any], name: str) -> Mapping[str, Any] | None:
    """The recipe's ``logger.<name>`` section (None: the recipe has none; its settings' defaults apply)."""
    section = plain(recipe).get("logger")  # logger.<name> is not the core's: the recipe as written
    own = section.get(name) if isinstance(section, Mapping) else None
    return own if isinstance(own, Mapping) else None


def _plain(config: Mapping[str, Any]) -> Any:
    from ..runtime.run_info import plain_config

    try:
        return plain_config(config)
    except Exception:
        return {}


@hookimpl
def nexrl_metrics_sinks():
    return {"console": ConsoleSink, "wandb": WandbSink, "tensorboard": TensorBoardSink}
