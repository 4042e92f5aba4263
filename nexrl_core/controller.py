"""NexRLController: builds every module, runs the monitor loop, validates, stops cleanly.

The controller creates modules through the resource manager of the recipe's ``launch_mode``
and reaches them only through ``execute`` calls on their public methods (handles), never
their attributes: a module may live in another process.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, cast

from loguru import logger
from omegaconf import DictConfig, OmegaConf

from .checkpoint import find_latest_checkpoint
from .config.schema import RecipeSettings
from .errors import NexRLError
from .launch import create_resource_manager
from .launch.preflight import dataloader_config, records_config, require_runnable, resume_checkpoint
from .launch.prologue import is_loaded, seed_origin, start_run
from .plugins import PluginManager, get_plugin_manager
from .runtime.activity import ActivityTracker, ActivityTrackerProxy
from .runtime.execute import execute
from .runtime.logs import format_traceback
from .runtime.run_log import prepare_run_dir
from .trajectory_pool import TrajectoryPool
from .types import NexRLRole, Trajectory
from .validator import Validator
from .weight_sync import WeightSyncController

_LISTENER_POLL_S = 0.1  # how often the driver's listeners (progress display) are handed new metrics rows


class RunFailed(NexRLError):
    """The run stopped because of an error (the message says which module and why)."""


class _StopRequested(NexRLError):
    """request_stop() (a signal) interrupted a blocking phase of the run."""


@dataclass
class RunSummary:
    global_step: int
    stopped_by: str
    validation: list[dict[str, float]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


class NexRLController:
    def __init__(self, config: DictConfig, plugin_manager: PluginManager | None = None,
                 eval_only: bool = False, eval_out: str | None = None, listeners: list[Any] | None = None,
                 settings: RecipeSettings | None = None):
        """``eval_only``: build for ``nexrl eval`` (no trainer, no training data), recording failed
        samples in ``eval_out`` (None: nowhere), never in the training run's run_dir.

        ``settings``: ``config`` read by the run's prologue (``nexrl run``, ``nexrl_core.run()``),
        which checked the recipe and prepared ``run_dir``; without it (a seed-style
        ``NexRLController(cfg).run()``) the controller does both and reads ``config`` itself. A
        seed-shaped ``config`` (one nexrl did not load, such as the DictConfig a Hydra ``main``
        receives, without the sections nexrl has defaults for) is first composed as
        ``nexrl_core.run(config)`` composes it, and the run then gets that call's records too
        (run.log, run.json naming the Hydra config file and overrides, config.yaml).

        ``listeners``: objects with ``log(metrics, step)`` (a metrics sink's interface) that follow the
        run in this process (the driver), whatever the launch mode: every metrics row (with its
        ``time``) reaches them, read from what the run recorded, never from the data path."""
        self._pm = plugin_manager or get_plugin_manager()
        self._eval_only = eval_only
        self._eval_out = eval_out
        self._seed_run: Any = None  # the prologue this controller ran for a seed-shaped config
        if settings is None and not is_loaded(config):
            config, settings = self._start_seed_config(config)
        elif settings is None:  # a run the prologue started was checked there, once (launch/prologue.py)
            require_runnable(config, self._pm, eval_only=eval_only)  # what `nexrl validate` checks, before any file
            settings = _eval_settings(config) if eval_only else RecipeSettings.of(config)
            if not eval_only:
                prepare_run_dir(settings)
        self._config = config  # the components' sections (their own keys) are read from it
        self._settings = settings
        self._final_step = 0
        try:
            self._build(settings, listeners)
        except BaseException as exc:
            if self._seed_run is not None:
                self._seed_failed(exc)
            raise

    def _build(self, settings: RecipeSettings, listeners: list[Any] | None) -> None:
        random.seed(settings.seed)
        self._stop_requested = threading.Event()
        self._stop_reason = ""
        self._dead: list[str] = []  # modules the health check found dead (their work never ends)
        self._next_health = time.monotonic() + settings.runtime_monitor.health_check.check_interval
        self._unhealthy_since: float | None = None
        self._validations: list[dict[str, float]] = []
        self._final_errors: list[str] = []
        self._listeners = list(listeners or [])
        self._rows_cursor = 0
        self._failed_listeners: set[int] = set()
        self.run_dir = settings.run_dir
        #: validation trajectories of the last :meth:`run_evaluation`
        self.evaluation_samples: list[Trajectory] = []
        self._model_tag = settings.service.inference_service.model_tag
        self.resource_manager = create_resource_manager(self._config, self._pm, settings)
        self._register_roles()
        self.resource_manager.create_all_actors()
        try:
            self._take_handles()
            self._set_module_references()
        except BaseException:
            self.resource_manager.shutdown()  # no actor or cluster outlives a run that could not start
            raise

    @property
    def settings(self) -> RecipeSettings:
        """The run's recipe as the core reads it (typed, checked)."""
        return self._settings

    # -- construction ---------------------------------------------------------------
    def _start_seed_config(self, config: Mapping[str, Any]) -> tuple[DictConfig, RecipeSettings]:
        """A seed-shaped config composed (core and component defaults, interpolations resolved) and
        checked as ``nexrl validate`` checks a recipe; a training run then gets ``nexrl_core.run``'s
        prologue (run_dir prepared, run.log, run.json, config.yaml: ``self._seed_run``). Returns the
        config and its settings."""
        from .launch.prologue import load_mapping

        origin = seed_origin()
        cfg = load_mapping(config, folder=origin.folder)
        if self._eval_only:
            require_runnable(cfg, self._pm, eval_only=True)
            return cfg, _eval_settings(cfg)
        self._seed_run = start_run(cfg, self._pm, origin.recipe, origin.overrides)
        return cfg, self._seed_run.settings

    def _create(self, kind: str, name: Any, key: str) -> type:
        return self._pm.resolve(kind, name, key)

    def _register_roles(self) -> None:
        """Every module of the run, in the seed's order (data loaders, pool/validator, weight
        sync, trainer, workers); the tracker first, the inference service just before the
        workers that use it. Classes are resolved here, so a bad name fails before anything is built."""
        cfg, settings, rm = self._config, self._settings, self.resource_manager
        # The records, the weight-sync backend and the components read their own keys of the recipe
        # (nexrl_core.launch.parts): they get its mappings; the core's own modules their settings.
        rm.register_role(NexRLRole.ACTIVITY_TRACKER, ActivityTracker,
                         records_config(cfg, self._eval_out) if self._eval_only else cfg)
        if not self._eval_only:
            rm.register_role(NexRLRole.DATA_LOADER, self._create("dataloader", settings.data.type, "data.type"),
                             dataloader_config(cfg, "data"), kwargs={"is_validate": False})
        if settings.validate.data is not None:
            rm.register_role(NexRLRole.VALIDATE_DATALOADER,
                             self._create("dataloader", settings.validate.data.type, "validate.data.type"),
                             dataloader_config(cfg, "validate.data"), kwargs={"is_validate": True})
        rm.register_role(NexRLRole.TRAJECTORY_POOL, TrajectoryPool, settings.trajectory_pool)
        rm.register_role(NexRLRole.VALIDATOR, Validator, settings.validate)
        rm.register_role(NexRLRole.WEIGHT_SYNC_CONTROLLER, WeightSyncController, cfg.weight)
        if not self._eval_only:
            rm.register_role(NexRLRole.TRAINER, self._pm.resolve_section("trainer", cfg.trainer, "trainer"), cfg)
        rm.register_role(NexRLRole.INFERENCE_SERVICE,
                         self._create("inference_backend", settings.service.inference_service.backend,
                                      "service.inference_service.backend"),
                         cfg.service.inference_service)
        rm.register_role(NexRLRole.ROLLOUT_WORKER,
                         self._pm.resolve_section("rollout_worker", cfg.rollout_worker, "rollout_worker"),
                         cfg.rollout_worker, count=settings.rollout_worker.num_workers)

    def _take_handles(self) -> None:
        rm = self.resource_manager

        def one(role: NexRLRole) -> Any:
            handles = rm.get_actor_wrapper(role)
            return handles[0] if handles else None

        self.activity_tracker = one(NexRLRole.ACTIVITY_TRACKER)
        self.dataloader = one(NexRLRole.DATA_LOADER)
        self.validate_dataloader = one(NexRLRole.VALIDATE_DATALOADER)
        self.trajectory_pool = one(NexRLRole.TRAJECTORY_POOL)
        self.validator = one(NexRLRole.VALIDATOR)
        self.weight_sync_controller = one(NexRLRole.WEIGHT_SYNC_CONTROLLER)
        self.trainer = one(NexRLRole.TRAINER)
        self.inference_client = one(NexRLRole.INFERENCE_SERVICE)
        self.rollout_workers = rm.get_actor_wrapper(NexRLRole.ROLLOUT_WORKER)

    def _set_module_references(self) -> None:
        settings, tracker = self._settings, self.activity_tracker
        proxy = ActivityTrackerProxy(tracker)
        modules: list[tuple[str, Any, bool]] = [
            (name, loader, False) for name, loader in (("data_loader", self.dataloader),
                                                       ("validate_dataloader", self.validate_dataloader))
            if loader is not None
        ]
        modules += [
            ("trajectory_pool", self.trajectory_pool, False),
            ("validator", self.validator, False),
            ("weight_sync_controller", self.weight_sync_controller, False),
        ]
        if self.trainer is not None:
            modules.append(("trainer", self.trainer, False))
        modules += [(f"rollout_worker_{i}", w, True) for i, w in enumerate(self.rollout_workers)]
        for name, module, is_worker in modules:
            execute(module.set_module_name, name)
            execute(module.set_activity_tracker, proxy)
            execute(tracker.register_module, name, module, is_worker)
        execute(tracker.register_module, "inference_service", self.inference_client)
        limit, batch_size = settings.weight.rollout_limit, settings.trajectory_pool.batch_size
        if limit is not None:
            execute(self.weight_sync_controller.set_rollout_budget, batch_size if limit == "batch" else int(limit))
        ahead = execute(self.weight_sync_controller.bound_rollouts_ahead, batch_size)
        if ahead is not None and settings.launch_mode == "local" and self.trainer is not None:
            execute(self.inference_client.share_cpus_with_trainer)  # the engine and the trainer overlap here
        execute(self.trajectory_pool.set_module_references, self.dataloader, self.weight_sync_controller)
        execute(self.validator.set_module_references, self.validate_dataloader)
        execute(self.weight_sync_controller.set_module_references, self.dataloader, self.trajectory_pool,
                self.trainer, self.inference_client)
        if self.trainer is not None:
            execute(self.trainer.set_module_references, self.trajectory_pool, self.weight_sync_controller,
                    self.dataloader)
        for worker in self.rollout_workers:
            execute(worker.set_module_references, self.trajectory_pool, self.dataloader, self.weight_sync_controller,
                    self.validate_dataloader, self.validator, self.inference_client)
            execute(worker.set_idle_wait, self.resource_manager.idle_wait_s)

    def modules(self) -> dict[NexRLRole, Any]:
        """Handles of every module, by role."""
        return {NexRLRole.DATA_LOADER: self.dataloader, NexRLRole.VALIDATE_DATALOADER: self.validate_dataloader,
                NexRLRole.TRAJECTORY_POOL: self.trajectory_pool, NexRLRole.VALIDATOR: self.validator,
                NexRLRole.WEIGHT_SYNC_CONTROLLER: self.weight_sync_controller, NexRLRole.TRAINER: self.trainer,
                NexRLRole.ROLLOUT_WORKER: self.rollout_workers, NexRLRole.ACTIVITY_TRACKER: self.activity_tracker,
                NexRLRole.INFERENCE_SERVICE: self.inference_client}

    # -- run -----------------------------------------------------------------------------
    def final_step(self) -> int:
        """The trainer's step when the run stopped (known once :meth:`run` returned or raised)."""
        return self._final_step

    def stop_requested(self) -> bool:
        return self._stop_requested.is_set()

    def request_stop(self, reason: str) -> None:
        """Ask the monitor loop to stop (signal handlers call this)."""
        self._stop_reason = reason
        self._stop_requested.set()

    def run(self) -> RunSummary:
        if self._seed_run is None:
            return self._run()
        try:  # a seed-style run completes its run.json as nexrl_core.run does
            summary = self._run()
        except BaseException as exc:
            self._seed_failed(exc)
            raise
        self._seed_run.finish(summary)
        return summary

    def _seed_failed(self, exc: BaseException) -> None:
        self._seed_run.finish(error=exc, step=self._final_step)

    def _run(self) -> RunSummary:
        stopped_by, error = "finished", None
        try:
            execute(self.activity_tracker.set_run_stopping_severities, self._run_stopping_severities())
            execute(self.trainer.initialize_workers)
            start_step = self._load_initial_checkpoint()
            due = self._validation_due(start_step)
            if due:
                self._start_validate(self._model_tag)
            for worker in self.rollout_workers:
                execute(worker.run)
            if due:
                self._wait_validation()
                self._end_validate(self._model_tag, start_step)
                self._feed_listeners()
            execute(self.trainer.run)
            stopped_by, error = self._monitor()
        except NexRLError as exc:
            if self._stop_requested.is_set() and isinstance(exc, _StopRequested):
                stopped_by = "signal"  # stopped before the monitor loop (e.g. during a validation)
            else:
                stopped_by, error = "error", str(exc)
        finally:
            self._stop(save=stopped_by == "signal" and self._settings.trainer.save_on_stop)
        summary = RunSummary(self._final_step, stopped_by, list(self._validations), list(self._final_errors))
        if error is not None:
            raise RunFailed(error)
        return summary

    def run_evaluation(self) -> dict[str, float]:
        """One validation pass with the served weights (``nexrl eval``); the samples are kept in
        :attr:`evaluation_samples`."""
        if self.validate_dataloader is None:
            raise NexRLError("validate.data: `nexrl eval` needs a validation data set in the recipe")
        try:
            self._start_validate(self._model_tag)
            for worker in self.rollout_workers:
                execute(worker.run)
            self._wait_validation()
            self.evaluation_samples = execute(self.validator.trajectories)
            return execute(self.validator.compute_metrics)
        finally:
            self._stop(save=False)

    def _validation_due(self, start_step: int) -> bool:
        if self.validate_dataloader is None:
            return False
        if start_step == 0:
            return self._settings.validate.validate_before_train
        freq = self._settings.weight.validate_freq
        return freq > 0 and start_step % freq == 0  # the resumed step's validation was not recorded

    def _monitor(self) -> tuple[str, str | None]:
        rm = self._settings.runtime_monitor
        wsc, tracker = self.weight_sync_controller, self.activity_tracker
        self._next_health = time.monotonic() + rm.health_check.check_interval
        next_exc = next_feed = time.monotonic()
        while True:
            if self._stop_requested.is_set():
                return "signal", None
            if self._listeners and time.monotonic() >= next_feed:
                next_feed = time.monotonic() + _LISTENER_POLL_S
                self._feed_listeners()
            if execute(wsc.is_waiting_for_validation):
                if self.validate_dataloader is None:
                    execute(wsc.end_validate, self._model_tag)
                else:
                    self._run_validate(self._model_tag)
            failed = execute(tracker.failed_samples_verdict)
            if failed:
                return "error", failed
            trainer = execute(self.trainer.get_status)
            if self._check_finish(trainer):
                failed = execute(tracker.failed_samples_verdict)  # the last step may have just failed
                if not failed and rm.exception_handling.enabled and not self._check_module_exceptions():
                    # an error the policy stops on, reported since the last check: never a quiet finish
                    failed = self._policy_message(rm.exception_handling.policy)
                return ("error", failed) if failed else ("finished", None)
            if trainer["last_error"] is not None:
                return "error", f"the trainer stopped at step {trainer['global_step'] + 1}: {trainer['last_error']}"
            now = time.monotonic()
            if rm.exception_handling.enabled and now >= next_exc:
                next_exc = now + rm.exception_handling.check_interval
                if not self._check_module_exceptions():
                    return "error", self._policy_message(rm.exception_handling.policy)
            dead = self._health_failure()
            if dead:
                return "error", dead
            self._stop_requested.wait(self.resource_manager.poll_interval_s)

    def _health_failure(self) -> str | None:
        """Every ``health_check.check_interval`` (from the monitor loop and while a validation runs):
        the message of modules unhealthy for ``grace_period``, else None."""
        check = self._settings.runtime_monitor.health_check
        now = time.monotonic()
        if not check.enabled or now < self._next_health:
            return None
        self._next_health = now + check.check_interval
        dead = execute(self.activity_tracker.dead_modules, check.timeout)
        if not dead:
            self._unhealthy_since = None
            return None
        self._unhealthy_since = self._unhealthy_since or now
        if now - self._unhealthy_since >= check.grace_period:
            self._dead = list(dead)
            return self._dead_message(dead)
        logger.warning(f"not answering health checks: {', '.join(dead)}; waiting up to "
                       f"{check.grace_period}s for them to come back")
        return None

    def _feed_listeners(self) -> None:
        """Hand the metrics rows recorded since the last call to every listener (a listener that
        raises is reported once and skipped: it must not stop the run)."""
        rows, self._rows_cursor = execute(self.activity_tracker.recorded_rows, self._rows_cursor)
        for row in rows:
            step = int(row.pop("step"))
            for i, listener in enumerate(self._listeners):
                if i in self._failed_listeners:
                    continue
                try:
                    listener.log(row, step)
                except Exception as exc:
                    self._failed_listeners.add(i)
                    logger.warning(f"{type(listener).__name__}.log failed and is skipped for the rest of the run: "
                                   f"{type(exc).__name__}: {exc}")
                    logger.debug(f"traceback of the error above:\n{format_traceback(exc)}")

    def _run_stopping_severities(self) -> list[str]:
        """The severities :meth:`_check_module_exceptions` stops the run on."""
        handling = self._settings.runtime_monitor.exception_handling
        if not handling.enabled or handling.policy == "continue":
            return []
        return ["critical"] if handling.policy == "stop_on_critical" else ["error", "critical"]

    def _policy_message(self, policy: str) -> str:
        """Name the error that made ``policy`` stop the run (not merely the latest one)."""
        stopping = {"critical"} if policy == "stop_on_critical" else {"error", "critical"}
        errors = [e for e in execute(self.activity_tracker.get_errors) if e.severity.value in stopping]
        if not errors:
            status = execute(self.activity_tracker.get_error_health_status)
            return f"stopping on {status['status']} (policy {policy}): {status['message']}"
        e = errors[-1]
        # a failed sample's message already names its module
        what = e.message if e.message.startswith(f"{e.module_name}:") else \
            f"{e.module_name}/{e.work_context}: {e.message}"
        more = f" ({len(errors) - 1} more in run.log)" if len(errors) > 1 else ""
        return f"stopping on {e.severity.value} (policy {policy}): {what}{more}"

    def _dead_message(self, dead: list[str]) -> str:
        try:
            why = execute(self.activity_tracker.last_health_problems)
        except Exception:
            why = {}
        parts = []
        for name in dead:
            if name == "inference_service":
                url = self._config.service.inference_service.get("url")
                where = f" at {str(url).rstrip('/')}" if url else ""
                parts.append(f"the inference service{where} stopped answering"
                             + (f" ({why[name]})" if why.get(name) else ""))
            else:
                parts.append(f"module {name} is dead or hung" + (f" ({why[name]})" if why.get(name) else ""))
        return "health check failed: " + "; ".join(parts)

    def _check_finish(self, trainer: dict[str, Any]) -> bool:
        """``trainer``: the trainer's :meth:`~nexrl_core.BaseTrainer.get_status`."""
        if trainer["done"] and not trainer["running"]:
            return not execute(self.weight_sync_controller.is_waiting_for_validation)
        return bool(execute(self.activity_tracker.is_quiescent) and execute(self.dataloader.is_finished)
                    and execute(self.trajectory_pool.is_empty))

    def _check_module_liveness(self, timeout: float = 5.0) -> bool:
        return execute(self.activity_tracker.check_module_liveness, timeout)

    def _check_module_exceptions(self) -> bool:
        status = execute(self.activity_tracker.get_error_health_status)
        policy = self._settings.runtime_monitor.exception_handling.policy
        if policy == "continue":
            return True
        if policy == "stop_on_critical":
            return status["critical_level_count"] == 0
        return status["error_level_count"] == 0 and status["critical_level_count"] == 0

    # -- validation ----------------------------------------------------------------------
    def _run_validate(self, model_tag: str) -> None:
        # Log under the version being validated (the served one; no push happens until
        # end_validate), not the trainer's step: the trainer may already have finished the
        # next step and be waiting to push it.
        step = execute(self.weight_sync_controller.get_rollout_model_version, model_tag)
        self._start_validate(model_tag)
        self._wait_validation()
        self._end_validate(model_tag, step)

    def _start_validate(self, model_tag: str) -> None:
        execute(self.validate_dataloader.reset)
        execute(self.validator.clear)
        for worker in self.rollout_workers:
            execute(worker.begin_validate)
        execute(self.validate_dataloader.unlock_for_weight_sync)
        logger.info(f"validation started (weights v{execute(self.weight_sync_controller.get_rollout_model_version, model_tag)})")

    def _wait_validation(self) -> None:
        while not execute(self.validator.is_complete):
            dead = self._health_failure()  # a validation that hangs must not hang the run
            if dead:
                raise RunFailed(dead)
            if self._stop_requested.wait(self.resource_manager.poll_interval_s):
                raise _StopRequested(f"stopped during validation ({self._stop_reason})")

    def _end_validate(self, model_tag: str, step: int) -> None:
        execute(self.validate_dataloader.lock_for_weight_sync)
        metrics = execute(self.validator.compute_and_log_metrics, step)
        self._validations.append({"step": step, **metrics})
        for worker in self.rollout_workers:
            execute(worker.end_validate)
        execute(self.weight_sync_controller.end_validate, model_tag)

    # -- checkpoints -----------------------------------------------------------------------
    def _load_initial_checkpoint(self) -> int:
        wsc = self.weight_sync_controller
        path = self._load_resume_checkpoint()
        if path is None:
            if self._settings.resume.mode == "auto":  # nothing to resume: an earlier run saved no checkpoint
                execute(self.activity_tracker.truncate_records_after, 0)
            execute(wsc.sync_weight_to_rollout_service, self._model_tag)
            return 0
        state = execute(self.trainer.resume_checkpoint, path)
        if self.dataloader is not None and "dataloader" in state:
            execute(self.dataloader.load_state_dict, state["dataloader"])
        if "weight_sync" in state:
            execute(wsc.load_state_dict, state["weight_sync"])
        if "trajectory_pool" in state:
            execute(self.trajectory_pool.load_state_dict, state["trajectory_pool"])
        step = int(state["global_step"])
        execute(self.activity_tracker.set_training_step, step)
        execute(self.activity_tracker.truncate_records_after, step)
        execute(wsc.sync_weight_to_rollout_service, self._model_tag)
        logger.info(f"resumed from {path} at step {step}")
        return step

    def _load_resume_checkpoint(self) -> str | None:
        return resume_checkpoint(self._config)

    def _find_latest_checkpoint(self, checkpoint_folder: str) -> str | None:
        return find_latest_checkpoint(checkpoint_folder)

    # -- stop ---------------------------------------------------------------------------------
    def _stop(self, save: bool = False) -> None:
        """Stop every module, save if asked, close the records. Each step is attempted even when an
        earlier one fails (a module that is gone must not keep the others running)."""
        timeout = self._settings.runtime_monitor.stop_timeout
        tracker, trainer = self.activity_tracker, self.trainer
        try:
            for worker in self.rollout_workers:  # all at once: none starts a new task while others stop
                _best_effort("asking a rollout worker to stop", worker.request_stop)
            _best_effort("releasing weight-sync waiters", self.weight_sync_controller.stop)
            if trainer is not None:
                _best_effort("stopping the trainer", trainer.stop)
            for worker in self.rollout_workers:
                _best_effort("stopping a rollout worker", worker.stop)
            if not _best_effort("waiting for work in flight", tracker.wait_quiescent, timeout, self._dead):
                logger.warning(f"still running after {timeout}s: "
                               f"{_best_effort('reading the activity', tracker.get_running_status_summary)}")
            if trainer is not None:
                self._final_step = _best_effort("reading the trainer's step", trainer.get_global_step) \
                    or self._final_step
            if save and self._final_step > 0:
                execute(trainer.save_checkpoint)  # a failed save must not pass unnoticed
        finally:
            if self._listeners:
                _best_effort("reading the last metrics", self._feed_listeners)
            errors = _best_effort("reading the reported errors", tracker.get_errors)
            self._final_errors = [e.message for e in errors or []]
            if trainer is not None:
                _best_effort("closing the trainer", trainer.close)
            _best_effort("closing the inference client", self.inference_client.close)
            _best_effort("closing the run records", tracker.close)
            self.resource_manager.shutdown()


def _eval_settings(config: DictConfig) -> RecipeSettings:
    """``nexrl eval``'s reading of a recipe: it builds no trainer, so the recipe may name none."""
    values = cast(dict[str, Any], OmegaConf.to_container(config, resolve=True))
    values["trainer"] = {"type": "(no trainer: nexrl eval)", **dict(values["trainer"])}
    return RecipeSettings.of(values)


def _best_effort(what: str, method: Any, *args: Any) -> Any:
    """``execute(method, *args)``; a failure is logged and None returned (used while stopping)."""
    try:
        return execute(method, *args)
    except Exception as exc:
        logger.warning(f"while stopping, {what} failed: {type(exc).__name__}: {exc}")
        return None
