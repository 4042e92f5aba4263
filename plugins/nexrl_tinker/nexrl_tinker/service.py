"""The Tinker train service: one LoRA training run on the Tinker API, driven by a trainer.

It is built from the recipe's ``service.train_service`` mapping (keys: :data:`TRAIN_SERVICE_KEYS`)
and offers what a trainer drives, the way ``SelfHostedTrainer`` drives the local torch service:

- :meth:`TinkerTrainService.forward` (logprobs, no gradients), :meth:`~TinkerTrainService.forward_backward`
  and :meth:`~TinkerTrainService.optim_step` (each returns a :class:`Pending` at once; requests of
  one run execute in submission order on the service), and :meth:`~TinkerTrainService.train_step`,
  which submits a forward/backward and the optimizer step back to back and waits for both;
- :meth:`~TinkerTrainService.save_checkpoint` / :meth:`~TinkerTrainService.load_checkpoint`:
  the weights and Adam state are saved remotely (``save_state``, a ``tinker://`` path) and the
  nexrl checkpoint folder records that path (``tinker_state.json``, no secrets); loading creates
  a new training client from that state *with its optimizer state*, and the learning-rate schedule
  resumes at the saved optimizer step;
- :meth:`~TinkerTrainService.sampling_client`: a ``tinker.SamplingClient`` of the current weights
  (``save_weights_and_get_sampling_client``), what the ``tinker`` weight-sync backend hands the
  inference client after every step.

The optimizer keys mean what they mean for ``nexrl-grpo``'s local service (AdamW ``lr``,
``betas``, ``eps``, ``weight_decay``, ``grad_clip`` on the global gradient norm), so a recipe can
switch services without a silent change of optimizer; each step sends them as Tinker
``AdamParams`` with the scheduled learning rate.
"""

from __future__ import annotations

import json
import math
import os
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np
from loguru import logger
from tinker import types

from nexrl_core import ConfigError, DataError

from .remote import CONNECTION_KEYS, RemoteCalls, TinkerRequestError, plain_section, resolve_connection

TRAIN_SERVICE_KEYS: dict[str, Any] = {
    "backend": "tinker", "base_model": None, "lora_rank": 32, "lora_seed": None,
    "train_mlp": True, "train_attn": True, "train_unembed": True,
    "lr": 1e-4, "lr_schedule": "constant", "lr_warmup_steps": 0, "lr_decay_steps": None, "min_lr_ratio": 0.0,
    "betas": [0.9, 0.999], "eps": 1e-8, "weight_decay": 0.0, "grad_clip": 1.0,
    **CONNECTION_KEYS,
}
LR_SCHEDULES = ("constant", "linear", "cosine")
STATE_FILE = "tinker_state.json"
STATE_FORMAT = 1


@dataclass
class StepResult:
    """A forward or forward/backward result: metrics and, per datum, its output arrays
    (``logprobs`` of every target token; ``elementwise_loss`` for cross-entropy)."""

    metrics: dict[str, float]
    outputs: list[dict[str, np.ndarray]] = field(default_factory=list)


class Pending:
    """A submitted remote call; :meth:`result` waits for it (under the call deadline)."""

    def __init__(self, calls: RemoteCalls, request: str, future: Any, finish: Callable[[Any], Any]):
        self._calls, self.request, self._future, self._finish = calls, request, future, finish

    def result(self) -> Any:
        return self._finish(self._calls.wait(self.request, self._future))

    def cancel(self) -> None:
        """Stop waiting for the call (the service may still run it)."""
        self._future.future().cancel()


class LearningRateSchedule:
    """``lr`` at optimizer step ``s`` (0-based): linear warm-up over ``warmup_steps``, then constant,
    or a linear / cosine decay to ``min_lr_ratio * lr`` at ``decay_steps`` (counted from step 0)."""

    def __init__(self, lr: float, schedule: str = "constant", warmup_steps: int = 0, decay_steps: int | None = None,
                 min_lr_ratio: float = 0.0):
        self.lr, self.schedule, self.warmup_steps = lr, schedule, warmup_steps
        self.decay_steps, self.min_lr_ratio = decay_steps, min_lr_ratio

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return self.lr * (step + 1) / self.warmup_steps
        if self.schedule == "constant" or not self.decay_steps:
            return self.lr
        span = max(self.decay_steps - self.warmup_steps, 1)
        progress = min(max(step - self.warmup_steps, 0) / span, 1.0)
        shape = 1.0 - progress if self.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        floor = self.lr * self.min_lr_ratio
        return floor + (self.lr - floor) * shape


class TinkerTrainService:
    """See the module doc. ``seed`` (the recipe's) seeds the LoRA initialisation unless
    ``lora_seed`` is set; ``total_steps`` (the run's optimizer steps) ends a decaying schedule
    unless ``lr_decay_steps`` is set."""

    def __init__(self, config: Mapping[str, Any], *, seed: int | None = None, total_steps: int | None = None,
                 section: str = "service.train_service"):
        cfg = plain_section(config, section)
        self.section = section
        unknown = sorted(set(cfg) - set(TRAIN_SERVICE_KEYS))
        if unknown:
            raise ConfigError(f"{section}.{unknown[0]}: not a key of the tinker train service "
                              f"(known: {', '.join(sorted(TRAIN_SERVICE_KEYS))})")
        self.connection = resolve_connection(cfg, section)
        self.base_model = cfg.get("base_model")
        if not self.base_model or not isinstance(self.base_model, str):
            raise ConfigError(f"{section}.base_model: required (the Tinker name of the model to train, "
                              f"e.g. Qwen/Qwen3-8B)")
        self.lora_rank = self._int(cfg, "lora_rank", 1)
        lora_seed = cfg.get("lora_seed", seed)
        self.lora_seed = None if lora_seed is None else int(lora_seed)
        self.train_parts = {k: bool(cfg.get(k, True)) for k in ("train_mlp", "train_attn", "train_unembed")}
        if not any(self.train_parts.values()):
            raise ConfigError(f"{section}: at least one of train_mlp, train_attn, train_unembed must be true")
        schedule = str(cfg.get("lr_schedule", "constant"))
        if schedule not in LR_SCHEDULES:
            raise ConfigError(f"{section}.lr_schedule: '{schedule}' is not one of {', '.join(LR_SCHEDULES)}")
        decay = cfg.get("lr_decay_steps")
        self.schedule = LearningRateSchedule(
            self._float(cfg, "lr", 0.0), schedule, self._int(cfg, "lr_warmup_steps", 0),
            self._int(cfg, "lr_decay_steps", 1) if decay is not None else total_steps,
            self._float(cfg, "min_lr_ratio", 0.0, 1.0))
        betas = cfg.get("betas", TRAIN_SERVICE_KEYS["betas"])
        if not isinstance(betas, (list, tuple)) or len(betas) != 2 or not all(0 <= float(b) < 1 for b in betas):
            raise ConfigError(f"{section}.betas: expected two numbers in [0, 1), got {betas!r}")
        grad_clip = cfg.get("grad_clip", 1.0)
        self.adam = {"beta1": float(betas[0]), "beta2": float(betas[1]), "eps": self._float(cfg, "eps", 0.0),
                     "weight_decay": self._float(cfg, "weight_decay", 0.0),
                     "grad_clip_norm": 0.0 if grad_clip is None else self._float(cfg, "grad_clip", 0.0)}
        self.optimizer_steps = 0
        self._calls = RemoteCalls(self.connection)
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()  # one training run, however many threads ask at once
        self._service: Any = None
        self._training: Any = None

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str = "service.train_service") -> list[str]:
        """The problem the constructor would raise (a missing API key included), found without
        contacting the service (for ``nexrl validate``)."""
        try:
            cls(section, section=path)
        except ConfigError as exc:
            return [str(exc)]
        return []

    def _int(self, cfg: dict, key: str, minimum: int) -> int:
        value = cfg.get(key, TRAIN_SERVICE_KEYS[key])
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise ConfigError(f"{self.section}.{key}: expected an integer >= {minimum}, got {value!r}")
        return value

    def _float(self, cfg: dict, key: str, minimum: float, maximum: float = math.inf) -> float:
        value = cfg.get(key, TRAIN_SERVICE_KEYS[key])
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{self.section}.{key}: expected a number, got {value!r}") from None
        if not (minimum <= number <= maximum) or not math.isfinite(number):
            raise ConfigError(f"{self.section}.{key}: expected a number in [{minimum}, {maximum}], got {value!r}")
        return number

    # ------------------------------------------------------------------ clients

    @property
    def service_client(self) -> Any:
        with self._lock:
            if self._service is None:
                self._service = self.connection.service_client()
            return self._service

    @property
    def training_client(self) -> Any:
        """The run's ``tinker.TrainingClient`` (a new LoRA run on first use, unless a checkpoint was loaded)."""
        with self._lock:
            training = self._training
        if training is not None:
            return training
        with self._create_lock:
            with self._lock:
                if self._training is not None:
                    return self._training
            service = self.service_client
            request = f"create_lora_training_client (base model {self.base_model}, rank {self.lora_rank})"
            training = self._calls.call(request, lambda: service.create_lora_training_client(
                base_model=self.base_model, rank=self.lora_rank, seed=self.lora_seed, **self.train_parts),
                repeatable=True)
            with self._lock:
                self._training = training
            logger.info(f"Tinker training run {training.model_id} ({self.base_model}, LoRA rank {self.lora_rank}) "
                        f"at {self.connection.where}")
        return training

    def connect(self) -> None:
        """Contact the service and create (or reuse) the training run: fails early on a wrong URL or key."""
        _ = self.training_client

    # ------------------------------------------------------------------ compute

    def forward(self, datums: list[types.Datum], loss_fn: str = "cross_entropy",
                loss_fn_config: Mapping[str, float] | None = None) -> StepResult:
        """Logprobs (and loss) under the current weights; no gradients."""
        training = self.training_client
        request = self._describe("forward", datums, loss_fn, training)
        future = self._calls.run(request, lambda: training.forward(datums, loss_fn, dict(loss_fn_config or {}) or None))
        return Pending(self._calls, request, future, _step_result).result()

    def forward_backward(self, datums: list[types.Datum], loss_fn: str,
                         loss_fn_config: Mapping[str, float] | None = None) -> Pending:
        """Submit a forward/backward (gradients accumulate until :meth:`optim_step`); never resent."""
        if not datums:
            raise DataError("forward_backward: no datums to train on")
        training = self.training_client
        request = self._describe("forward_backward", datums, loss_fn, training)
        config = dict(loss_fn_config or {}) or None
        future = self._calls.run(request, lambda: training.forward_backward(datums, loss_fn, config))
        return Pending(self._calls, request, future, _step_result)

    def optim_step(self) -> Pending:
        """Submit one AdamW step at the scheduled learning rate (the step counter moves on submission)."""
        training = self.training_client
        lr = self.schedule(self.optimizer_steps)
        params = types.AdamParams(learning_rate=lr, **self.adam)
        request = f"optim_step {self.optimizer_steps + 1} (lr {lr:.3g}) of {training.model_id}"
        future = self._calls.run(request, lambda: training.optim_step(params))
        self.optimizer_steps += 1
        return Pending(self._calls, request, future, lambda r: {**_metrics(r.metrics or {}), "lr": lr})

    def train_step(self, datums: list[types.Datum], loss_fn: str,
                   loss_fn_config: Mapping[str, float] | None = None) -> StepResult:
        """forward_backward + optim_step, submitted back to back and awaited together."""
        backward = self.forward_backward(datums, loss_fn, loss_fn_config)
        step = self.optim_step()
        try:
            result = backward.result()
        except TinkerRequestError as exc:
            step.cancel()
            raise TinkerRequestError(exc.request, f"{exc.reason} (the optimizer step submitted after it may "
                                                  f"have run; resume from the last checkpoint)") from exc.__cause__
        result.metrics.update(step.result())
        return result

    @staticmethod
    def _describe(what: str, datums: list[types.Datum], loss_fn: str, training: Any) -> str:
        tokens = sum(d.model_input.length for d in datums)
        return f"{what} ({len(datums)} datums, {tokens} tokens, loss {loss_fn}) of {training.model_id}"

    # ------------------------------------------------------------------ weights for sampling

    def sampling_client(self) -> Any:
        """A ``tinker.SamplingClient`` of the current weights."""
        training = self.training_client
        return self._calls.call(f"save_weights_and_get_sampling_client of {training.model_id}",
                                training.save_weights_and_get_sampling_client, repeatable=True)

    # ------------------------------------------------------------------ checkpoints

    def save_state(self, name: str) -> str:
        """Save weights + optimizer state remotely as ``name``; returns its ``tinker://`` path."""
        training = self.training_client
        response = self._calls.call(f"save_state '{name}' of {training.model_id}",
                                    lambda: training.save_state(name, overwrite=True), repeatable=True)
        return response.path

    def load_state(self, path: str) -> None:
        """Continue from a saved state, weights and optimizer state both (a new training client)."""
        service = self.service_client
        training = self._calls.call(f"create_training_client_from_state_with_optimizer {path}",
                                    lambda: service.create_training_client_from_state_with_optimizer(path),
                                    repeatable=True)
        with self._lock:
            self._training = training
        logger.info(f"Tinker training run {training.model_id} continues from {path}")

    def save_checkpoint(self, folder: str, step: int) -> str:
        """Save the remote state as ``global_step_<step>`` and record it in ``folder/tinker_state.json``."""
        path = self.save_state(f"global_step_{step}")
        state = {"format": STATE_FORMAT, "tinker_path": path, "base_model": self.base_model,
                 "lora_rank": self.lora_rank, "optimizer_steps": self.optimizer_steps,
                 "model_id": self.training_client.model_id}
        with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1, sort_keys=True)
        return path

    def load_checkpoint(self, folder: str) -> dict[str, Any]:
        """Restore what :meth:`save_checkpoint` recorded in ``folder``; returns that record."""
        path = os.path.join(folder, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
            tinker_path, steps = str(state["tinker_path"]), int(state["optimizer_steps"])
        except FileNotFoundError:
            raise DataError(f"{folder}: no {STATE_FILE}; not a checkpoint of a Tinker train service") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
        if state.get("base_model") != self.base_model:
            raise ConfigError(f"{self.section}.base_model: '{self.base_model}', but the checkpoint {folder} was "
                              f"trained from '{state.get('base_model')}'")
        self.load_state(tinker_path)
        self.optimizer_steps = steps
        return state

    def close(self, status: str = "success") -> None:
        """Finish the session (its runs stay saved remotely)."""
        with self._lock:
            service, self._service, self._training = self._service, None, None
        if service is not None:
            try:
                self._calls.call("close session", lambda: service.close(status), repeatable=False)
            except TinkerRequestError as exc:
                logger.warning(str(exc))


def _metrics(raw: Mapping[str, float]) -> dict[str, float]:
    """``name:reduction`` metric keys as flat names (``loss:sum`` -> ``loss_sum``, ``x:mean`` -> ``x``)."""
    out = {}
    for key, value in raw.items():
        name, _, reduction = key.partition(":")
        out[name if reduction in ("", "mean") else f"{name}_{reduction}"] = float(value)
    return out


def _step_result(output: Any) -> StepResult:
    outputs = [{k: np.asarray(v.to_numpy() if hasattr(v, "to_numpy") else v) for k, v in o.items()}
               for o in output.loss_fn_outputs]
    return StepResult(_metrics(output.metrics), outputs)
