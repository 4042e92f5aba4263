"""NexRLController: builds every module, runs the monitor loop, validates, stops cleanly."""

from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from loguru import logger
from omegaconf import DictConfig, OmegaConf

from .runtime.activity import ActivityTracker, ActivityTrackerProxy
from .checkpoint import find_latest_checkpoint, is_checkpoint
from .config import require_valid
from .errors import NexRLError
from .runtime.execute import execute
from .plugins import PluginManager, get_plugin_manager
from .run_log import RunRecorder
from .trajectory_pool import TrajectoryPool
from .types import NexRLRole
from .validator import Validator
from .weight_sync import WeightSyncController

_LOOP_WAIT_S = 0.02


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
                 eval_only: bool = False):
        self._config = config
        self._pm = plugin_manager or get_plugin_manager()
        self._eval_only = eval_only
        require_valid(config, self._pm)
        if config.launch_mode != "local":
            raise NexRLError("launch_mode: only 'local' is implemented in this release; ray mode is planned")
        random.seed(int(config.seed))
        self._stop_requested = threading.Event()
        self._stop_reason = ""
        self._validations: list[dict[str, float]] = []
        sinks = [self._pm.resolve("metrics_sink", name, "logger.backend")(config, str(config.run_dir))
                 for name in _as_list(config.logger.backend)]
        self.recorder = RunRecorder(str(config.run_dir), sinks,
                                    step_end_hook=lambda step, metrics: self._pm.call_step_end(
                                        step=step, metrics=metrics, config=config))
        self.activity_tracker = ActivityTracker(config, experiment_logger=self.recorder)
        self._proxy = ActivityTrackerProxy(self.activity_tracker)
        self._model_tag = str(config.service.inference_service.get("model_tag", "default"))
        self.inference_client = self._create("inference_backend", config.service.inference_service.backend,
                                             "service.inference_service.backend")(config.service.inference_service)
        self._init_modules()
        self._set_module_references()

    # -- construction ---------------------------------------------------------------
    def _create(self, kind: str, name: Any, key: str) -> type:
        return self._pm.resolve(kind, name, key)

    def _data_config(self, section: Any, group_size: int, is_validate: bool) -> DictConfig:
        data = OmegaConf.create(OmegaConf.to_container(section))
        data.group_size = group_size
        if is_validate:
            data.shuffle = False
        return data

    def _init_modules(self) -> None:
        cfg = self._config
        # 1. data loaders
        self.dataloader = None
        if not self._eval_only:
            self.dataloader = self._create("dataloader", cfg.data.type, "data.type")(
                self._data_config(cfg.data, int(cfg.trajectory_pool.group_size), False), is_validate=False)
        self.validate_dataloader = None
        if cfg.validate.get("data") is not None:
            self.validate_dataloader = self._create("dataloader", cfg.validate.data.type, "validate.data.type")(
                self._data_config(cfg.validate.data, int(cfg.validate.n_samples), True), is_validate=True)
        # 2. trajectory management
        self.trajectory_pool = TrajectoryPool(cfg.trajectory_pool)
        self.validator = Validator(cfg.validate)
        # 3. weight synchronisation
        backend_cls = self._create("weight_sync_backend", cfg.weight.backend, "weight.backend")
        self.weight_sync_controller = WeightSyncController(cfg.weight, backend_cls(cfg.weight))
        limit = cfg.weight.get("rollout_limit")
        if limit is not None:
            self.weight_sync_controller.set_rollout_budget(
                int(cfg.trajectory_pool.batch_size) if limit == "batch" else int(limit))
        # 4. trainer
        self.trainer = None if self._eval_only else \
            self._create("trainer", cfg.trainer.type, "trainer.type")(cfg)
        # 5. rollout workers
        worker_cls = self._create("rollout_worker", cfg.rollout_worker.type, "rollout_worker.type")
        self.rollout_workers = [worker_cls(cfg.rollout_worker, self.inference_client, self._make_evaluator())
                                for _ in range(int(cfg.rollout_worker.num_workers))]

    def _make_evaluator(self) -> Any:
        ev = self._config.rollout_worker.get("evaluator")
        if ev is None:
            return None
        cls = self._create("evaluator", ev.type, "rollout_worker.evaluator.type")
        kwargs = {k: v for k, v in OmegaConf.to_container(ev).items() if k != "type"}
        return cls(**kwargs)

    def _set_module_references(self) -> None:
        tracker, proxy = self.activity_tracker, self._proxy
        modules: list[tuple[str, Any, bool]] = [
            ("trajectory_pool", self.trajectory_pool, False),
            ("validator", self.validator, False),
            ("weight_sync_controller", self.weight_sync_controller, False),
        ]
        if self.trainer is not None:
            modules.append(("trainer", self.trainer, False))
        modules += [(f"rollout_worker_{i}", w, True) for i, w in enumerate(self.rollout_workers)]
        for name, module, is_worker in modules:
            module.set_module_name(name)
            module.set_activity_tracker(proxy)
            tracker.register_module(name, module, is_rollout_worker=is_worker)
        tracker.register_module("inference_service", self.inference_client)
        self.trajectory_pool.set_module_references(self.dataloader, self.weight_sync_controller)
        self.validator.set_module_references(self.validate_dataloader)
        self.weight_sync_controller.set_module_references(self.dataloader, self.trajectory_pool, self.trainer,
                                                          self.inference_client)
        if self.trainer is not None:
            self.trainer.set_module_references(self.trajectory_pool, self.weight_sync_controller, self.dataloader,
                                               self.recorder)
        for worker in self.rollout_workers:
            worker.set_module_references(self.trajectory_pool, self.dataloader, self.weight_sync_controller,
                                         self.validate_dataloader, self.validator, self.recorder)

    def modules(self) -> dict[NexRLRole, Any]:
        return {NexRLRole.DATA_LOADER: self.dataloader, NexRLRole.VALIDATE_DATALOADER: self.validate_dataloader,
                NexRLRole.TRAJECTORY_POOL: self.trajectory_pool, NexRLRole.VALIDATOR: self.validator,
                NexRLRole.WEIGHT_SYNC_CONTROLLER: self.weight_sync_controller, NexRLRole.TRAINER: self.trainer,
                NexRLRole.ROLLOUT_WORKER: self.rollout_workers}

    # -- run -----------------------------------------------------------------------------
    def request_stop(self, reason: str) -> None:
        """Ask the monitor loop to stop (signal handlers call this)."""
        self._stop_reason = reason
        self._stop_requested.set()

    def run(self) -> RunSummary:
        stopped_by, error = "finished", None
        try:
            execute(self.trainer.initialize_workers)
            start_step = self._load_initial_checkpoint()
            cfg = self._config
            due = self._validation_due(start_step)
            if due:
                self._start_validate(self._model_tag)
            for worker in self.rollout_workers:
                execute(worker.run)
            if due:
                self._wait_validation()
                self._end_validate(self._model_tag, start_step)
            execute(self.trainer.run)
            stopped_by, error = self._monitor(cfg)
        except NexRLError as exc:
            if self._stop_requested.is_set() and isinstance(exc, _StopRequested):
                stopped_by = "signal"  # stopped before the monitor loop (e.g. during a validation)
            else:
                stopped_by, error = "error", str(exc)
        finally:
            self._stop(save=stopped_by == "signal" and bool(self._config.trainer.get("save_on_stop")))
        summary = RunSummary(self.trainer.global_step, stopped_by, list(self._validations),
                             [e.message for e in self.activity_tracker.error_reporter.errors()])
        if error is not None:
            raise RunFailed(error)
        return summary

    def run_evaluation(self) -> dict[str, float]:
        """One validation pass with the served weights (``nexrl eval``)."""
        if self.validate_dataloader is None:
            raise NexRLError("validate.data: `nexrl eval` needs a validation data set in the recipe")
        try:
            self._start_validate(self._model_tag)
            for worker in self.rollout_workers:
                execute(worker.run)
            self._wait_validation()
            return self.validator.compute_metrics()
        finally:
            self._stop(save=False)

    def _validation_due(self, start_step: int) -> bool:
        if self.validate_dataloader is None:
            return False
        if start_step == 0:
            return bool(self._config.validate.validate_before_train)
        freq = int(self._config.weight.validate_freq or 0)
        return freq > 0 and start_step % freq == 0  # the resumed step's validation was not recorded

    def _monitor(self, cfg: DictConfig) -> tuple[str, str | None]:
        rm = cfg.runtime_monitor
        next_health = time.monotonic() + float(rm.health_check.check_interval)
        next_exc = time.monotonic()
        unhealthy_since: float | None = None
        while True:
            if self._stop_requested.is_set():
                return "signal", None
            if self.weight_sync_controller.is_waiting_for_validation():
                if self.validate_dataloader is None:
                    self.weight_sync_controller.end_validate(self._model_tag)
                else:
                    self._run_validate(self._model_tag)
            if self._check_finish():
                return "finished", None
            if self.trainer._last_error is not None:
                return "error", f"the trainer stopped at step {self.trainer.global_step + 1}: " \
                                f"{type(self.trainer._last_error).__name__}: {self.trainer._last_error}"
            now = time.monotonic()
            if rm.exception_handling.enabled and now >= next_exc:
                next_exc = now + float(rm.exception_handling.check_interval)
                if not self._check_module_exceptions():
                    return "error", self._policy_message(str(rm.exception_handling.policy))
            if rm.health_check.enabled and now >= next_health:
                next_health = now + float(rm.health_check.check_interval)
                dead = self.activity_tracker.dead_modules(float(rm.health_check.timeout))
                if dead:
                    unhealthy_since = unhealthy_since or now
                    if now - unhealthy_since >= float(rm.health_check.grace_period):
                        return "error", self._dead_message(dead)
                    logger.warning(f"not answering health checks: {', '.join(dead)}; waiting up to "
                                   f"{rm.health_check.grace_period}s for them to come back")
                else:
                    unhealthy_since = None
            self._stop_requested.wait(_LOOP_WAIT_S)

    def _policy_message(self, policy: str) -> str:
        """Name the error that made ``policy`` stop the run (not merely the latest one)."""
        stopping = {"critical"} if policy == "stop_on_critical" else {"error", "critical"}
        errors = [e for e in self.activity_tracker.error_reporter.errors() if e.severity.value in stopping]
        if not errors:
            status = self.activity_tracker.get_error_health_status()
            return f"stopping on {status['status']} (policy {policy}): {status['message']}"
        e = errors[-1]
        return f"stopping on {e.severity.value} (policy {policy}): {e.module_name}/{e.work_context}: {e.message}"

    def _dead_message(self, dead: list[str]) -> str:
        parts = []
        for name in dead:
            if name == "inference_service":
                url = getattr(self.inference_client, "url", None) or self._config.service.inference_service.get("url")
                parts.append(f"the inference service{f' at {url}' if url else ''} stopped answering")
            else:
                parts.append(f"module {name} is dead or hung")
        return "health check failed: " + "; ".join(parts)

    def _check_finish(self) -> bool:
        trainer = self.trainer
        if trainer.is_done() and not (trainer._thread and trainer._thread.is_alive()):
            return not self.weight_sync_controller.is_waiting_for_validation()
        return bool(self.activity_tracker.is_quiescent() and self.dataloader.is_finished()
                    and self.trajectory_pool.is_empty())

    def _check_module_liveness(self, timeout: float = 5.0) -> bool:
        return self.activity_tracker.check_module_liveness(timeout)

    def _check_module_exceptions(self) -> bool:
        status = self.activity_tracker.get_error_health_status()
        policy = self._config.runtime_monitor.exception_handling.policy
        if policy == "continue":
            return True
        if policy == "stop_on_critical":
            return status["critical_level_count"] == 0
        return status["error_level_count"] == 0 and status["critical_level_count"] == 0

    # -- validation ----------------------------------------------------------------------
    def _run_validate(self, model_tag: str) -> None:
        # Log under the version being validated (the served one; no push happens until
        # end_validate), not trainer.global_step: the trainer may already have finished the
        # next step and be waiting to push it.
        step = self.weight_sync_controller.get_rollout_model_version(model_tag)
        self._start_validate(model_tag)
        self._wait_validation()
        self._end_validate(model_tag, step)

    def _start_validate(self, model_tag: str) -> None:
        execute(self.validate_dataloader.reset)
        execute(self.validator.clear)
        for worker in self.rollout_workers:
            execute(worker.begin_validate)
        execute(self.validate_dataloader.unlock_for_weight_sync)

    def _wait_validation(self) -> None:
        while not execute(self.validator.is_complete):
            if self._stop_requested.wait(_LOOP_WAIT_S):
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
        path = self._load_resume_checkpoint()
        if path is None:
            self.weight_sync_controller.sync_weight_to_rollout_service(self._model_tag)
            return 0
        state = execute(self.trainer.resume_checkpoint, path)
        if self.dataloader is not None and "dataloader" in state:
            execute(self.dataloader.load_state_dict, state["dataloader"])
        if "weight_sync" in state:
            self.weight_sync_controller.load_state_dict(state["weight_sync"])
        if "trajectory_pool" in state:
            execute(self.trajectory_pool.load_state_dict, state["trajectory_pool"])
        step = int(state["global_step"])
        self.activity_tracker.set_training_step(step)
        self.recorder.truncate_after(step)
        self.weight_sync_controller.sync_weight_to_rollout_service(self._model_tag)
        logger.info(f"resumed from {path} at step {step}")
        return step

    def _load_resume_checkpoint(self) -> str | None:
        resume = self._config.resume
        if resume.mode == "disable":
            return None
        if resume.mode == "from_path":
            path = str(resume.resume_path)
            if is_checkpoint(path):
                return path
            raise NexRLError(f"resume.resume_path: '{path}' is not a complete checkpoint folder "
                             f"(expected global_step_<N>/ with nexrl_state.json)")
        return self._find_latest_checkpoint(str(self._config.trainer.checkpoint_path))

    def _find_latest_checkpoint(self, checkpoint_folder: str) -> str | None:
        return find_latest_checkpoint(checkpoint_folder)

    # -- stop ---------------------------------------------------------------------------------
    def _stop(self, save: bool = False) -> None:
        timeout = float(self._config.runtime_monitor.stop_timeout)
        for worker in self.rollout_workers:
            worker._stop_event.set()
        self.weight_sync_controller.stop()
        if self.trainer is not None:
            self.trainer.stop()
        for worker in self.rollout_workers:
            worker.stop()
        if not self.activity_tracker.wait_quiescent(timeout):
            logger.warning(f"still running after {timeout}s: {self.activity_tracker.get_running_status_summary()}")
        if save and self.trainer is not None and self.trainer.global_step > 0:
            self.trainer.save_checkpoint()
        try:
            self.inference_client.close()
        finally:
            self.recorder.close()


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]
