"""The Tinker train service (``service.train_service.backend: tinker``): one LoRA training run on
the Tinker API, the core's :class:`nexrl_core.TrainService` over ``tinker.types.Datum`` batches.

Built from the recipe's ``service.train_service`` mapping (keys: :class:`TinkerServiceSettings` and the
connection's, :class:`~nexrl_tinker.remote.TinkerConnectionSettings`),
it offers what a remote-API trainer drives:

- :meth:`TinkerTrainService.forward` (logprobs, no gradients), :meth:`~TinkerTrainService.forward_backward`
  and :meth:`~TinkerTrainService.optim_step` (each returns a :class:`Pending` at once; requests of
  one run execute in submission order on the service), and :meth:`~TinkerTrainService.train_step`,
  which submits a forward/backward and the optimizer step back to back and waits for both;
- :meth:`~TinkerTrainService.save_state` / :meth:`~TinkerTrainService.load_state`: the weights and
  Adam state are saved remotely (Tinker's ``save_state``, a ``tinker://`` path) and the nexrl
  checkpoint folder records that path and the optimizer step count (``tinker_state.json``, no
  secrets); loading creates a new training client from that state *with its optimizer state*,
  and the learning-rate schedule resumes at the saved step;
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
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Literal

import numpy as np
from loguru import logger

from nexrl_core import ConfigError, DataError, Option, Settings, StepResult, TrainService, check_options, setting

from .remote import (
    CONNECTION_OPTIONS,
    RemoteCalls,
    TinkerConnectionSettings,
    TinkerRequestError,
    plain_section,
    resolve_connection,
)

if TYPE_CHECKING:  # tinker's import takes a second: only a run that uses it pays
    from tinker import types

LrSchedule = Literal["constant", "linear", "cosine"]
STATE_FILE = "tinker_state.json"
STATE_FORMAT = 1
BATCH_FORMAT = "tinker_datums"  # a list of tinker.types.Datum and a loss name (nexrl_tinker.datums)
TRAIN_PARTS = ("train_mlp", "train_attn", "train_unembed")


def _betas(value: list[float]) -> str | None:
    return None if len(value) == 2 and all(0 <= b < 1 for b in value) else \
        f"expected [beta1, beta2], each in [0, 1), got {list(value)}"


@dataclass(frozen=True, kw_only=True)
class TinkerServiceSettings(Settings):
    """The training run's keys of ``service.train_service`` (the connection's are
    :class:`~nexrl_tinker.remote.TinkerConnectionSettings`)."""

    base_model: str = setting(help="the Tinker name of the model to train (e.g. Qwen/Qwen3-8B), or a stand-in's "
                                   "model name")
    lora_rank: int = setting(32, "LoRA rank of the training run (Tinker trains LoRA adapters)", ge=1)
    lora_seed: int | None = setting(None, "seed of the LoRA initialisation (null: the recipe's seed)")
    train_mlp: bool = setting(True, "LoRA adapters on the MLP layers")
    train_attn: bool = setting(True, "LoRA adapters on the attention layers")
    train_unembed: bool = setting(True, "a LoRA adapter on the unembedding")
    lr: float = setting(1e-4, "peak AdamW learning rate (LoRA wants 20-100x a full fine-tune's)", ge=0)
    lr_schedule: LrSchedule = setting("constant", "constant, or a linear / cosine decay to min_lr_ratio * lr")
    lr_warmup_steps: int = setting(0, "linear warm-up over this many optimizer steps", ge=0)
    lr_decay_steps: int | None = setting(None, "optimizer step where the decay ends (null: the run's last)", ge=1,
                                         needs=".lr_schedule != constant")
    min_lr_ratio: float = setting(0.0, "floor of the decay, as a fraction of lr", ge=0, le=1,
                                  needs=".lr_schedule != constant")
    betas: list[float] = setting([0.9, 0.999], "AdamW betas", check=_betas)
    eps: float = setting(1e-8, "AdamW epsilon", gt=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", ge=0)
    grad_clip: float | None = setting(1.0, "clip on the global gradient norm (0 or null: none)", ge=0)

    def train_parts(self) -> dict[str, bool]:
        """Where the run puts LoRA adapters, as ``create_lora_training_client`` takes them."""
        return {"train_mlp": self.train_mlp, "train_attn": self.train_attn, "train_unembed": self.train_unembed}


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

    def __init__(self, lr: float, schedule: LrSchedule = "constant", warmup_steps: int = 0, decay_steps: int | None = None,
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


class TinkerTrainService(TrainService):
    """One LoRA training run on the Tinker API (the `remote_api_*` trainers' default): forward_backward
    and optim_step on the service, its weights and Adam state saved and resumed there.

    ``seed`` (the recipe's) seeds the LoRA initialisation unless ``lora_seed`` is set;
    ``total_steps`` (the run's optimizer steps) ends a decaying schedule unless ``lr_decay_steps``
    is set. See the module doc."""

    SETTINGS = TinkerServiceSettings
    OPTIONS = CONNECTION_OPTIONS
    BATCH_FORMAT = BATCH_FORMAT

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, seed: int, total_steps: int,
                    path: str = "service.train_service") -> TinkerTrainService:
        return cls(config, seed=seed, total_steps=total_steps, section=path)

    def __init__(self, config: Mapping[str, Any], *, seed: int | None = None, total_steps: int | None = None,
                 section: str = "service.train_service"):
        cfg = plain_section(config, section)
        self.section = section
        options = {"backend": Option("tinker", str), **TinkerServiceSettings.options(), **CONNECTION_OPTIONS}
        problems = check_options(cfg, options, section, owner="train service 'tinker'")
        if problems:
            raise ConfigError("; ".join(problems))
        self.settings = settings = TinkerServiceSettings.own(cfg, section)
        if not any(settings.train_parts().values()):
            raise ConfigError(f"{section}: at least one of {', '.join(TRAIN_PARTS)} must be true (nothing would be "
                              f"trained)")
        self.connection = resolve_connection(TinkerConnectionSettings.own(cfg, section), section)
        self.base_model = settings.base_model
        self.lora_rank = settings.lora_rank
        self.lora_seed = settings.lora_seed if settings.lora_seed is not None else seed
        self.train_parts = settings.train_parts()
        decay = settings.lr_decay_steps if settings.lr_decay_steps is not None else total_steps
        self.schedule = LearningRateSchedule(float(settings.lr), settings.lr_schedule, settings.lr_warmup_steps, decay,
                                             float(settings.min_lr_ratio))
        # Floats, as Tinker's AdamParams takes them (a recipe may write an integer where a number goes).
        self.adam = {"beta1": float(settings.betas[0]), "beta2": float(settings.betas[1]), "eps": float(settings.eps),
                     "weight_decay": float(settings.weight_decay), "grad_clip_norm": float(settings.grad_clip or 0.0)}
        self.optimizer_steps = 0
        self._calls = RemoteCalls(self.connection)
        self._lock = threading.Lock()
        self._create_lock = threading.Lock()  # one training run, however many threads ask at once
        self._service: Any = None
        self._training: Any = None
        self._sampler_paths: dict[tuple[str, int], str] = {}

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str = "service.train_service") -> list[str]:
        """The problem the constructor would raise (a missing API key included), found without
        contacting the service (for ``nexrl validate``)."""
        try:
            cls(section, section=path)
        except ConfigError as exc:
            return [str(exc)]
        return []

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
        from tinker import types

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

    def save_remote_state(self, name: str) -> str:
        """Save weights + optimizer state on the service as ``name``; returns its ``tinker://`` path."""
        training = self.training_client
        response = self._calls.call(f"save_state '{name}' of {training.model_id}",
                                    lambda: training.save_state(name, overwrite=True), repeatable=True)
        return response.path

    def load_remote_state(self, path: str) -> None:
        """Continue from a saved state, weights and optimizer state both (a new training client)."""
        service = self.service_client
        training = self._calls.call(f"create_training_client_from_state_with_optimizer {path}",
                                    lambda: service.create_training_client_from_state_with_optimizer(path),
                                    repeatable=True)
        with self._lock:
            self._training = training
        logger.info(f"Tinker training run {training.model_id} continues from {path}")

    def save_sampler_weights(self, name: str) -> str:
        """Save the current weights for sampling as ``name``; returns their ``tinker://`` path."""
        training = self.training_client
        response = self._calls.call(f"save_weights_for_sampler '{name}' of {training.model_id}",
                                    lambda: training.save_weights_for_sampler(name), repeatable=True)
        return response.path

    def save_state(self, folder: str, extra_state: dict[str, Any] | None = None) -> None:
        """Save the remote state and a sampler snapshot (named after the optimizer step), and record
        them, with ``extra_state``, in ``folder/tinker_state.json``. The snapshot lets ``nexrl eval
        checkpoint=<folder>`` sample these weights."""
        name = f"optim_step_{self.optimizer_steps}"
        path = self.save_remote_state(name)
        key = (self.training_client.model_id, self.optimizer_steps)
        if key not in self._sampler_paths:  # saved twice at one step (save_on_stop): one snapshot
            self._sampler_paths[key] = self.save_sampler_weights(name)
        state = {"format": STATE_FORMAT, "tinker_path": path, "sampler_path": self._sampler_paths[key],
                 "base_model": self.base_model, "lora_rank": self.lora_rank, "optimizer_steps": self.optimizer_steps,
                 "model_id": self.training_client.model_id, "extra_state": extra_state or {}}
        with open(os.path.join(folder, STATE_FILE), "w", encoding="utf-8") as f:
            json.dump(state, f, indent=1, sort_keys=True)

    def load_state(self, folder: str) -> dict[str, Any]:
        """Restore what :meth:`save_state` recorded in ``folder``; returns its ``extra_state``."""
        path = os.path.join(folder, STATE_FILE)
        try:
            with open(path, encoding="utf-8") as f:
                state = json.load(f)
            tinker_path, steps = str(state["tinker_path"]), int(state["optimizer_steps"])
            extra = dict(state.get("extra_state") or {})
        except FileNotFoundError:
            raise DataError(f"{folder}: no {STATE_FILE}; not a checkpoint of a Tinker train service") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise DataError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
        if state.get("base_model") != self.base_model:
            raise ConfigError(f"{self.section}.base_model: '{self.base_model}', but the checkpoint {folder} was "
                              f"trained from '{state.get('base_model')}'")
        if state.get("lora_rank") != self.lora_rank:
            raise ConfigError(f"{self.section}.lora_rank: {self.lora_rank}, but the checkpoint {folder} was "
                              f"trained with rank {state.get('lora_rank')}")
        self.load_remote_state(tinker_path)
        self.optimizer_steps = steps
        return extra

    def close(self, status: str = "success") -> None:
        """Finish the session (its runs stay saved remotely)."""
        with self._lock:
            service, self._service, self._training = self._service, None, None
        if service is not None:
            try:
                self._calls.call("close session", lambda: service.close(status), repeatable=False)
            except TinkerRequestError as exc:
                logger.warning(str(exc))


def checkpoint_sampler_path(folder: str) -> str:
    """The ``tinker://`` sampler path a nexrl checkpoint of a Tinker run recorded; DataError if the
    folder holds no such record."""
    path = os.path.join(folder, STATE_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            return str(json.load(f)["sampler_path"])
    except FileNotFoundError:
        raise DataError(f"{folder}: no {STATE_FILE}; not a checkpoint of a Tinker train service") from None
    except (ValueError, KeyError, TypeError) as exc:
        raise DataError(f"{path}: no sampler_path to sample from ({type(exc).__name__}: {exc})") from None


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
