"""WeightSyncController: when rollouts may run, when weights move, when validation runs.

Versions: the trainer's version is its global step (0 = initial weights); the
rollout version is the version the inference service serves. Every trajectory
carries the version that produced it.

Modes (``weight.sync_mode``):
- ``sync``: once a batch is ready, rollouts block until the trainer's new weights
  are served; the trainer only ever sees trajectories of its current version, and takes a
  batch only when every admitted rollout has landed (reproducible runs: docs/reliability.md).
- ``batch-async``: rollouts block only when ``train_version + 1 - rollout_version
  > staleness_threshold``, where ``train_version + 1`` counts the steps the trainer
  has started (it is producing that version): rollouts may run ahead of the
  weights by at most ``staleness_threshold`` versions.
- ``fully-async``: rollouts never block; weights are still pushed after every step.
In the async modes ``weight.rollouts_ahead`` also bounds the training rollouts started and not yet
taken by the trainer (decoding, or waiting in the pool): the engine generates the next batches while
the trainer steps, and none that would come out staler than the bound (see :meth:`bound_rollouts_ahead`).
In every mode the trainer gets no trajectory older than ``train_version -
staleness_threshold`` (0 in sync mode): older groups are re-rolled and counted.
In the async modes a backend that can pushes in the background (:meth:`WeightSyncBackend.sync_in_background`,
the in-process engine's ``weight.background_push``): the trainer goes on once the service holds the weights,
the served version moves when they are in, and a push that fails stops the trainer at its next step.
"""

from __future__ import annotations

import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Mapping
from typing import Any, Literal

from loguru import logger

from .config.options import component_options
from .config.schema import WeightSettings
from .config.settings import Section, read_section
from .errors import NexRLError
from .protocols import TaskSource, TrajectoryPoolHandle
from .runtime.execute import execute
from .runtime.module import NexRLModule
from .types import DEFAULT_MODEL_TAG, ModelTag


class WeightSyncBackend(ABC):
    """How trained weights reach the inference service. Built with the recipe's ``weight`` section:
    ``self.config`` is that section (a copy, every key the core and this backend declare
    filled), ``self.core_settings`` the core's keys of it, typed."""

    @classmethod
    def own_section(cls, config: Mapping[str, Any] | None, path: str = "weight") -> Section:
        """``config`` as this backend reads it: the core's ``weight`` keys and its own, defaults filled."""
        return read_section(config, {**(component_options(cls) or {}), **WeightSettings.options()}, path)

    def __init__(self, config: Mapping[str, Any] | None):
        self.config = type(self).own_section(config)
        self.core_settings = WeightSettings.own(self.config, "weight")

    @abstractmethod
    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        """Make ``inference_client`` serve the trainer's current weights as ``version``."""

    def sync_in_background(self, trainer: Any, inference_client: Any, version: int, after_apply: Callable[[], None],
                           on_done: Callable[[BaseException | None], None]) -> bool:
        """An async mode's push off the trainer's thread: hand ``inference_client`` the trainer's current
        weights and return once the trainer may go on (its next optimizer step must not change what the
        service still reads). The service then calls ``after_apply()`` once they are in and before it
        samples under them (an exception from it fails the push: nothing is sampled under them), and
        ``on_done(error)`` once, success or not (possibly before this returns). False: this backend
        cannot (nothing was done; the controller calls :meth:`sync`)."""
        return False


class VersionOnlyWeightSync(WeightSyncBackend):
    """For services that need no weight transfer (test backends, frozen references)."""

    # (also what a controller built without a backend uses: only the served version number moves)

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        execute(inference_client.set_model_version, version)


# The served-version probe: fixed token ids every vocabulary has (ids 100..111), scored at temperature 1.
# Ordinary tokens (single characters in byte-level vocabularies), not the special tokens of the lowest
# ids: those get log-probs near -24, where two correct engines differ by up to 2e-2 (vLLM's CPU kernels
# against torch, measured) while on ordinary tokens they agree within 6e-5. Short: its cost is the
# forward's per-layer overhead (SmolLM2 on 2 CPU cores: about 65 ms a side).
PROBE: list[tuple[list[int], list[int], float]] = [(list(range(100, 104)), list(range(104, 112)), 1.0)]


_STOP_WAIT_S = 30.0  # how long stop() waits for a background push to land


def _max_gap(a: list[list[float]], b: list[list[float]]) -> float:
    gaps = [abs(x - y) for row_a, row_b in zip(a, b) for x, y in zip(row_a, row_b)]
    return max(gaps, default=0.0)


class WeightSyncController(NexRLModule):
    """``backend``: the ``weight.backend`` the launcher built (nexrl_core.launch.parts); None: version only."""

    def __init__(self, config: Mapping[str, Any], backend: WeightSyncBackend | None = None):
        """``config``: the recipe's ``weight`` section (it also holds the backend's own keys)."""
        super().__init__()
        settings = WeightSettings.own(config, "weight")
        self._mode = settings.sync_mode
        self._staleness = 0 if self._mode == "sync" else settings.staleness_threshold
        self._validate_freq = settings.validate_freq
        self._ahead_setting = settings.rollouts_ahead
        self._ahead_limit: int | None = None  # set by bound_rollouts_ahead, once the batch size is known
        # Training rollouts admitted and not yet settled (taken by the trainer, dropped or re-rolled).
        self._unsettled: dict[ModelTag, int] = {}
        self._update_every = settings.model_update_frequency
        self._backend = backend if backend is not None else VersionOnlyWeightSync(config)
        verify = settings.verify_served
        # A backend that moves no weights (version only) has nothing to verify.
        self._verify = "false" if isinstance(self._backend, VersionOnlyWeightSync) else \
            ("auto" if verify == "auto" else "true" if verify else "false")
        self._probe_tolerance = settings.served_probe_tolerance
        self._probe_said: set[str] = set()
        self._trainer_probe: list[list[float]] | None = None  # the trainer's probe at the last push
        self._served_after: list[list[float]] | None = None  # the service's probe after the last push
        self.last_probe: dict[str, float] = {}
        self._cond = threading.Condition()
        self._train_version: dict[ModelTag, int] = {}
        self._rollout_version: dict[ModelTag, int] = {}
        self._batch_ready: dict[ModelTag, bool] = {}
        self._steps_started: dict[ModelTag, int] = {}
        # Sync mode: training rollouts started for the served version (see set_rollout_budget).
        self._rollout_budget: int | None = None
        self._admitted: dict[ModelTag, int] = {}
        self._in_flight: dict[ModelTag, int] = {}
        # Sync mode: groups dynamic sampling dropped, whose replacements wait for the round to land.
        self._held: dict[ModelTag, int] = {}
        self._waiting_for_validation = False
        self._stopping = False
        self._trainer: Any = None  # what the backend reads the weights from (its own business)
        self._inference_client: Any = None  # the backend's business, as the trainer
        self._trajectory_pool: TrajectoryPoolHandle | None = None
        self._dataloader: TaskSource | None = None
        self.sync_count = 0
        self.last_sync_s = 0.0  # the trainer's part of the last push (all of it unless pushed in the background)
        self.last_apply_s = 0.0  # the last background push, from its start to the weights served
        self._pushing: threading.Event | None = None  # set once the background push under way is done
        self._push_error: str | None = None  # why a background push failed: the trainer stops at its next step

    @property
    def sync_mode(self) -> str:
        return self._mode

    @property
    def staleness_threshold(self) -> int:
        return self._staleness

    def _health_locks(self) -> dict[str, Any]:
        return {"weight-sync": self._cond}

    def set_module_references(self, dataloader: Any, trajectory_pool: Any, trainer: Any = None,
                              inference_client: Any = None) -> None:
        self._dataloader = dataloader
        self._trajectory_pool = trajectory_pool
        self._trainer = trainer
        self._inference_client = inference_client

    # -- rollout side -------------------------------------------------------------
    def set_rollout_budget(self, tasks: int | None) -> None:
        """Sync mode: start at most ``tasks`` training rollouts per served weight version
        (``weight.rollout_limit``, default ``batch``: ``trajectory_pool.batch_size``). Rollouts
        started beyond one batch are waited for (:meth:`wait_rollouts_landed`) and re-rolled: wasted
        work, and their number depends on timing. Rollouts that do not reach the pool (re-rolled
        tasks) give their slot back; if everything started has landed and still no batch is ready
        (e.g. the pool re-queued evicted members), more are admitted, so this never stalls.
        None: no limit."""
        with self._cond:
            self._rollout_budget = int(tasks) if tasks and self._mode == "sync" else None
            self._cond.notify_all()

    def bound_rollouts_ahead(self, batch_size: int) -> int | None:
        """Async modes with ``weight.rollouts_ahead``: admit a training rollout only while fewer
        than that many are unsettled ('staleness': ``max(staleness_threshold, 1) x batch_size``).
        A rollout is settled when the trainer takes it in a batch, when the pool drops or re-rolls
        it (:meth:`rollouts_settled`, :meth:`return_rollout_slots`) and when it does not land
        (:meth:`end_rollout`). So with the bound S batches the engine decodes the next S batches
        while the trainer steps, under weights at most S versions older than the step that trains
        them: within the staleness bound, nothing decoded only to be re-rolled as stale. Returns
        the bound (None: none)."""
        setting = self._ahead_setting
        with self._cond:
            if setting is None or self._mode == "sync":
                self._ahead_limit = None
            elif setting == "staleness":
                self._ahead_limit = max(self._staleness, 1) * int(batch_size)
            else:
                self._ahead_limit = int(setting)
            self._cond.notify_all()
            return self._ahead_limit

    def rollouts_settled(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, count: int = 1) -> None:
        """``count`` landed training rollouts left the pool: taken by the trainer, or dropped as too
        stale or evicted from their group (their tasks are re-rolled, admitted afresh)."""
        if count <= 0:
            return
        with self._cond:
            self._unsettled[model_tag] = max(0, self._unsettled.get(model_tag, 0) - int(count))
            if self._ahead_limit is not None:
                self._cond.notify_all()

    def rollouts_unsettled(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        """Training rollouts admitted and not yet settled (decoding, or waiting in the pool)."""
        with self._cond:
            return self._unsettled.get(model_tag, 0)

    def begin_rollout(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> bool:
        """Admit one training rollout, or False when rollouts must wait (:meth:`wait_rollout_allowed`).
        Every admitted rollout is ended with :meth:`end_rollout`."""
        with self._cond:
            if self._blocked_locked(model_tag):
                return False
            self._admitted[model_tag] = self._admitted.get(model_tag, 0) + 1
            self._in_flight[model_tag] = self._in_flight.get(model_tag, 0) + 1
            self._unsettled[model_tag] = self._unsettled.get(model_tag, 0) + 1
            return True

    def end_rollout(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, landed: bool = True) -> None:
        """An admitted rollout finished; ``landed``: its trajectory went to the pool (not re-rolled)."""
        with self._cond:
            in_flight = self._in_flight[model_tag] = max(0, self._in_flight.get(model_tag, 0) - 1)
            if not landed:
                self._admitted[model_tag] = max(0, self._admitted.get(model_tag, 0) - 1)
                self._unsettled[model_tag] = max(0, self._unsettled.get(model_tag, 0) - 1)
            # Only a returned slot or the last landing can unblock a waiting worker; waking every
            # rollout thread on each landing costs more than the rollout itself with many workers.
            if not landed or in_flight == 0:
                self._cond.notify_all()

    def hold_rollouts(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> bool:
        """Sync mode: dynamic sampling dropped a group; no new rollout starts until its replacement
        is asked for (:meth:`return_rollout_slots` with ``released``). The pool asks once every
        admitted rollout has landed, for all the round's dropped groups in issue order, so which
        rows replace them never depends on thread timing. Other modes: False (nothing held; the
        pool replaces at once)."""
        if self._mode != "sync":
            return False
        with self._cond:
            self._held[model_tag] = self._held.get(model_tag, 0) + 1
            return True

    def return_rollout_slots(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, count: int = 1, released: int = 0) -> None:
        """Sync mode: ``count`` rollouts that landed will not be trained on (dynamic sampling dropped
        their group): their slots of the rollout budget go to the replacements. ``released``: held
        groups (:meth:`hold_rollouts`) whose replacements are now asked for."""
        with self._cond:
            self._admitted[model_tag] = max(0, self._admitted.get(model_tag, 0) - int(count))
            self._unsettled[model_tag] = max(0, self._unsettled.get(model_tag, 0) - int(count))
            self._held[model_tag] = max(0, self._held.get(model_tag, 0) - int(released))
            self._cond.notify_all()

    def begin_rollouts(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, count: int = 1) -> int:
        """Admit up to ``count`` rollouts at once (:meth:`begin_rollout` each); returns how many."""
        admitted = 0
        while admitted < count and self.begin_rollout(model_tag):
            admitted += 1
        return admitted

    def end_rollouts(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, landed: int = 0, returned: int = 0) -> None:
        """:meth:`end_rollout` for ``landed`` rollouts that reached the pool and ``returned`` that did not."""
        for _ in range(landed):
            self.end_rollout(model_tag, True)
        for _ in range(returned):
            self.end_rollout(model_tag, False)

    def wait_rollouts_landed(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, timeout: float | None = None) -> bool:
        """Sync mode: block until no admitted training rollout is in flight (False on timeout).
        The pool calls this before handing out a batch: with every rollout of the served version
        landed, the batch can be the earliest-issued groups rather than the first finished ones.
        Other modes: True at once (their batches never wait for stragglers)."""
        if self._mode != "sync":
            return True
        with self._cond:
            return self._cond.wait_for(lambda: self._stopping or self._in_flight.get(model_tag, 0) == 0, timeout)

    def check_rollout_service_status(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> Literal["continue", "block"]:
        with self._cond:
            return "block" if self._blocked_locked(model_tag) else "continue"

    def wait_rollout_allowed(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, timeout: float | None = None) -> bool:
        """Block until rollouts for ``model_tag`` may continue; False on timeout."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._blocked_locked(model_tag), timeout)

    def _blocked_locked(self, tag: ModelTag) -> bool:
        if self._stopping:
            return False
        if self._waiting_for_validation:
            return True
        if self._mode == "sync":
            if self._batch_ready.get(tag, False) or self._held.get(tag, 0):
                return True
            budget = self._rollout_budget
            return budget is not None and self._admitted.get(tag, 0) >= budget and self._in_flight.get(tag, 0) > 0
        if self._ahead_limit is not None and self._unsettled.get(tag, 0) >= self._ahead_limit:
            return True
        if self._mode == "batch-async":
            started, rollout = self._steps_started.get(tag, 0), self._rollout_version.get(tag, 0)
            return started - rollout > self._staleness
        return False

    def trajectory_pool_notify_batch_ready(self, model_tag: ModelTag = DEFAULT_MODEL_TAG,
                                           min_version: int | None = None) -> None:
        """A batch is ready. ``min_version``: the oldest version the pool counted as trainable;
        a signal computed before the last weight update (now stale) is ignored, otherwise
        sync mode would block rollouts for a batch the trainer will re-roll."""
        with self._cond:
            if min_version is not None and min_version < self._train_version.get(model_tag, 0) - self._staleness:
                return
            self._batch_ready[model_tag] = True
            self._cond.notify_all()

    def get_rollout_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._cond:
            return self._rollout_version.get(model_tag, 0)

    def get_train_model_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        with self._cond:
            return self._train_version.get(model_tag, 0)

    def min_trainable_version(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> int:
        """Oldest trajectory version the trainer may still consume."""
        with self._cond:
            return self._train_version.get(model_tag, 0) - self._staleness

    # -- trainer side -------------------------------------------------------------
    def train_worker_notify_step_start(self, worker_name: str, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        """The trainer took a batch and is producing the next version (a failed background push stops it here)."""
        self._raise_push_error()
        with self._cond:
            self._steps_started[model_tag] = self._train_version.get(model_tag, 0) + 1
            self._cond.notify_all()

    def train_worker_notify_weight_update(self, worker_name: str, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        """The trainer finished a step: push the weights, then maybe ask for validation."""
        with self._cond:
            # Never move weights under a running validation: it must see one version.
            self._cond.wait_for(lambda: not self._waiting_for_validation or self._stopping)
            self._train_version[model_tag] = self._train_version.get(model_tag, 0) + 1
            version = self._train_version[model_tag]
        validate = self._validate_freq > 0 and version % self._validate_freq == 0
        if version % self._update_every == 0 or validate:  # a validation sees the weights it is named after
            self.sync_weight_to_rollout_service(model_tag, background=not validate)
        with self._cond:
            self._batch_ready[model_tag] = False
            if validate:
                self._waiting_for_validation = True
            self._cond.notify_all()
        logger.debug(f"{worker_name} -> weights v{version} ({self._mode})")

    def sync_weight_to_rollout_service(self, model_tag: ModelTag = DEFAULT_MODEL_TAG, background: bool = False) -> None:
        """Push the trainer's weights as its current version. ``background`` (async modes, a backend that
        can: :meth:`WeightSyncBackend.sync_in_background`): return once the service holds them; it
        applies them and answers the served-version probe on its own thread. The trainer's probe is
        taken here (its weights are the pushed ones until its next optimizer step). A push waits for
        the one before it; a failed background push stops the trainer at its next step
        (:meth:`train_worker_notify_step_start`) and marks this module faulty."""
        self._wait_pushed()
        self._raise_push_error()
        with self._cond:
            version = self._train_version.get(model_tag, 0)
        pool = self._trajectory_pool
        started = time.perf_counter()
        if pool is not None:
            execute(pool.notify_weight_sync_starting, model_tag)
        handed = False
        try:
            if self._inference_client is not None:
                # what the service served before this push: the last push's probe, else asked now
                before = (self._served_after or self._served_probe()) if self._verify != "false" else None
                if background and self._mode != "sync":
                    handed = self._push_in_background(model_tag, version, before, started)
                if not handed:
                    self._backend.sync(self._trainer, self._inference_client, version)
                    if before is not None:
                        self._verify_served(version, before)
        except Exception as exc:
            # rollouts would go on sampling stale weights: nothing to retry here, the run must stop
            self.mark_faulty(f"pushing weights v{version} to the inference service failed: {type(exc).__name__}: {exc}")
            raise
        finally:
            if pool is not None:
                execute(pool.unlock_for_weight_sync, model_tag)
        if handed:
            with self._cond:
                self.last_sync_s = time.perf_counter() - started
            return
        self._pushed(model_tag, version, started)

    def _pushed(self, model_tag: ModelTag, version: int, started: float) -> None:
        with self._cond:
            self._rollout_version[model_tag] = version
            self._admitted[model_tag] = 0  # a new version: a new batch of rollouts
            self.sync_count += 1
            self.last_sync_s = time.perf_counter() - started
            self._cond.notify_all()

    def _push_in_background(self, model_tag: ModelTag, version: int, before: list[list[float]] | None,
                            started: float) -> bool:
        pushing, probed = threading.Event(), threading.Event()
        pusher = threading.get_ident()
        probe: list[list[list[float]] | None] = []

        def trainer_probe() -> None:
            # on the pushing (trainer's) thread: its weights are the pushed ones until its next step
            try:
                probe.append(self._trainer_score())
            finally:
                probe.append(None)  # (when it raised: nothing to judge; the trainer hears the error)
                probed.set()

        def after_apply() -> None:  # the service's side: the weights in, nothing sampled under them yet
            if before is None:
                return
            if threading.get_ident() == pusher and not probed.is_set():  # the service pushed in the foreground
                trainer_probe()
            probed.wait()
            if probe[0] is not None:
                self._judge_served(version, before, probe[0], execute(self._inference_client.score, PROBE))

        def on_done(error: BaseException | None) -> None:
            with self._cond:
                if error is None:
                    self._rollout_version[model_tag] = version
                    self._admitted[model_tag] = 0
                    self.sync_count += 1
                    self.last_apply_s = time.perf_counter() - started
                elif not self._stopping:
                    self._push_error = f"pushing weights v{version} to the inference service failed: " \
                                       f"{type(error).__name__}: {error}"
                self._cond.notify_all()
            if error is not None and not self._stopping:
                self.mark_faulty(str(self._push_error))
                logger.error(self._push_error)
            pushing.set()

        self._pushing = pushing
        try:
            handed = self._backend.sync_in_background(self._trainer, self._inference_client, version, after_apply,
                                                      on_done)
        except BaseException:
            pushing.set()
            raise
        if not handed:
            pushing.set()
        elif before is not None and not probed.is_set():
            trainer_probe()  # while the service copies the weights; its check waits for this
        return handed

    def _wait_pushed(self, timeout: float | None = None) -> bool:
        """Wait for the background push under way, if any (False: still under way after ``timeout``)."""
        pushing = self._pushing
        return pushing is None or pushing.wait(timeout)

    def _raise_push_error(self) -> None:
        with self._cond:
            error = self._push_error
        if error is not None:
            raise NexRLError(error)

    def get_sync_stats(self) -> dict[str, float]:
        """Pushes so far, how long the last one held the trainer (seconds), and its served-version probe
        (``weight/served_probe_gap``, ``weight/served_version_ok``) when one ran; after a background push
        also ``weight/apply_s``: from its start until the service served it."""
        with self._cond:
            applied = {"weight/apply_s": self.last_apply_s} if self.last_apply_s else {}
            return {"sync_count": self.sync_count, "last_sync_s": self.last_sync_s, **applied, **self.last_probe}

    # -- served-version probe (weight.verify_served) -----------------------------------
    def _probe_unavailable(self, why: str) -> None:
        if self._verify == "true":
            raise NexRLError(f"weight.verify_served: true, but {why}; set weight.verify_served: auto or false")
        if why not in self._probe_said:
            self._probe_said.add(why)
            logger.info(f"weight.verify_served: no served-version probe ({why})")
        self._verify = "false"

    def _served_probe(self) -> list[list[float]] | None:
        """The inference service's log-probs of :data:`PROBE` as it serves now (None: it cannot score)."""
        score = getattr(self._inference_client, "score", None)
        if score is None:
            self._probe_unavailable(f"the inference service {type(self._inference_client).__name__} cannot score tokens")
            return None
        try:
            return execute(score, PROBE)
        except NotImplementedError as exc:
            self._probe_unavailable(f"the inference service cannot score tokens ({exc})")
            return None

    def _trainer_score(self) -> list[list[float]] | None:
        """The trainer's log-probs of :data:`PROBE` (None: it cannot score)."""
        score = getattr(self._trainer, "score", None)
        try:
            if score is None:
                raise NotImplementedError(type(self._trainer).__name__)
            return execute(score, PROBE)
        except NotImplementedError as exc:
            self._probe_unavailable(f"the trainer cannot score tokens ({exc})")
            return None

    def _verify_served(self, version: int, before: list[list[float]]) -> None:
        """After a push: the served model should score :data:`PROBE` as the trainer does (:meth:`_judge_served`)."""
        trainer = self._trainer_score()
        if trainer is not None:
            self._judge_served(version, before, trainer, execute(self._inference_client.score, PROBE))

    def _judge_served(self, version: int, before: list[list[float]], trainer: list[list[float]],
                      after: list[list[float]]) -> None:
        """The served probe ``after`` a push against the trainer's, within ``served_probe_tolerance``.
        Served log-probs that did not move at all while the trainer's moved beyond the tolerance since
        the last push mean the weights never arrived: the run stops, whatever the mode. (A push of
        unchanged weights, the first push included, changes nothing served; a bf16 engine scores
        further from a float32 trainer: neither is an error in ``auto``.)"""
        self._served_after = after
        gap = _max_gap(after, trainer)
        previous, self._trainer_probe = self._trainer_probe, trainer
        moved = previous is not None and _max_gap(trainer, previous) > self._probe_tolerance
        lost = moved and _max_gap(after, before) == 0.0
        with self._cond:
            self.last_probe = {"weight/served_probe_gap": gap, "weight/served_version_ok": float(not lost)}
        if gap <= self._probe_tolerance:
            return
        what = (f"after pushing weights v{version}, the inference service scores the probe {gap:.3g} away from the "
                f"trainer (weight.served_probe_tolerance {self._probe_tolerance:g})")
        if lost:
            raise NexRLError(f"{what}, and exactly as it did before the push though the trainer's weights moved: "
                             f"the new weights did not reach it (weight.backend {type(self._backend).__name__})")
        if self._verify == "true":
            raise NexRLError(f"{what} (weight.verify_served: true)")
        if "gap" not in self._probe_said:
            self._probe_said.add("gap")
            logger.warning(f"weight.verify_served: {what}; said once: the served model follows the trainer's "
                           f"pushes, so this is the precision it computes in (a bf16 engine, say); "
                           f"weight/served_probe_gap is logged each step")

    # -- validation -----------------------------------------------------------------
    def request_validation(self) -> None:
        with self._cond:
            self._waiting_for_validation = True
            self._cond.notify_all()

    def is_waiting_for_validation(self) -> bool:
        with self._cond:
            return self._waiting_for_validation

    def end_validate(self, model_tag: ModelTag = DEFAULT_MODEL_TAG) -> None:
        with self._cond:
            self._waiting_for_validation = False
            self._cond.notify_all()

    def stop(self) -> None:
        """Release every waiter: the run is ending (a background push under way is given a while to land:
        the service then serves the trainer's last weights)."""
        self._wait_pushed(_STOP_WAIT_S)
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # -- checkpoint -------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        with self._cond:
            return {"train_version": dict(self._train_version), "rollout_version": dict(self._rollout_version),
                    "sync_count": self.sync_count}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        with self._cond:
            self._train_version = {k: int(v) for k, v in state["train_version"].items()}
            self._rollout_version = {k: int(v) for k, v in state["rollout_version"].items()}
            self._steps_started = dict(self._train_version)
            self.sync_count = int(state.get("sync_count", 0))
