"""Hook specifications of nexrl: the whole surface a plugin can implement.

A plugin is a module named by an entry point in the ``nexrl`` group::

    [project.entry-points.nexrl]
    my_plugin = "my_package.plugin"

whose functions are marked with ``@nexrl_core.hookimpl`` and named after the
specs below. Every component hook returns ``dict[str, type]``: the name a
recipe uses in ``type:`` mapped to the class that implements it, or to
``nexrl_core.Lazy("module:Class")``, which is imported when a recipe selects the
name: a plugin whose classes need torch or an SDK then costs nothing to recipes
of other components. The algorithm hooks take ``Lazy`` paths to functions alike.

A registered class declares the keys of its recipe section as ``OPTIONS = {key:
nexrl_core.Option(...)}`` (an evaluator may instead rely on its annotated ``__init__``),
and what it provides to and needs from the other components as ``CAPABILITIES =
nexrl_core.Capabilities(...)``; ``nexrl validate`` and ``nexrl run`` check both
(docs/plugins.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import pluggy

if TYPE_CHECKING:  # imported for annotations only; keeps this module dependency-free
    from .dataloader import BaseDataLoader
    from .evaluation import Evaluator
    from .rollout_worker import BaseRolloutWorker
    from .runtime.inference import InferenceClient
    from .runtime.sinks import MetricsSink
    from .runtime.train_service import TrainService
    from .trainer import BaseTrainer
    from .weight_sync import WeightSyncBackend

hookspec = pluggy.HookspecMarker("nexrl")


@hookspec
def nexrl_dataloaders() -> dict[str, type[BaseDataLoader]]:
    """Register data loaders, selected with ``data.type`` and ``validate.data.type``.

    :return: registered name -> subclass of :class:`nexrl_core.BaseDataLoader`.
        The class is built as ``cls(config, is_validate=...)`` with the recipe's
        data mapping.
    """


@hookspec
def nexrl_rollout_workers() -> dict[str, type[BaseRolloutWorker]]:
    """Register rollout workers, selected with ``rollout_worker.type``.

    :return: registered name -> subclass of :class:`nexrl_core.BaseRolloutWorker`,
        built as ``cls(config, parts)`` with the ``rollout_worker`` mapping and the evaluator
        ``config.evaluator`` names (:class:`nexrl_core.RolloutParts`); the inference client and
        the other modules arrive as handles through ``set_module_references``.
    """


@hookspec
def nexrl_evaluators() -> dict[str, type[Evaluator]]:
    """Register evaluators, selected with ``rollout_worker.evaluator.type``.

    :return: registered name -> subclass of :class:`nexrl_core.Evaluator`. The
        other keys of ``rollout_worker.evaluator`` are passed to the constructor
        as keyword arguments.
    """


@hookspec
def nexrl_trainers() -> dict[str, type[BaseTrainer]]:
    """Register trainers, selected with ``trainer.type``.

    :return: registered name -> subclass of :class:`nexrl_core.BaseTrainer`,
        built as ``cls(config, parts)`` with the whole recipe and its train service and algorithm
        registry (:class:`nexrl_core.TrainerParts`).
    """


@hookspec
def nexrl_train_services() -> dict[str, type[TrainService]]:
    """Register train services, selected with ``service.train_service.backend``.

    :return: registered name -> subclass of :class:`nexrl_core.TrainService` (forward,
        forward_backward, optim_step, train_step, save/load state, a sampling client of the
        current weights), built with ``cls.from_config(section, seed=..., total_steps=...)`` from
        the ``service.train_service`` mapping, whose other keys are the class's ``OPTIONS``. Its
        ``BATCH_FORMAT`` says which trainers can drive it (those declaring the same
        ``TRAIN_SERVICE_BATCH_FORMAT``).
    """


@hookspec
def nexrl_weight_sync_backends() -> dict[str, type[WeightSyncBackend]]:
    """Register weight-sync backends, selected with ``weight.backend``.

    :return: registered name -> subclass of :class:`nexrl_core.WeightSyncBackend`:
        how trained weights reach the inference service.
    """


@hookspec
def nexrl_inference_backends() -> dict[str, type[InferenceClient]]:
    """Register inference backends, selected with ``service.inference_service.backend``.

    :return: registered name -> subclass of :class:`nexrl_core.InferenceClient`,
        built as ``cls(config)`` with the ``service.inference_service`` mapping.
    """


@hookspec
def nexrl_advantage_estimators() -> dict[str, Callable[..., Any]]:
    """Register advantage estimators, selected with ``algorithm.type`` (e.g. ``grpo``, ``dr_grpo``).

    An estimator is a pure function on numpy arrays (no torch: remote trainers call it too)::

        def my_estimator(data: nexrl_core.algorithms.AdvantageInputs, *, my_key: float = 1.0)
            -> tuple[np.ndarray, np.ndarray]:   # (advantages [B, T], returns [B, T])

    Its keyword-only parameters are the ``algorithm.*`` keys it reads; their defaults give the
    keys' defaults and types (``nexrl validate`` rejects keys no selected function reads), a
    ``typing.Literal`` annotation lists accepted values. A ``recommended_defaults`` dict attribute
    on the function sets defaults for other ``algorithm.*`` keys (the loss's or the trainer's,
    used when the recipe leaves them unset); a ``requires`` attribute names inputs the trainer
    must compute (``("values",)``: a critic, which nexrl-grpo's trainer trains alongside the
    policy). Document the formula and a reference in its docstring.

    :return: registered name -> estimator function. Two distributions registering one name is
        an error that names both.
    """


@hookspec
def nexrl_policy_losses() -> dict[str, Callable[..., Any]]:
    """Register policy losses, selected with ``algorithm.policy_loss`` (e.g. ``ppo_clip``).

    A loss needs autograd, so it lives in the distribution that owns the tensor library. For the
    self-hosted trainers of nexrl-grpo (torch)::

        def my_loss(log_prob, old_log_prob, advantages, response_mask, context, *, my_key: float = 0.2)
            -> tuple[torch.Tensor, dict[str, float]]:   # (this micro-batch's share of the loss, metrics)

    ``context`` carries what aggregation needs (``nexrl_grpo.losses.LossContext``: whole-batch row
    and token counts, the constant length normaliser, per-token importance weights of the
    rollout correction). Options are declared as for estimators (keyword-only parameters).
    Metric names ending in ``_max``/``_min`` combine across micro-batches as a max/min, others as
    a token-weighted mean (:mod:`nexrl_core.algorithms.metrics`).

    :return: registered name -> loss function. Two distributions registering one name is an
        error that names both.
    """


@hookspec
def nexrl_metrics_sinks() -> dict[str, type[MetricsSink]]:
    """Register experiment loggers, selected with ``logger.backend``.

    :return: registered name -> subclass of :class:`nexrl_core.MetricsSink` (or a class with the
        same methods): ``__init__(config, run_dir)``, ``log(metrics: dict, step: int)`` and
        ``close()``; optionally ``OPTIONS`` (its keys under
        ``logger.<name>``), ``check_config(section, key) -> [problem, ...]`` (run by ``nexrl
        validate`` too) and ``truncate_after(step)`` (a resume from checkpoint ``step``: forget
        what was logged after it).
    """


@hookspec
def nexrl_step_end(step: int, metrics: dict[str, float], config: Mapping[str, Any]) -> None:
    """Called after every training step, once its metrics are final.

    :param step: the global training step just finished (1-based).
    :param metrics: every metric recorded for that step (read-only).
    :param config: the resolved recipe.
    """
