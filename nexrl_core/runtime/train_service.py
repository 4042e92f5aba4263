"""Training-as-a-service: the interface a trainer drives, and how a recipe picks one.

A train service holds the weights being trained and their optimizer, in this process (nexrl-grpo's
``local_torch``) or behind a remote API (nexrl-tinker's ``tinker``). Plugins register services
through the ``nexrl_train_services`` hook; ``service.train_service.backend`` selects one by name,
and the other keys of ``service.train_service`` are the selected service's own (its ``OPTIONS``).

What a batch and a loss are depends on the service: nexrl-grpo's takes a dict of padded torch
tensors and a loss callable (``BATCH_FORMAT = "torch_tensors"``), Tinker takes a list of
``tinker.types.Datum`` and the name of a server-side loss (``"tinker_datums"``). A trainer
declares the format it builds (``TRAIN_SERVICE_BATCH_FORMAT``) and the service it uses when the
recipe names none (``TRAIN_SERVICE_DEFAULT``); it then drives any registered service of that
format, and ``nexrl validate`` refuses one it cannot feed.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping
from dataclasses import dataclass, field
from difflib import get_close_matches
from typing import Any

from ..config.options import Option
from ..config.settings import plain
from ..errors import ConfigError

SECTION = "service.train_service"

__all__ = ["SECTION", "StepResult", "TrainService", "result_of", "train_service_class", "train_service_options"]


@dataclass
class StepResult:
    """What one training step gave back: its metrics and, when the service returns them, one
    mapping of per-token arrays per row of the batch (e.g. ``logprobs`` of every target token)."""

    metrics: dict[str, float]
    outputs: list[dict[str, Any]] = field(default_factory=list)


def result_of(value: Any) -> Any:
    """``value.result()`` for a submitted call (a future), ``value`` itself for a finished one."""
    result = getattr(value, "result", None)
    return result() if callable(result) else value


class TrainService(ABC):
    """One model (or adapter) being trained and its optimizer.

    Class attributes:

    - ``OPTIONS``: the keys of ``service.train_service`` besides ``backend``
      (name -> :class:`nexrl_core.Option`), checked by ``nexrl validate`` and ``nexrl run``;
    - ``BATCH_FORMAT``: the name of what :meth:`forward` / :meth:`forward_backward` take, matched
      against a trainer's ``TRAIN_SERVICE_BATCH_FORMAT``.

    A service may run its calls remotely: :meth:`forward_backward` and :meth:`optim_step` then
    return at once with a pending result (an object with ``result()``), so that the optimizer
    step is submitted right behind the gradients, and :meth:`train_step` waits for both. A
    service in this process may return the results themselves.
    """

    OPTIONS: dict[str, Option] = {}
    BATCH_FORMAT: str = ""

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, seed: int, total_steps: int,
                    path: str = SECTION) -> TrainService:
        """Build from the recipe's ``service.train_service`` mapping (plain data, ``backend``
        included). ``seed`` is the recipe's seed; ``total_steps`` the optimizer steps the run takes
        (where a decaying learning-rate schedule ends). Bad values raise
        :class:`~nexrl_core.ConfigError` naming ``path.<key>``."""
        return cls(config)  # type: ignore[call-arg]

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str = SECTION) -> list[str]:
        """Cross-key rules beyond ``OPTIONS`` (``["<path>.<key>: why", ...]``), found without
        contacting anything: what the constructor would raise, for ``nexrl validate``."""
        return []

    # -- compute ---------------------------------------------------------------------------
    @abstractmethod
    def forward(self, batch: Any) -> Any:
        """Outputs of the current weights on ``batch`` (log-probs of its tokens), no gradient."""

    @abstractmethod
    def forward_backward(self, batch: Any, loss: Any) -> Any:
        """Accumulate the gradients of ``loss`` on ``batch`` (until :meth:`optim_step`); returns the
        step's metrics (and outputs), or a pending result of them."""

    @abstractmethod
    def optim_step(self) -> Any:
        """One optimizer step on the accumulated gradients, which are then cleared; returns its
        metrics (``grad_norm``, ``lr``...), or a pending result of them."""

    def train_step(self, batch: Any, loss: Any) -> StepResult:
        """:meth:`forward_backward` then :meth:`optim_step`, submitted back to back and awaited
        together; their metrics merged."""
        backward = self.forward_backward(batch, loss)
        step = self.optim_step()
        return _merge(result_of(backward), result_of(step))

    # -- state -------------------------------------------------------------------------------
    @abstractmethod
    def save_state(self, folder: str, extra_state: dict[str, Any] | None = None) -> None:
        """Write what resuming needs into ``folder``: the weights (or where the service keeps
        them), the optimizer state, the service's step counters, and ``extra_state`` (JSON). Only
        safetensors and JSON, and never a credential."""

    @abstractmethod
    def load_state(self, folder: str) -> dict[str, Any]:
        """Restore what :meth:`save_state` wrote (weights *and* optimizer state); returns its
        ``extra_state``."""

    @abstractmethod
    def sampling_client(self) -> Any:
        """The current weights for the inference side, taken after an optimizer step: what a
        trainer's ``export_weights()`` hands the weight-sync backend (a remote service's sampler,
        e.g. a ``tinker.SamplingClient``; a service in this process may give its tensors by name)."""

    def close(self) -> None:
        """Release connections and sessions (nothing saved is lost)."""


def _merge(backward: Any, step: Any) -> StepResult:
    result = backward if isinstance(backward, StepResult) else StepResult(dict(backward or {}))
    more = step.metrics if isinstance(step, StepResult) else dict(step or {})
    return StepResult({**result.metrics, **more}, result.outputs)


# -- which service a trainer drives ---------------------------------------------------------------

def _format(trainer_cls: type) -> str | None:
    return getattr(trainer_cls, "TRAIN_SERVICE_BATCH_FORMAT", None)


def _fitting(trainer_cls: type, plugin_manager: Any) -> dict[str, Any]:
    """Registered train services taking the trainer's batch format, by name."""
    fmt = _format(trainer_cls)
    return {name: reg for name, reg in sorted(plugin_manager.components("train_service").items())
            if getattr(reg.cls, "BATCH_FORMAT", None) == fmt}


def train_service_class(trainer_cls: type, section: Mapping[str, Any] | None, plugin_manager: Any,
                        trainer_name: str | None = None, path: str = SECTION) -> type[TrainService]:
    """The service ``section`` selects (``backend``, else the trainer's ``TRAIN_SERVICE_DEFAULT``);
    ConfigError naming ``<path>.backend`` when it is not registered or takes batches the trainer
    does not build."""
    name = selected_backend(trainer_cls, section)
    selected = plugin_manager.components("train_service").get(name) if isinstance(name, str) else None
    if selected is not None and getattr(selected.cls, "BATCH_FORMAT", None) == _format(trainer_cls):
        return selected.cls  # the other services stay unimported (a lazy registration: torch, an SDK)
    fitting = _fitting(trainer_cls, plugin_manager)
    if selected is None and isinstance(name, str):  # not registered at all: said as for any component
        plugin_manager.resolve("train_service", name, f"{path}.backend")
    trainer_words = f"trainer '{trainer_name or trainer_cls.__name__}'"
    choices = ", ".join(fitting) or "none (install the plugin that provides one)"
    text = f"{path}.backend: {name!r} is not one of {choices}"
    if selected is not None:
        raise ConfigError(f"{text}: {trainer_words} builds {_format(trainer_cls)} batches, and train service "
                          f"'{name}' ({selected.distribution}) takes {getattr(selected.cls, 'BATCH_FORMAT', '?')} batches")
    hit = get_close_matches(str(name), list(fitting), n=1)
    raise ConfigError(text + (f"; did you mean {hit[0]!r}?" if hit else f" (the train services {trainer_words} "
                                                                         f"can drive)"))


def train_service_options(service_cls: type, trainer_cls: type) -> dict[str, Option]:
    """Every key ``service.train_service`` may hold with this service: ``backend`` and the service's
    ``OPTIONS``."""
    from ..config.options import component_options

    return {"backend": _backend_option(trainer_cls), **(component_options(service_cls) or {})}


def selected_backend(trainer_cls: type, section: Mapping[str, Any] | None) -> Any:
    """The train service ``section`` names: its ``backend``, else the trainer's default."""
    values = plain(section)
    return values["backend"] if "backend" in values else _backend_option(trainer_cls).default_value()


def _backend_option(trainer_cls: type) -> Option:
    """``service.train_service.backend``: its default is the trainer class's ``TRAIN_SERVICE_DEFAULT``
    (null: none, the recipe must name one), declared here once for the check and the launcher."""
    return Option(getattr(trainer_cls, "TRAIN_SERVICE_DEFAULT", None), str,
                  "the train service, by registered name (nexrl plugins lists them)")
