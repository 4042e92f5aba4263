"""The parts a module is built with: evaluators, the weight-sync backend, the train service, the
algorithm registry, the run's records and metrics sinks.

The launcher resolves them through the plugin manager, in the process the module lives in (a Ray
actor builds its own: evaluators and services need not pickle), and hands them in. Components
never look the manager up (tests/core/test_layers.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ..algorithms.registry import AlgorithmRegistry
from ..config.bound import BoundConfig, bind, bind_recipe, declared_value
from ..config.schema import ROLLOUT_WORKER, WEIGHT
from ..errors import ConfigError
from ..evaluation import Evaluator
from ..plugins import PluginManager, active_plugin_manager, use_plugin_manager
from ..rollout_worker import BaseRolloutWorker, RolloutParts
from ..runtime.activity import ActivityTracker
from ..runtime.inference import InferenceClient
from ..runtime.train_service import SECTION, TrainService, train_service_class
from ..trainer import BaseTrainer, TrainerParts
from ..weight_sync import WeightSyncBackend, WeightSyncController
from .recipe import REFERENCE_SECTION, plain

_EVALUATOR_KEY = "rollout_worker.evaluator"


def build_module(cls: type, config: Any, kwargs: dict[str, Any] | None = None, pm: PluginManager | None = None) -> Any:
    """``cls(config, **kwargs)`` with its parts, built with ``pm`` (None: the active one; active
    meanwhile, for plugins that build others: a multi-domain loader's loaders)."""
    kwargs = dict(kwargs or {})
    pm = pm or active_plugin_manager()
    with use_plugin_manager(pm):
        if issubclass(cls, ActivityTracker) and config is not None and "experiment_logger" not in kwargs:
            kwargs["experiment_logger"] = open_run_recorder(config, pm)
        if issubclass(cls, WeightSyncController) and "backend" not in kwargs:
            kwargs["backend"] = weight_sync_backend(config, pm)
        module = cls(config, **kwargs)
        if isinstance(module, BaseRolloutWorker):
            module.set_parts(rollout_worker_parts(config, cls, pm))
        elif isinstance(module, BaseTrainer):
            module.set_parts(trainer_parts(config, cls, pm))
    return module


# -- weight sync ------------------------------------------------------------------------------------

def weight_sync_backend(section: Any, pm: PluginManager) -> WeightSyncBackend:
    """The backend ``weight.backend`` names, built with the ``weight`` section."""
    name = bind(section, WEIGHT, "weight")["backend"]
    return pm.resolve("weight_sync_backend", name, "weight.backend")(section)


# -- trainer ----------------------------------------------------------------------------------------

def trainer_parts(config: Any, cls: type, pm: PluginManager) -> TrainerParts:
    """The algorithm registry of ``pm`` and, for a trainer that drives one, the train service
    ``service.train_service`` selects (ConfigError now, built when the trainer asks)."""
    registry = AlgorithmRegistry.from_plugin_manager(pm)
    if not getattr(cls, "TRAIN_SERVICE_BATCH_FORMAT", None):
        return TrainerParts(algorithm_registry=registry)
    config = bind_recipe(config, cls)  # the declared defaults (seed, service.train_service), as the trainer reads them
    section = config["service"]["train_service"]
    backend = section.get("backend")  # a free-form section: null when the recipe leaves the class's default
    service_cls = train_service_class(cls, {} if backend is None else {"backend": backend}, pm,
                                      config["trainer"].get("type"))
    seed = int(config["seed"])

    def build(total_steps: int) -> TrainService:
        return service_cls.from_config(dict(plain(section) or {}), seed=seed, total_steps=total_steps, path=SECTION)

    return TrainerParts(algorithm_registry=registry, train_service=build,
                        reference_service=reference_service(config["service"]["reference_service"], pm))


def reference_service(section: Any, pm: PluginManager) -> Callable[[], InferenceClient] | None:
    """Builds the KL reference's client from ``service.reference_service`` (None: not declared),
    in the trainer's process; never handed to weight sync, so its weights stay the initial ones."""
    if section is None:
        return None
    values = section.to_dict() if isinstance(section, BoundConfig) else plain(section)  # the backend binds its own
    cls = pm.resolve("inference_backend", values.get("backend"), f"{REFERENCE_SECTION}.backend")

    def build() -> InferenceClient:
        try:
            return cls(values)
        except ConfigError as exc:  # the client names its keys as the rollouts' service's: say where they are
            raise ConfigError(str(exc).replace("service.inference_service", REFERENCE_SECTION)) from None

    return build


# -- rollout workers ------------------------------------------------------------------------------

def rollout_worker_parts(config: Any, cls: type, pm: PluginManager) -> RolloutParts:
    """The evaluators a ``rollout_worker`` mapping names, and how messages name them."""
    section = config.get("evaluator")
    domain_sections = declared_value(config, "domain_evaluators", ROLLOUT_WORKER, "rollout_worker").to_dict()
    return RolloutParts(evaluator=build_evaluator(section, pm), evaluator_label=evaluator_label(section, pm),
                        domain_evaluators=build_domain_evaluators(domain_sections, pm),
                        domain_labels={str(d): evaluator_label(sub, pm) for d, sub in domain_sections.items()},
                        worker_label=worker_label(config.get("type"), cls, pm))


def build_evaluator(section: Any, pm: PluginManager, key: str = _EVALUATOR_KEY) -> Evaluator | None:
    """The evaluator a ``rollout_worker.evaluator`` mapping names (``type`` + constructor keywords)."""
    if section is None:
        return None
    cls = pm.resolve("evaluator", section.get("type"), f"{key}.type")
    items = section.items() if isinstance(section, dict) else plain(section).items()
    try:
        with use_plugin_manager(pm):
            return cls(**{k: v for k, v in items if k != "type"})
    except ConfigError as exc:
        if key == _EVALUATOR_KEY:
            raise
        # An evaluator names its keys as rollout_worker.evaluator.<option>: say where they are.
        raise ConfigError(str(exc).replace(_EVALUATOR_KEY, key)) from None
    except (ValueError, TypeError) as exc:  # options it refuses: one line, as `nexrl validate` prints it
        raise ConfigError(f"{key}: evaluator '{section.get('type')}' rejected its options: "
                          f"{type(exc).__name__}: {exc}") from None


def build_domain_evaluators(section: Any, pm: PluginManager) -> dict[str, Evaluator | None]:
    """``rollout_worker.domain_evaluators``: domain -> its evaluator (null: none, reward 0)."""
    return {str(domain): build_evaluator(sub, pm, f"rollout_worker.domain_evaluators.{domain}")
            for domain, sub in (section or {}).items()}


def evaluator_label(section: Any, pm: PluginManager) -> str:
    """``evaluator 'NAME' (distribution)``: how messages name the evaluator a recipe chose."""
    if section is None:
        return "no evaluator"
    name = section.get("type")
    registration = pm.components("evaluator").get(name)
    return f"evaluator '{name}'" + (f" ({registration.distribution})" if registration is not None else "")


def worker_label(name: Any, cls: type, pm: PluginManager) -> str:
    """``rollout worker 'NAME' (distribution)``: how messages name the recipe's rollout worker."""
    registration = pm.components("rollout_worker").get(name) if name else None
    if registration is None:
        return f"rollout worker {cls.__name__}"
    return f"rollout worker '{name}' ({registration.distribution})"


# -- the run's records ----------------------------------------------------------------------------

def open_run_recorder(config: Any, pm: PluginManager) -> Any:
    """The run's records for a recipe: files in ``run_dir`` and the ``logger.backend`` sinks."""
    from ..runtime.failure_monitor import FailedSampleMonitor
    from ..runtime.run_log import RunRecorder

    run_dir = str(config.run_dir) if config.get("run_dir") else None  # None: no files (nexrl eval without --out)
    sinks, labels = [], []
    for name in _as_list(config.logger.backend):
        sinks.append(pm.resolve("metrics_sink", name, "logger.backend")(config, run_dir))
        labels.append(f"metrics sink '{name}' ({pm.components('metrics_sink')[name].distribution})")
    return RunRecorder(run_dir, sinks, sink_labels=labels, sink_names=_as_list(config.logger.backend),
                       step_end_hook=lambda step, metrics: pm.call_step_end(step=step, metrics=metrics, config=config),
                       failure_monitor=FailedSampleMonitor.from_config(config))


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]
