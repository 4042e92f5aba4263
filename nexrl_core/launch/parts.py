"""The parts a module is built with: evaluators, the weight-sync backend, the train service, the
algorithm registry, the run's records and metrics sinks.

The launcher resolves them through the plugin manager, in the process the module lives in (a Ray
actor builds its own: evaluators and services need not pickle), and hands them in. Components
never look the manager up (tests/core/test_layers.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from typing import Any

from ..algorithms.registry import AlgorithmRegistry
from ..config.schema import CORE_OPTIONS, RolloutWorkerSettings, WeightSettings
from ..config.settings import plain, read_section
from ..errors import ConfigError, PluginError
from ..evaluation import Evaluator
from ..plugins import PluginManager, active_plugin_manager, use_plugin_manager
from ..rollout_worker import BaseRolloutWorker, RolloutParts
from ..runtime.activity import ActivityTracker
from ..runtime.inference import InferenceClient
from ..runtime.train_service import SECTION, TrainService, train_service_class
from ..trainer import BaseTrainer, TrainerParts
from ..weight_sync import WeightSyncBackend, WeightSyncController
from .recipe import REFERENCE_SECTION

_EVALUATOR_KEY = "rollout_worker.evaluator"
# What to change in a class written before parts came to the constructor (through set_parts).
PARTS_FIX = ("a rollout worker or trainer receives its parts in its constructor; write "
             "`def __init__(self, config, parts=None):` and call `super().__init__(config, parts)`")


def build_module(cls: type, config: Mapping[str, Any] | None, kwargs: dict[str, Any] | None = None,
                 pm: PluginManager | None = None) -> Any:
    """``cls(config, **kwargs)`` with its parts (a rollout worker's or a trainer's: the ``parts``
    keyword), built with ``pm`` (None: the active one; active meanwhile, for plugins that build
    others: a multi-domain loader's loaders)."""
    kwargs = dict(kwargs or {})
    pm = pm or active_plugin_manager()
    with use_plugin_manager(pm):
        if issubclass(cls, ActivityTracker) and config is not None and "experiment_logger" not in kwargs:
            kwargs["experiment_logger"] = open_run_recorder(config, pm)
        if issubclass(cls, WeightSyncController) and "backend" not in kwargs:
            kwargs["backend"] = weight_sync_backend(config, pm)
        parts = None if config is None else module_parts(cls, config, pm)
        if parts is not None and takes_parts(cls):
            kwargs["parts"] = parts
        elif parts is not None and (needed := parts_needed(cls, parts)):
            raise PluginError(f"{cls.__module__}.{cls.__qualname__}.__init__ takes no `parts`, so it would run "
                              f"without {' and '.join(needed)}: {PARTS_FIX}")
        return cls(config, **kwargs)


def module_parts(cls: type, config: Mapping[str, Any], pm: PluginManager) -> RolloutParts | TrainerParts | None:
    """The parts a rollout worker or a trainer is built with (None: another module)."""
    if issubclass(cls, BaseRolloutWorker):
        return rollout_worker_parts(config, cls, pm)
    if issubclass(cls, BaseTrainer):
        return trainer_parts(config, cls, pm)
    return None


def takes_parts(cls: type) -> bool:
    """Whether ``cls(config, parts=...)`` is accepted (a ``parts`` parameter, or ``**kwargs``)."""
    params = inspect.signature(cls).parameters.values()
    return any((p.name == "parts" and p.kind is not p.POSITIONAL_ONLY) or p.kind is p.VAR_KEYWORD for p in params)


def parts_needed(cls: type, parts: RolloutParts | TrainerParts) -> list[str]:
    """What in ``parts`` the module would miss: a recipe's evaluators, a trainer's train service,
    the registry a trainer that selects algorithms reads. Labels alone are not missed."""
    if isinstance(parts, RolloutParts):
        needed = [parts.evaluator_label] if parts.evaluator is not None else []
        return needed + (["rollout_worker.domain_evaluators"] if any(parts.domain_evaluators.values()) else [])
    needed = ["the train service"] if parts.train_service is not None else []
    if getattr(cls, "ALGORITHM_OPTIONS", None) or getattr(cls, "ALGORITHM_SELECTORS", None):
        needed.append("the algorithm registry")
    return needed


# -- weight sync ------------------------------------------------------------------------------------

def weight_sync_backend(section: Mapping[str, Any] | None, pm: PluginManager) -> WeightSyncBackend:
    """The backend ``weight.backend`` names, built with the ``weight`` section."""
    name = WeightSettings.own(section, "weight").backend
    return pm.resolve("weight_sync_backend", name, "weight.backend")(section)


# -- trainer ----------------------------------------------------------------------------------------

def trainer_parts(config: Mapping[str, Any], cls: type, pm: PluginManager) -> TrainerParts:
    """The algorithm registry of ``pm`` and, for a trainer that drives one, the train service
    ``service.train_service`` selects (ConfigError now, built when the trainer asks)."""
    registry = AlgorithmRegistry.from_plugin_manager(pm)
    if not getattr(cls, "TRAIN_SERVICE_BATCH_FORMAT", None):
        return TrainerParts(algorithm_registry=registry)
    # each core default filled, as the trainer reads it (a recipe built by hand may lack run_dir: not typed whole)
    recipe = read_section(config, CORE_OPTIONS, "")
    section = recipe["service"]["train_service"].to_dict()
    backend = section.get("backend")  # a free-form section: null when the recipe leaves the class's default
    service_cls = train_service_class(cls, {} if backend is None else {"backend": backend}, pm,
                                      recipe["trainer"].get("type"))
    seed = int(recipe["seed"])

    def build(total_steps: int) -> TrainService:
        return service_cls.from_config(dict(section), seed=seed, total_steps=total_steps, path=SECTION)

    return TrainerParts(algorithm_registry=registry, train_service=build,
                        reference_service=reference_service(recipe["service"]["reference_service"], pm))


def reference_service(section: Mapping[str, Any] | None, pm: PluginManager) -> Callable[[], InferenceClient] | None:
    """Builds the KL reference's client from ``service.reference_service`` (None: not declared),
    in the trainer's process; never handed to weight sync, so its weights stay the initial ones."""
    if section is None:
        return None
    values = plain(section)  # the backend reads its own keys
    cls = pm.resolve("inference_backend", values.get("backend"), f"{REFERENCE_SECTION}.backend")

    def build() -> InferenceClient:
        try:
            return cls(values)
        except ConfigError as exc:  # the client names its keys as the rollouts' service's: say where they are
            raise ConfigError(str(exc).replace("service.inference_service", REFERENCE_SECTION)) from None

    return build


# -- rollout workers ------------------------------------------------------------------------------

def rollout_worker_parts(config: Mapping[str, Any], cls: type, pm: PluginManager) -> RolloutParts:
    """The evaluators a ``rollout_worker`` mapping names, and how messages name them."""
    section = config.get("evaluator")
    domain_sections = RolloutWorkerSettings.own(config, "rollout_worker").domain_evaluators
    return RolloutParts(evaluator=build_evaluator(section, pm), evaluator_label=evaluator_label(section, pm),
                        domain_evaluators=build_domain_evaluators(domain_sections, pm),
                        domain_labels={str(d): evaluator_label(sub, pm) for d, sub in domain_sections.items()},
                        worker_label=worker_label(config.get("type"), cls, pm))


def build_evaluator(section: Mapping[str, Any] | None, pm: PluginManager, key: str = _EVALUATOR_KEY) -> Evaluator | None:
    """The evaluator a ``rollout_worker.evaluator`` mapping names (``type`` + constructor keywords)."""
    if section is None:
        return None
    cls = pm.resolve("evaluator", section.get("type"), f"{key}.type")
    items = plain(section).items()
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


def build_domain_evaluators(section: Mapping[str, Any] | None, pm: PluginManager) -> dict[str, Evaluator | None]:
    """``rollout_worker.domain_evaluators``: domain -> its evaluator (null: none, reward 0)."""
    return {str(domain): build_evaluator(sub, pm, f"rollout_worker.domain_evaluators.{domain}")
            for domain, sub in (section or {}).items()}


def evaluator_label(section: Mapping[str, Any] | None, pm: PluginManager) -> str:
    """``evaluator 'NAME' (distribution)``: how messages name the evaluator a recipe chose."""
    if section is None:
        return "no evaluator"
    name = section.get("type")
    registration = pm.components("evaluator").get(name) if isinstance(name, str) else None
    return f"evaluator '{name}'" + (f" ({registration.distribution})" if registration is not None else "")


def worker_label(name: Any, cls: type, pm: PluginManager) -> str:
    """``rollout worker 'NAME' (distribution)``: how messages name the recipe's rollout worker."""
    registration = pm.components("rollout_worker").get(name) if name else None
    if registration is None:
        return f"rollout worker {cls.__name__}"
    return f"rollout worker '{name}' ({registration.distribution})"


# -- the run's records ----------------------------------------------------------------------------

def open_run_recorder(config: Mapping[str, Any], pm: PluginManager) -> Any:
    """The run's records for a recipe: files in ``run_dir`` and the ``logger.backend`` sinks."""
    from ..runtime.failure_monitor import FailedSampleMonitor
    from ..runtime.run_log import RunRecorder

    run_dir = str(config["run_dir"]) if config.get("run_dir") else None  # None: no files (nexrl eval without --out)
    sinks, labels = [], []
    backends = _as_list(config["logger"]["backend"])
    for name in backends:
        sinks.append(pm.resolve("metrics_sink", name, "logger.backend")(config, run_dir))
        labels.append(f"metrics sink '{name}' ({pm.components('metrics_sink')[name].distribution})")
    return RunRecorder(run_dir, sinks, sink_labels=labels, sink_names=backends,
                       step_end_hook=lambda step, metrics: pm.call_step_end(step=step, metrics=metrics, config=config),
                       failure_monitor=FailedSampleMonitor.from_config(config))


def _as_list(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    return [str(v) for v in value]
