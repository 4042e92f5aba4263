"""BaseTrainer: the training loop shared by every trainer plugin.

Loop: wait for a batch of whole groups from the pool (no older than the
staleness bound) -> ``train`` -> log metrics -> checkpoint (atomic) -> notify
the weight-sync controller, which pushes the new weights.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import threading
import time
from abc import abstractmethod
from typing import Any

from loguru import logger

from .execute import execute
from .module import NexRLModule
from .types import DEFAULT_MODEL_TAG, Trajectory

CHECKPOINT_RE = re.compile(r"^global_step_(\d+)$")
CORE_STATE_FILE = "nexrl_state.json"
TMP_CHECKPOINT_PREFIX = ".tmp_global_step_"
TMP_CHECKPOINT_RE = re.compile(r"^\.+tmp_global_step_")
_BATCH_WAIT_S = 0.1


class BaseTrainer(NexRLModule):
    """Subclasses implement :meth:`train`; self-hosted ones also the model-state methods."""

    CONFIG_KEYS: dict[str, Any] = {}

    def __init__(self, config: Any):
        super().__init__()
        self._full_config = config
        self._config = config.trainer
        self._model_tag = str(config.get("service", {}).get("inference_service", {}).get("model_tag", DEFAULT_MODEL_TAG)
                              or DEFAULT_MODEL_TAG)
        self.total_train_steps = int(self._config.get("total_train_steps", 1))
        self.batch_size = int(config.trajectory_pool.get("batch_size", 1))
        self.checkpoint_path = self._config.get("checkpoint_path")
        self.save_freq = int(self._config.get("save_freq", 0) or 0)
        self.remove_previous_ckpt = bool(self._config.get("remove_previous_ckpt", False))
        self.global_step = 0
        self._stop_event = threading.Event()
        self._thread: threading.Thread | None = None
        self._trajectory_pool: Any = None
        self._weight_sync_controller: Any = None
        self._dataloader: Any = None
        self._recorder: Any = None
        self._last_error: BaseException | None = None

    def set_module_references(self, trajectory_pool: Any, weight_sync_controller: Any, dataloader: Any = None,
                              recorder: Any = None) -> None:
        self._trajectory_pool = trajectory_pool
        self._weight_sync_controller = weight_sync_controller
        self._dataloader = dataloader
        self._recorder = recorder

    # -- to implement -----------------------------------------------------------------
    @abstractmethod
    def train(self, trajectories: list[Trajectory]) -> dict[str, float]:
        """One training step on ``trajectories``; returns its metrics."""

    def initialize_workers(self) -> None:
        """Build the training backend (model, optimizer). Called once before the run."""

    def save_model_state(self, folder: str) -> None:
        """Write model/optimizer/RNG state into ``folder`` (safetensors/JSON only)."""

    def load_model_state(self, folder: str) -> None:
        """Restore what :meth:`save_model_state` wrote."""

    def export_weights(self) -> dict[str, Any]:
        """Current weights for an in-process weight sync."""
        raise NotImplementedError(f"{type(self).__name__} has no weights to export")

    # -- lifecycle ----------------------------------------------------------------------
    def run(self) -> None:
        self._stop_event.clear()
        self._thread = threading.Thread(target=self._main_loop, name="trainer", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop_event.set()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=300)

    def health_check(self) -> bool:
        return self._thread is None or self._thread.is_alive() or self._stop_event.is_set() or self.is_done()

    def is_done(self) -> bool:
        return self.global_step >= self.total_train_steps

    def _main_loop(self) -> None:
        t0 = time.perf_counter()  # the wait for a batch counts from the end of the previous step
        while not self._stop_event.is_set() and not self.is_done():
            min_version = execute(self._weight_sync_controller.min_trainable_version, self._model_tag)
            batch = execute(self._trajectory_pool.get_batch, self.batch_size, self._model_tag, min_version,
                            _BATCH_WAIT_S)
            if batch is None:
                continue
            try:
                self._train_step(batch.to_trajectories(), time.perf_counter() - t0)
                t0 = time.perf_counter()
            except Exception as exc:
                self._last_error = exc
                self._activity_tracker.report_exception(self._module_name, f"train step {self.global_step + 1}", exc)
                return

    def _train_step(self, trajectories: list[Trajectory], wait_s: float) -> None:
        execute(self._weight_sync_controller.train_worker_notify_step_start, self._module_name, self._model_tag)
        usable = [t for t in trajectories if not t.get("failed")]
        t0 = time.perf_counter()
        with self._activity_tracker.track(self._module_name, "train"):
            metrics = self.train(usable) if usable else {}
        train_s = time.perf_counter() - t0
        self.global_step += 1
        self._activity_tracker.set_training_step(self.global_step)
        metrics.update(self._core_metrics(trajectories, usable, wait_s, train_s))
        if self._dataloader is not None:
            execute(self._dataloader.mark_done, [t["seq"] for t in trajectories if t.get("seq") is not None])
        if self._recorder is not None:  # consumed for good: a failed item is lost now, one row each
            for t in trajectories:
                if t.get("failed"):
                    execute(self._recorder.record_lost_item, t.get("task") or t, str(t.get("error_cause", "failed")),
                            str(t.get("error", "")), False, self.global_step)
        self._activity_tracker.experiment_logger_post("metrics", data=metrics, step=self.global_step)
        if self.save_freq > 0 and (self.global_step % self.save_freq == 0 or self.is_done()):
            self.save_checkpoint()
        execute(self._weight_sync_controller.train_worker_notify_weight_update, self._module_name, self._model_tag)

    def _core_metrics(self, trajectories: list[Trajectory], usable: list[Trajectory], wait_s: float,
                      train_s: float) -> dict[str, float]:
        rewards = [float(t.get("reward", 0.0)) for t in usable]
        version = execute(self._weight_sync_controller.get_train_model_version, self._model_tag)
        staleness = [version - int(t.get("model_version", version)) for t in usable]
        out = {
            "train/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "train/num_trajectories": float(len(usable)),
            "train/num_failed": float(len(trajectories) - len(usable)),
            "train/staleness_max": float(max(staleness, default=0)),
            "train/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "timing/wait_batch_s": wait_s,  # rollouts of this batch, in sync mode
            "timing/weight_sync_s": float(self._weight_sync_controller.last_sync_s),
            "timing/train_s": train_s,
        }
        for name, value in execute(self._trajectory_pool.counters).items():
            out[f"pool/{name}"] = float(value)
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def core_state(self) -> dict[str, Any]:
        state: dict[str, Any] = {"global_step": self.global_step}
        if self._dataloader is not None:
            state["dataloader"] = execute(self._dataloader.state_dict)
        if self._weight_sync_controller is not None:
            weight_sync = execute(self._weight_sync_controller.state_dict)
            # Saved before this step's weights are pushed: the saved weights are version global_step.
            weight_sync["train_version"] = {**weight_sync.get("train_version", {}), self._model_tag: self.global_step}
            state["weight_sync"] = weight_sync
        if self._trajectory_pool is not None and hasattr(self._trajectory_pool, "state_dict"):
            state["trajectory_pool"] = execute(self._trajectory_pool.state_dict)
        return state

    def save_checkpoint(self) -> str | None:
        """Write ``global_step_<N>`` atomically: built under ``.tmp_global_step_<N>_<pid>``, then renamed.

        A crash at any point leaves either the complete folder or none of it (``auto`` resume
        never picks a temporary folder); temporary folders left by a crashed save are removed
        by the next save.
        """
        if not self.checkpoint_path:
            return None
        root = str(self.checkpoint_path)
        os.makedirs(root, exist_ok=True)
        remove_stale_tmp_checkpoints(root)
        final = os.path.join(root, f"global_step_{self.global_step}")
        tmp = os.path.join(root, f"{TMP_CHECKPOINT_PREFIX}{self.global_step}_{os.getpid()}")
        old = tmp + "_old"
        try:
            os.makedirs(tmp)
            self.save_model_state(tmp)
            with open(os.path.join(tmp, CORE_STATE_FILE), "w", encoding="utf-8") as f:
                json.dump(self.core_state(), f)
                f.flush()
                os.fsync(f.fileno())
            _fsync_tree(tmp)
            if os.path.exists(final):  # move the old folder aside first: never a half-deleted global_step_<N>
                os.replace(final, old)
            os.replace(tmp, final)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        _fsync_path(root)
        shutil.rmtree(old, ignore_errors=True)
        logger.info(f"checkpoint saved: {final}")
        if self.remove_previous_ckpt:
            for name in os.listdir(root):
                m = CHECKPOINT_RE.match(name)
                if m and int(m.group(1)) != self.global_step:
                    doomed = os.path.join(root, f"{TMP_CHECKPOINT_PREFIX}{m.group(1)}_{os.getpid()}_removed")
                    os.replace(os.path.join(root, name), doomed)  # gone from `auto` at once, then deleted
                    shutil.rmtree(doomed, ignore_errors=True)
        return final

    def resume_checkpoint(self, folder: str) -> dict[str, Any]:
        """Restore model state and return the core state saved with it."""
        with open(os.path.join(folder, CORE_STATE_FILE), encoding="utf-8") as f:
            state = json.load(f)
        self.load_model_state(folder)
        self.global_step = int(state["global_step"])
        return state


def remove_stale_tmp_checkpoints(checkpoint_folder: str) -> list[str]:
    """Delete temporary folders a crashed save left behind (``.tmp_global_step_*`` and the
    train service's own ``..tmp_global_step_*`` scratch folders); returns their names."""
    removed = []
    for name in os.listdir(checkpoint_folder):
        if TMP_CHECKPOINT_RE.match(name):
            shutil.rmtree(os.path.join(checkpoint_folder, name), ignore_errors=True)
            removed.append(name)
    if removed:
        logger.info(f"removed incomplete checkpoint folders left by a crashed save: {', '.join(sorted(removed))}")
    return removed


def find_latest_checkpoint(checkpoint_folder: str) -> str | None:
    """Newest complete ``global_step_<N>`` folder (temporary folders never match)."""
    if not checkpoint_folder or not os.path.isdir(checkpoint_folder):
        return None
    best: tuple[int, str] | None = None
    for name in os.listdir(checkpoint_folder):
        m = CHECKPOINT_RE.match(name)
        path = os.path.join(checkpoint_folder, name)
        if m and os.path.isfile(os.path.join(path, CORE_STATE_FILE)):
            if best is None or int(m.group(1)) > best[0]:
                best = (int(m.group(1)), path)
    return best[1] if best else None


def _fsync_tree(path: str) -> None:
    """Flush every file of a finished checkpoint to disk before it is renamed into place."""
    for folder, _, files in os.walk(path):
        for name in files:
            _fsync_path(os.path.join(folder, name))
        _fsync_path(folder)


def _fsync_path(path: str) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)
