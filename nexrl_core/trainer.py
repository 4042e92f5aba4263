"""BaseTrainer: the training loop shared by every trainer plugin.

Loop: wait for a batch of whole groups from the pool (no older than the
staleness bound) -> ``train`` -> log metrics -> checkpoint (atomic) -> notify
the weight-sync controller, which pushes the new weights.
"""

from __future__ import annotations

import math
import time
from abc import abstractmethod
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, TypeVar

from .algorithms.registry import AlgorithmRegistry, AlgorithmSelection, select_algorithms
from .checkpoint import read_core_state, write_checkpoint
from .config.settings import Settings
from .errors import DataError, NexRLError
from .protocols import TaskSource, TrajectoryPoolHandle, WeightSyncHandle, wired
from .rollout_worker import failure_detail
from .runtime.eval_core import training_domain_metrics
from .runtime.execute import execute
from .runtime.threaded import ThreadedModule
from .runtime.train_service import TrainService
from .trajectory_keys import trajectory_problem
from .types import (
    DEFAULT_MODEL_TAG,
    SampleResult,
    TrainOutput,
    Trajectory,
    TrajectoryBatch,
    trajectory_reward,
    trajectory_token_versions,
)

_BATCH_WAIT_S = 0.1
S = TypeVar("S", bound=Settings)
# What samples.jsonl keeps of a trajectory and of its SampleResult (logger.samples_every), in this order.
SAMPLE_FIELDS = ("uid", "sample_index", "data_source", "prompt", "response", "reward", "advantage", "logprob_gap",
                 "score", "model_version", "token_versions", "sampling", "finish_reason", "failed", "error")
SAMPLE_RESULT_FIELDS = frozenset(f.name for f in fields(SampleResult))


@dataclass
class TrainerParts:
    """What a trainer is built with besides the recipe, built by the launcher in its process."""

    #: the estimators and losses a recipe may select (this run's plugins)
    algorithm_registry: AlgorithmRegistry | None = None
    #: builds the train service ``service.train_service`` selects, for this many training steps
    #: (called by :meth:`BaseTrainer.create_train_service`)
    train_service: Callable[[int], TrainService] | None = None
    #: builds the KL reference's inference client ``service.reference_service`` declares (None:
    #: none declared); called by :meth:`BaseTrainer.create_reference_service`
    reference_service: Callable[[], Any] | None = None


class BaseTrainer(ThreadedModule):
    """Subclasses implement :meth:`train`; self-hosted ones also the model-state methods.

    ``ALGORITHM_OPTIONS`` (name -> :class:`~nexrl_core.Option`) are the ``algorithm.*`` keys a
    trainer reads itself;
    ``ALGORITHM_SELECTORS`` (key -> kind) names those that pick a function from the algorithm
    registry (e.g. ``{"type": "advantage_estimator"}``), whose own keys are then accepted too
    (see :mod:`nexrl_core.algorithms.registry`).

    A trainer that drives a train service (:mod:`nexrl_core.runtime.train_service`) declares the batch
    format it builds (``TRAIN_SERVICE_BATCH_FORMAT``) and the service it uses by default
    (``TRAIN_SERVICE_DEFAULT``); :meth:`create_train_service` builds the one
    ``service.train_service.backend`` selects.
    """

    #: True for a trainer that keeps nothing between steps (the mock trainer): a checkpoint without
    #: files of its own resumes it exactly. Otherwise such a checkpoint is refused, never resumed
    #: from fresh weights.
    NO_MODEL_STATE = False
    ALGORITHM_SELECTORS: dict[str, str] = {}
    TRAIN_SERVICE_BATCH_FORMAT: str | None = None
    TRAIN_SERVICE_DEFAULT: str | None = None
    STOP_JOIN_TIMEOUT_S = 300.0  # a training step in flight finishes first
    #: the keys this trainer reads on every trajectory (a contract of
    #: :data:`nexrl_core.trajectory_keys.CONTRACTS`: self_hosted, remote_api, sft); None: not checked
    TRAJECTORY_CONTRACT: str | None = None
    LOOP_ERROR_ENDS_RUN = True

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        """``config``: the whole recipe; ``parts``: what the launcher built for this trainer
        (nexrl_core.launch.parts.build_module). Without them (built by hand) it has no algorithm
        registry and no train service. A subclass that defines ``__init__`` takes ``parts`` and
        hands them on."""
        super().__init__()
        from .config.options import component_options
        from .config.schema import CORE_OPTIONS, LoggerSettings, TrainerSettings, TrajectoryPoolSettings
        from .config.settings import read_section

        # Copies, every core default filled: the recipe (the algorithm, a service's own keys) and the
        # trainer section with this trainer's own keys too (a subclass reads them with its Settings'
        # own(self._config)). Sections are read alone: a recipe built by hand may lack what a run's
        # prologue sets (run_dir), so the whole is not RecipeSettings.
        self._full_config = recipe = read_section(config, CORE_OPTIONS, "")
        self._config = read_section(recipe["trainer"], {**(component_options(type(self)) or {}),
                                                        **TrainerSettings.options()}, "trainer")
        self._model_tag = str(recipe["service"]["inference_service"]["model_tag"] or DEFAULT_MODEL_TAG)
        self.total_train_steps = int(self._config["total_train_steps"])
        self.batch_size = TrajectoryPoolSettings.own(recipe["trajectory_pool"], "trajectory_pool").batch_size
        self.checkpoint_path = self._config["checkpoint_path"]
        self.save_freq = int(self._config["save_freq"])
        self.save_final = bool(self._config["save_final"])
        self.remove_previous_ckpt = bool(self._config["remove_previous_ckpt"])
        logger_settings = LoggerSettings.own(recipe["logger"], "logger")
        self.samples_every = logger_settings.samples_every
        self.samples_per_step = logger_settings.samples_per_step
        self.global_step = 0
        self._first_step_done = False  # this run's first training step (a resumed run's too) was taken
        self._trajectory_pool: TrajectoryPoolHandle | None = None
        self._weight_sync_controller: WeightSyncHandle | None = None
        self._dataloader: TaskSource | None = None
        parts = parts or TrainerParts()
        self._algorithm_registry = parts.algorithm_registry
        self._train_service_factory = parts.train_service  # builds the service `service.train_service` selects
        self._reference_factory = parts.reference_service

    def set_module_references(self, trajectory_pool: TrajectoryPoolHandle | None,
                              weight_sync_controller: WeightSyncHandle | None,
                              dataloader: TaskSource | None = None) -> None:
        self._trajectory_pool = trajectory_pool
        self._weight_sync_controller = weight_sync_controller
        self._dataloader = dataloader

    def _pool(self) -> TrajectoryPoolHandle:
        return wired(self._trajectory_pool, "trajectory pool")

    def _wsc(self) -> WeightSyncHandle:
        return wired(self._weight_sync_controller, "weight-sync controller")

    @property
    def algorithm_registry(self) -> AlgorithmRegistry:
        if self._algorithm_registry is None:
            raise NexRLError(f"{type(self).__name__} has no algorithm registry: build it with "
                             f"nexrl_core.testing.build_module (or pass parts=TrainerParts(algorithm_registry=...))")
        return self._algorithm_registry

    def select_algorithm(self, settings_cls: type[S]) -> tuple[AlgorithmSelection, S]:
        """The recipe's ``algorithm`` section against the registry: the functions it selects with
        every key's value, and this trainer's own keys as ``settings_cls`` (after the selected
        functions' recommended defaults). ConfigError as ``nexrl validate`` reports it; a trainer
        calls it once, in its constructor, so a bad section fails before any model loads."""
        selection = select_algorithms(type(self), self._full_config["algorithm"], self.algorithm_registry)
        return selection, settings_cls.own(selection.options, "algorithm")

    @classmethod
    def check_recipe(cls, recipe: dict[str, Any]) -> list[str]:
        """Rules that involve other sections of the recipe (the trainer is built with all of it):
        ``["<key>: why", ...]``, reported by ``nexrl validate`` and ``nexrl run`` alike. Values may
        have the wrong type here (the key checks report those)."""
        return []

    def create_train_service(self) -> TrainService:
        """The train service ``service.train_service`` selects, built from that section."""
        if not self.TRAIN_SERVICE_BATCH_FORMAT:
            raise NotImplementedError(f"{type(self).__name__} drives no train service (no TRAIN_SERVICE_BATCH_FORMAT)")
        if self._train_service_factory is None:
            raise NexRLError(f"{type(self).__name__} was given no train service: build it with "
                             f"nexrl_core.launch.parts.build_module")
        return self._train_service_factory(self.total_train_steps)

    def create_reference_service(self) -> Any:
        """The KL reference's inference client (``service.reference_service``; None when the
        recipe declares none): it scores tokens (``InferenceClient.score``) and receives no weights."""
        return self._reference_factory() if self._reference_factory is not None else None

    # -- to implement -----------------------------------------------------------------
    @abstractmethod
    def train(self, trajectories: list[Trajectory]) -> dict[str, float] | TrainOutput:
        """One training step on ``trajectories`` (read only: nothing is written into them); returns
        its metrics, or a :class:`~nexrl_core.TrainOutput` with them and what it computed per sample."""

    def initialize_workers(self) -> None:
        """Build the training backend (model, optimizer). Called once before the run."""

    def save_model_state(self, folder: str) -> None:
        """Write model/optimizer/RNG state into ``folder`` (safetensors/JSON only)."""

    def load_model_state(self, folder: str) -> None:
        """Restore what :meth:`save_model_state` wrote."""

    def export_weights(self) -> dict[str, Any]:
        """Current weights for an in-process weight sync."""
        raise NotImplementedError(f"{type(self).__name__} has no weights to export")

    def export_adapter(self, folder: str) -> None:
        """Write the LoRA adapter being trained, in PEFT's format (``adapter_config.json``,
        ``adapter_model.safetensors``), into the existing folder ``folder``: what an adapter-only
        weight sync sends (vLLM's ``vllm_lora``). NotImplementedError when no adapter trains."""
        raise NotImplementedError(f"{type(self).__name__} trains no LoRA adapter")

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Log-probs of the given ``(prompt ids, response ids, temperature)`` rows under the current
        weights, as :meth:`nexrl_core.InferenceClient.score` returns them: what the weight-sync
        controller compares with the inference service after each push (``weight.verify_served``).
        A trainer that cannot is skipped by that check (raise NotImplementedError)."""
        raise NotImplementedError(f"{type(self).__name__} cannot score tokens")

    @classmethod
    def export_checkpoint(cls, checkpoint: str, out: str, dtype: str | None = None, merged: bool = False) -> None:
        """Write the model of ``checkpoint`` (a ``global_step_<N>`` folder this trainer saved) into
        the existing empty folder ``out`` for inference, without optimizer or RNG state; ``dtype``
        (float32 | bfloat16 | float16) casts floating-point weights (``nexrl export``). A checkpoint
        of LoRA adapters exports its adapter, or with ``merged`` the model with the adapter merged in.

        A trainer whose checkpoints hold a model overrides this; the checkpoint names its trainer
        in ``nexrl_state.json``, so ``nexrl export`` finds the right one.
        """
        raise NexRLError(f"trainer {cls.__name__} cannot export its checkpoints' weights (it does not implement "
                         f"BaseTrainer.export_checkpoint)")

    def close(self) -> None:
        """Release the train service's connections; called once the run has stopped (and saved)."""

    # -- lifecycle (the thread itself: ThreadedModule) ---------------------------------------
    def is_done(self) -> bool:
        return self.global_step >= self.total_train_steps

    def get_global_step(self) -> int:
        return self.global_step

    def get_status(self) -> dict[str, Any]:
        return {**super().get_status(), "global_step": self.global_step, "done": self.is_done()}

    def _loop_finished_normally(self) -> bool:
        return self.is_done()

    def _main_loop(self) -> None:
        t0 = time.perf_counter()  # the wait for a batch counts from the end of the previous step
        while not self._should_stop() and not self.is_done():
            min_version = execute(self._wsc().min_trainable_version, self._model_tag)
            batch = execute(self._pool().get_batch, self.batch_size, self._model_tag, min_version,
                            _BATCH_WAIT_S)
            if batch is None:
                continue
            try:
                self._train_step(batch, time.perf_counter() - t0)
            except Exception as exc:
                # run.log gets the traceback; the console shows the message once, as the run's final error
                self._activity_tracker.report_exception(self._module_name, f"train step {self.global_step + 1}", exc,
                                                        console=False)
                raise  # ends the loop; get_last_error() tells the controller
            t0 = time.perf_counter()

    def _train_step(self, batch: TrajectoryBatch, wait_s: float) -> None:
        execute(self._wsc().train_worker_notify_step_start, self._module_name, self._model_tag)
        trajectories = batch.trajectories
        usable_at = [i for i, t in enumerate(trajectories) if not t.get("failed")]
        usable = [trajectories[i] for i in usable_at]
        for t in usable:
            self.check_trajectory(t)
        t0 = time.perf_counter()
        with self._activity_tracker.track(self._module_name, "train", auto_report_errors=False):  # _main_loop does
            output = self.train(usable) if usable else {}
        train_s = time.perf_counter() - t0
        metrics, results = (dict(output.metrics), output.samples) if isinstance(output, TrainOutput) \
            else (dict(output), {})
        # by the sample's place in the whole batch (failed ones included), as samples.jsonl picks
        per_sample = {usable_at[self._sample_index(i, len(usable))]: r for i, r in results.items()}
        self.global_step += 1
        self._activity_tracker.set_training_step(self.global_step)
        metrics.update(self._core_metrics(trajectories, usable, wait_s, train_s))
        dropped = None if batch.dropped_groups is None else list(batch.dropped_groups)
        metrics.update(training_domain_metrics(trajectories, dropped))
        if self._dataloader is not None:
            execute(self._dataloader.mark_done, [t["seq"] for t in trajectories if t.get("seq") is not None])
        for t in trajectories:  # consumed for good: a failed item is lost now, one row each
            if t.get("failed"):
                self._activity_tracker.record_lost_item(t.get("task") or t, str(t.get("error_cause", "failed")),
                                                        str(t.get("error", "")), False, self.global_step,
                                                        failure_detail(t))
        self._activity_tracker.experiment_logger_post("metrics", data=metrics, step=self.global_step)
        if self._samples_due():
            self._activity_tracker.record_samples(self.global_step, self._pick_samples(trajectories, per_sample))
        self._first_step_done = True
        if self._checkpoint_due():
            self.save_checkpoint()
        execute(self._wsc().train_worker_notify_weight_update, self._module_name, self._model_tag)

    def _checkpoint_due(self) -> bool:
        """Every ``save_freq`` steps, and after the last step when ``save_freq`` or ``save_final`` asks."""
        if self.is_done():
            return self.save_freq > 0 or self.save_final
        return self.save_freq > 0 and self.global_step % self.save_freq == 0

    def check_trajectory(self, trajectory: Trajectory) -> None:
        """The pool boundary: a trajectory lacking a key this trainer reads
        (``TRAJECTORY_CONTRACT``) stops the step with one line naming the key and the worker."""
        if self.TRAJECTORY_CONTRACT is None:
            return
        problem = trajectory_problem(trajectory, self.TRAJECTORY_CONTRACT)
        if problem is not None:
            worker = trajectory.get("rollout_worker") or "its rollout worker"
            name = self._config.get("type")
            label = f"'{name}'" if name and name != "python" else type(self).__name__
            raise DataError(f"trajectory {trajectory.get('uid')}#{trajectory.get('sample_index')} from {worker} "
                            f"{problem}; trainer {label} reads it (the "
                            f"{self.TRAJECTORY_CONTRACT} keys of docs/extending.md)")

    def _samples_due(self) -> bool:
        """samples.jsonl gets this step's samples: every ``logger.samples_every`` steps, and the first
        and the last step of the run (a short run shows what the model says too)."""
        if self.samples_every <= 0 or self.samples_per_step <= 0:
            return False
        return self.global_step % self.samples_every == 0 or not self._first_step_done or self.is_done()

    def _sample_index(self, index: Any, count: int) -> int:
        """``index`` of a :class:`~nexrl_core.TrainOutput` sample, or an error naming the trainer."""
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < count:
            raise NexRLError(f"{type(self).__name__}.train returned a SampleResult for sample {index!r} of the "
                             f"{count} it was given (TrainOutput.samples is keyed by their index)")
        return index

    def _pick_samples(self, trajectories: Sequence[Trajectory],
                      results: Mapping[int, SampleResult]) -> list[dict[str, Any]]:
        """``samples_per_step`` trajectories spread over the batch (no random draw: the run's
        random streams stay as they are), as samples.jsonl rows with what the step computed for each."""
        n = len(trajectories)
        k = min(self.samples_per_step, n)
        picked = sorted({i * n // k for i in range(k)}) if k else []
        rows = []
        for i in picked:
            computed = results[i].as_record() if i in results else {}
            row = {f: computed.get(f) if f in SAMPLE_RESULT_FIELDS else trajectories[i].get(f) for f in SAMPLE_FIELDS}
            rows.append({f: v for f, v in row.items() if v is not None})
        return rows

    def _core_metrics(self, trajectories: Sequence[Trajectory], usable: list[Trajectory], wait_s: float,
                      train_s: float) -> dict[str, float]:
        rewards = [trajectory_reward(t) for t in usable]
        version = execute(self._wsc().get_train_model_version, self._model_tag)
        staleness = [version - int(t.get("model_version", version)) for t in usable]
        # per trained token: a trajectory whose tokens span a weight update has several versions
        token_staleness = [version - v for t in usable for v in trajectory_token_versions(t)]
        sync_stats = execute(self._wsc().get_sync_stats)
        sync_s = float(sync_stats["last_sync_s"])
        tokens = _response_tokens(usable)
        step_s = wait_s + train_s + sync_s
        if tokens and step_s > 0:  # over the whole step (the last sync stands for this one's)
            tokens["timing/response_tokens_per_s"] = tokens["train/num_response_tokens"] / step_s
        out = {
            "train/reward_mean": sum(rewards) / len(rewards) if rewards else 0.0,
            "train/num_trajectories": float(len(usable)),
            "train/num_failed": float(len(trajectories) - len(usable)),
            **tokens,
            "train/staleness_max": float(max(staleness, default=0)),
            "train/staleness_mean": sum(staleness) / len(staleness) if staleness else 0.0,
            "train/token_staleness_max": float(max(token_staleness, default=0)),
            "train/token_staleness_mean": sum(token_staleness) / len(token_staleness) if token_staleness else 0.0,
            "timing/wait_batch_s": wait_s,  # rollouts of this batch, in sync mode
            "timing/weight_sync_s": sync_s,
            "timing/train_s": train_s,
        }
        # the served-version probe of the last push (weight.verify_served), as timing/weight_sync_s is
        out.update({k: float(v) for k, v in sync_stats.items() if k.startswith("weight/")})
        for name, value in execute(self._pool().counters).items():
            out[f"pool/{name}"] = float(value)
        out.update(_score_means(usable))
        return out

    # -- checkpoints ----------------------------------------------------------------------
    def core_state(self) -> dict[str, Any]:
        # ``trainer``: the registered name of the trainer that wrote the checkpoint (nexrl export asks it)
        state: dict[str, Any] = {"global_step": self.global_step, "trainer": self._config.get("type")}
        if state["trainer"] == "python":  # loaded from a file: nexrl export loads it the same way
            state.update(trainer_path=getattr(type(self), "source_path", None), trainer_class=type(self).__name__)
        if self._dataloader is not None:
            state["dataloader"] = execute(self._dataloader.state_dict)
        if self._weight_sync_controller is not None:
            weight_sync = execute(self._weight_sync_controller.state_dict)
            # Saved before this step's weights are pushed: the saved weights are version global_step.
            weight_sync["train_version"] = {**weight_sync.get("train_version", {}), self._model_tag: self.global_step}
            state["weight_sync"] = weight_sync
        if self._trajectory_pool is not None:
            state["trajectory_pool"] = execute(self._trajectory_pool.state_dict)
        return state

    def save_checkpoint(self) -> str | None:
        """Write ``<checkpoint_path>/global_step_<N>`` atomically (see :mod:`nexrl_core.checkpoint`)."""
        if not self.checkpoint_path:
            return None
        return write_checkpoint(str(self.checkpoint_path), self.global_step, self.save_model_state, self.core_state,
                                keep_only_latest=self.remove_previous_ckpt)

    def resume_checkpoint(self, folder: str) -> dict[str, Any]:
        """Restore model state and return the core state saved with it."""
        state = read_core_state(folder)
        self.load_model_state(folder)
        self.global_step = int(state["global_step"])
        return state


def _response_tokens(trajectories: list[Trajectory]) -> dict[str, float]:
    """``train/num_response_tokens`` when every trajectory carries its response token ids."""
    lengths = [len(t["response_token_ids"]) for t in trajectories if t.get("response_token_ids") is not None]
    return {"train/num_response_tokens": float(sum(lengths))} if lengths and len(lengths) == len(trajectories) else {}


def _score_means(trajectories: list[Trajectory]) -> dict[str, float]:
    """``rollout/<name>``: the mean of each number in the batch's ``score`` dicts (the evaluator's
    metrics and a worker's counts, e.g. an agent's ``called_tool``), over the trajectories that
    report it; the reward has its own metric."""
    sums: dict[str, list[float]] = {}
    for traj in trajectories:
        for name, value in (traj.get("score") or {}).items():
            if name != "reward" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                sums.setdefault(name, []).append(float(value))
    return {f"rollout/{name}": sum(values) / len(values) for name, values in sorted(sums.items())}
