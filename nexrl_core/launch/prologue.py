"""What every run does before its controller starts, once, whether it was asked for by ``nexrl
run`` or by ``nexrl_core.run()``: the recipe checked as ``nexrl validate`` checks it, the run
directory prepared, run.log opened, run.json and config.yaml written, and the recipe read once into
its typed settings (:class:`~nexrl_core.config.schema.RecipeSettings`). And the rule for a run that
fails: ``resume.on_failure: restart`` (:class:`Restarts`). The controller then receives a started
run and checks nothing again (``NexRLController(..., settings=started.settings)``)."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from omegaconf import DictConfig

from ..config.schema import RecipeSettings, ResumeSettings
from ..errors import NexRLError, exit_code
from ..runtime.run_info import RunRecord, write_config
from ..runtime.run_log import prepare_run_dir, setup_logging
from .preflight import require_runnable, resume_checkpoint


@dataclass
class StartedRun:
    """A run whose recipe passed every check and whose records are open. ``cfg``: the composed
    recipe (the components read their own sections of it); ``settings``: the core's reading of it."""

    cfg: DictConfig
    settings: RecipeSettings
    pm: Any
    recipe: str
    overrides: list[str]
    record: RunRecord
    resume_from: str | None  # the checkpoint it resumes from (None: a fresh start)
    restarts: Restarts = field(init=False)
    controller: Any = None  # the attempt running now (api.run_started sets it)

    def __post_init__(self) -> None:
        self.restarts = Restarts(self.settings.resume)

    @property
    def run_dir(self) -> str:
        return self.settings.run_dir

    def restart(self, step: int | None, error: str) -> float:
        """Count a restart and record it; the next attempt resumes from the newest checkpoint (the
        failed attempt's own) and continues its records. Returns the wait before it."""
        delay = self.restarts.next(step, error, self.record)
        self.cfg.resume.mode, self.cfg.resume.resume_path, self.cfg.overwrite_run_dir = "auto", None, False
        resume = dataclasses.replace(self.settings.resume, mode="auto", resume_path=None)
        self.settings = dataclasses.replace(self.settings, resume=resume, overwrite_run_dir=False)
        return delay

    def finish(self, summary: Any = None, error: BaseException | None = None, step: int | None = None) -> None:
        """Complete run.json: with the run's summary, or as failed with ``error`` (at ``step``, else
        the last step the run reached)."""
        if error is None:
            self.record.finish(summary.stopped_by, 0, summary.global_step, None)
            return
        message = str(error) if isinstance(error, NexRLError) else f"{type(error).__name__}: {error}"
        self.record.finish("failed", exit_code(error), self.final_step() if step is None else step, message)

    def final_step(self, otherwise: int | None = None) -> int | None:
        """The last step the run reached (``otherwise`` before any attempt was built)."""
        return self.controller.final_step() if self.controller is not None else otherwise


def start_run(cfg: DictConfig, pm: Any, recipe: str, overrides: list[str], *, argv: list[str] | None = None,
              console: Any = None, hide_step_lines: bool = False,
              checked: RecipeSettings | None = None) -> StartedRun:
    """Check ``cfg`` (RecipeProblems listing every problem, before anything is written; ``checked``:
    the caller just did, with :func:`require_runnable`, and read it), read it into its typed settings, prepare
    ``run_dir``, open run.log (``console``/``hide_step_lines``: how the console shows it) and write
    run.json and config.yaml."""
    if checked is None:
        require_runnable(cfg, pm)
    # after the checks: they may set trainer.total_train_steps (num_train_epochs)
    settings = RecipeSettings.of(cfg) if checked is None else checked
    prepare_run_dir(settings)
    resume_from = resume_checkpoint(cfg)
    setup_logging(settings.run_dir, settings.logger.level, fresh=settings.resume.mode == "disable", console=console,
                  hide_step_lines=hide_step_lines)
    record = RunRecord(settings.run_dir, recipe, overrides, argv=argv, plugin_manager=pm, settings=settings)
    record.write_start(keep_previous=settings.resume.mode != "disable")
    write_config(settings.run_dir, cfg)
    return StartedRun(cfg, settings, pm, recipe, list(overrides), record, resume_from)


class Restarts:
    """``resume.on_failure: restart``: how many restarts are left, the wait before the next (doubled
    each time, at most ``restart_backoff_max``), and their record in run.json (``restarts``)."""

    def __init__(self, resume: ResumeSettings):
        self.enabled = resume.on_failure == "restart"
        self.max, self.backoff, self.backoff_max = resume.max_restarts, resume.restart_backoff, resume.restart_backoff_max
        self.count = 0

    def allowed(self) -> bool:
        return self.enabled and self.count < self.max

    def describe(self) -> str:
        return f"the run failed (restart {self.count} of {self.max})"

    def next(self, step: int | None, error: str, record: RunRecord) -> float:
        """Count a restart and record it; the wait before it."""
        self.count += 1
        record.note_restart(step, error)
        return min(self.backoff * 2 ** (self.count - 1), self.backoff_max)


#: where a recipe given as a mapping is placed (its relative paths resolve against the current folder)
LIBRARY_RECIPE = "<nexrl_core.run>.yaml"


def load_mapping(config: Mapping[str, Any], overrides: Sequence[str] = (), folder: str | None = None) -> Any:
    """A recipe given as a mapping (a dict, or a DictConfig as a Hydra ``main`` receives it), loaded
    as ``nexrl run`` loads a recipe file: the core's defaults and those of the components it selects
    composed in, ``overrides`` applied, interpolations resolved. It is placed in ``folder`` (default:
    the current folder): a relative path it names resolves there, as next to a recipe file."""
    from omegaconf import DictConfig, OmegaConf

    from .recipe import load_recipe

    raw = OmegaConf.to_container(config, resolve=False) if isinstance(config, DictConfig) else dict(config)
    return load_recipe(os.path.join(folder or os.getcwd(), LIBRARY_RECIPE), list(overrides), raw=raw)


def library_argv(recipe: str, overrides: list[str]) -> list[str]:
    """What run.json records as the command of a run started from Python."""
    return [f"nexrl_core.run({os.fspath(recipe)})", *overrides]


def is_loaded(cfg: object) -> bool:
    """Whether ``cfg`` is a recipe as nexrl loads one (``load_recipe``, ``nexrl_core.run``): a
    DictConfig holding ``recipe_dir`` and every key of the core's defaults. A config that lacks
    them is seed-shaped (the YAML a Hydra ``main`` receives) and is composed before it runs."""
    from omegaconf import DictConfig

    from ..config.schema import core_defaults

    if not isinstance(cfg, DictConfig) or "recipe_dir" not in cfg:
        return False
    try:
        return _holds(cfg, core_defaults())
    except Exception:  # a value that cannot be read (an interpolation): not one load_recipe resolved
        return False


def _holds(values: Any, defaults: dict[str, Any]) -> bool:
    from omegaconf import DictConfig

    for key, default in defaults.items():
        if key not in values:
            return False
        value = values[key]
        if isinstance(default, dict) and default and isinstance(value, DictConfig) and not _holds(value, default):
            return False
    return True


@dataclass
class SeedOrigin:
    """What run.json records for a run started by ``NexRLController(cfg).run()``: the recipe file
    and overrides of the Hydra ``main`` that built ``cfg`` where there is one, and the folder its
    relative paths resolve in (the folder it was started from)."""

    recipe: str
    overrides: list[str]
    folder: str


def seed_origin() -> SeedOrigin:
    """The running Hydra ``main``'s primary config file, its command-line overrides and the folder it
    was started from (Hydra's ``runtime.cwd``, also where ``hydra.job.chdir`` moved away from);
    without Hydra, ``<NexRLController>`` in the current folder."""
    try:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.initialized():
            hc = HydraConfig.get()
            name = f"{hc.job.config_name}.yaml" if hc.job.config_name else "<hydra>"
            folders = [str(s.path) for s in hc.runtime.config_sources if s.provider == "main" and s.schema == "file"]
            if folders and hc.job.config_name:
                name = os.path.join(folders[0], name)
            return SeedOrigin(name, [str(o) for o in hc.overrides.task], str(hc.runtime.cwd))
    except Exception:  # Hydra missing, or a layout of its config this does not know: name no file
        pass
    return SeedOrigin("<NexRLController>", [], os.getcwd())
