"""Where weights come from (model paths) and how they reach the in-process engine."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Literal

import torch

from nexrl_core import (
    Capabilities,
    CompletionResult,
    InferenceError,
    MemoryPlan,
    PlanInputs,
    SamplingParams,
    Settings,
    WeightSyncBackend,
    deferred,
    execute,
    processes_are_actors,
    setting,
)

from ..models import apply_process_options, check_model_section, config_errors, own_settings, resolve_model_path
from .engine import HFInferenceEngine, copy_weights
from .settings import HFBackendSettings


class HFInferenceBackend(HFInferenceEngine):
    """The ``hf`` inference backend: the in-process engine, with recipe model paths resolved."""

    SETTINGS = HFBackendSettings
    CAPABILITIES = Capabilities(provides={"inference:load_weights", "inference:in_flight_weights"})
    check_config = staticmethod(check_model_section)

    @classmethod
    def check_recipe(cls, recipe: Mapping[str, Any]) -> list[str]:
        """In-flight weight updates reach one engine only (replicas each finish their batch first)."""
        weight, section = recipe.get("weight") or {}, (recipe.get("service") or {}).get("inference_service") or {}
        if isinstance(weight, dict) and weight.get("partial_rollout") is True and \
                isinstance(section.get("replicas"), int) and section["replicas"] > 1:
            return ["weight.partial_rollout: the hf engine takes in-flight updates with one replica "
                    "(service.inference_service.replicas: 1)"]
        return []

    @classmethod
    def recipe_notes(cls, section: Mapping[str, Any]) -> list[str]:
        """What ``nexrl validate`` and ``nexrl run`` say about this engine before it loads: a model
        its fast decoding path cannot serve, and which path will (from the model's config.json)."""
        from .decoding import config_decoding_note

        if section.get("fast_path") is False or str(section.get("fast_path")).lower() == "false":
            return []
        note = config_decoding_note(section.get("model_path"), section.get("gguf_file"),
                                    static_cache=section.get("static_cache"), device=section.get("device"))
        return [] if note is None else [f"service.inference_service: {note}"]

    @classmethod
    def memory_plan(cls, section: Mapping[str, Any], inputs: PlanInputs) -> MemoryPlan:
        """What ``nexrl plan`` counts for this engine (:func:`nexrl_torch.plan.engine_plan`)."""
        from ..plan import engine_plan

        return engine_plan(HFBackendSettings.own(section, "service.inference_service"), inputs)

    def __init__(self, config: Mapping[str, Any]):
        cfg = type(self).own_section(config).to_dict()  # plain values, interpolations resolved
        cfg["model_path"] = resolve_model_path(cfg.get("model_path"), cfg.get("gguf_file"))
        cfg["gguf_file"] = None  # converted
        with config_errors("service.inference_service"):
            self.settings = settings = own_settings(HFBackendSettings, cfg)
            replicas = settings.replicas
            in_actors = settings.replica_actors and replicas > 1 and processes_are_actors()
            cfg = {k: v for k, v in cfg.items() if k not in ("replicas", "replica_actors")}
            apply_process_options(settings)
            super().__init__(cfg)
            # Replica 0 is this engine; the others are engines of their own on the next devices, or in actors.
            self.replicas: list[Any] = [self]
            if in_actors:
                self.replicas += _replica_actors(cfg, self.device, replicas)
            else:
                self.replicas += [HFInferenceEngine({**cfg, "device": str(replica_device(self.device, i))})
                                  for i in range(1, replicas)]
        self._busy = [0] * replicas
        self.served = [0] * replicas  # requests each replica took
        self._busy_lock = threading.Lock()

    @contextlib.contextmanager
    def _replica(self) -> Iterator[HFInferenceEngine]:
        """The replica with the fewest requests in flight, for the length of one request."""
        with self._busy_lock:
            index = min(range(len(self.replicas)), key=lambda i: (self._busy[i], i))
            self._busy[index] += 1
            self.served[index] += 1
        try:
            yield self.replicas[index]
        finally:
            with self._busy_lock:
                self._busy[index] -= 1

    def complete(self, prompt: str | list[dict[str, Any]], params: SamplingParams) -> CompletionResult:
        if len(self.replicas) == 1:
            return super().complete(prompt, params)
        with self._replica() as engine:
            return self._on(engine, "complete", prompt, params)

    def chat(self, messages: list[dict[str, Any]], params: SamplingParams,
             tools: list[dict[str, Any]] | None = None) -> CompletionResult:
        if len(self.replicas) == 1:
            return super().chat(messages, params, tools)
        with self._replica() as engine:
            return self._on(engine, "chat", messages, params, tools)

    def _on(self, engine: Any, method: str, *args: Any) -> Any:
        """``engine.method(*args)``: this engine's own (not this class's override), another's, or an actor's."""
        return getattr(HFInferenceEngine, method)(engine, *args) if engine is self else getattr(engine, method)(*args)

    def load_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, in_flight: bool = False,
                     recompute_prefix: bool = False) -> None:
        """Every replica, in one pass over the tensors (each replica's batch in flight finishes
        first); each serves the new version from its next batch. ``in_flight`` (one replica: the
        recipe check refuses more): the running batch takes them at its next decode step."""
        if len(self.replicas) == 1:
            return super().load_weights(state_dict, version, in_flight, recompute_prefix)
        if in_flight:
            raise ValueError("weight.partial_rollout: needs one engine replica (service.inference_service.replicas: 1)")
        self.check_weights(state_dict)
        here = [engine for engine in self.replicas if isinstance(engine, HFInferenceEngine)]
        away = [engine for engine in self.replicas if engine not in here]
        pushes = []
        if away:
            from concurrent.futures import ThreadPoolExecutor

            from nexrl_core import share

            state_dict = dict(state_dict.items())  # gathered whole when sharded
            shared = share({k: v.detach().cpu() for k, v in state_dict.items()})  # in the object store once
            pool = ThreadPoolExecutor(len(away))
            pushes = [pool.submit(engine.load_weights, shared, version) for engine in away]
            pool.shutdown(wait=False)
        with contextlib.ExitStack() as held:
            for engine in here:
                held.enter_context(engine._model_lock)
            copy_weights(state_dict, here)
            for engine in here:
                engine.set_model_version(version)
        for push in pushes:
            push.result()

    def push_weights(self, state_dict: Mapping[str, torch.Tensor], version: int, in_flight: bool = False,
                     recompute_prefix: bool = False, after_apply: Callable[[], None] | None = None,
                     on_done: Callable[[BaseException | None], None] | None = None) -> bool:
        """One replica: :meth:`HFInferenceEngine.push_weights`; several: loaded here (each replica's batch first)."""
        if len(self.replicas) == 1:
            return super().push_weights(state_dict, version, in_flight, recompute_prefix, after_apply, on_done)
        self._push_here(state_dict, version, in_flight, recompute_prefix, after_apply, on_done)
        return False

    def replica_stats(self) -> list[dict[str, int]]:
        """Each replica's served version and the requests it took so far, in replica order."""
        return [{"version": self._on(engine, "model_version"), "requests": self.served[i]}
                for i, engine in enumerate(self.replicas)]

    def model_version(self) -> int:
        """The oldest version any replica serves."""
        if len(getattr(self, "replicas", ())) <= 1:
            return super().model_version()
        return min(self._on(engine, "model_version") for engine in self.replicas)

    def health_check(self) -> bool:
        return all(self._on(engine, "health_check") for engine in self.replicas)

    def close(self) -> None:
        for i, engine in enumerate(self.replicas):
            self._on(engine, "close")
            if not isinstance(engine, (HFInferenceEngine, _ClosedReplica)):
                self.replicas[i] = _ClosedReplica(engine.model_version())
                engine.stop()


class _ClosedReplica:
    """A replica whose actor is gone after close: the version it served last; requests fail as a
    closed engine's do."""

    def __init__(self, version: int):
        self.version = version

    def model_version(self) -> int:
        return self.version

    def health_check(self) -> bool:
        return False

    def close(self) -> None:
        pass

    def _closed(self, *args: Any) -> Any:
        raise InferenceError("HFInferenceEngine is closed")

    complete = chat = load_weights = _closed


def _replica_actors(cfg: dict[str, Any], device: torch.device, replicas: int) -> list[Any]:
    """Replicas 1..N-1 as engines in Ray actors of their own (each sees its one GPU as cuda:0)."""
    from loguru import logger

    from nexrl_core import start_objects

    on_gpu = device.type == "cuda"
    names = [f"nexrl-engine-replica-{i}" for i in range(1, replicas)]
    engines = start_objects(HFInferenceEngine, [({**cfg, "device": "cuda" if on_gpu else str(device)},)
                                                for _ in names], names, num_gpus=1 if on_gpu else 0)
    logger.info("inference service: " + ", ".join(f"replica {i}: {e.kind} {e.name} on {e.host} (pid {e.pid})"
                                                  for i, e in enumerate(engines, start=1)))
    return engines


def replica_device(base: torch.device, index: int) -> torch.device:
    """Replica ``index``'s device: the ``index``-th GPU counted from ``base`` (round the box), or the CPU."""
    if base.type != "cuda":
        return base
    return torch.device("cuda", (base.index + index) % torch.cuda.device_count())


@dataclass(frozen=True, kw_only=True)
class InProcessSyncSettings(Settings):
    """The ``weight`` keys of the in-process sync."""

    background_push: bool = setting(
        True, "async modes: a push hands the trainer's tensors to the engine and returns; the engine copies them "
              "on its own thread (at its next decode step with weight.partial_rollout, else before its next batch, "
              "at once when idle) and scores the served-version probe there before sampling under them; the "
              "trainer's next optimizer step waits until they are copied, so no copy of the weights is made (no "
              "memory beyond the engine's own); false: the trainer waits for the copy, the repacking and the probe "
              "(sync mode always does)",
        needs="weight.sync_mode != sync")
    partial_rollout_prefix: Literal["keep", "recompute"] = setting(
        "keep", "after an in-flight update (weight.partial_rollout), the tokens already generated: keep their KV "
                "cache (computed by the old weights) or recompute it under the new weights (one prefill of every "
                "running request)", needs="weight.partial_rollout")


class InProcessWeightSync(WeightSyncBackend):
    """Copies the trainer's tensors into the engine's model; the engine serves them from its next batch.

    The tensors go as a deferred argument: straight from the trainer to the engine, in process
    when they share one (local mode, a Ray actor hosting both), else through the launch mode's
    transport (Ray's object store), never through the weight-sync controller's process."""

    SETTINGS = InProcessSyncSettings
    CAPABILITIES = Capabilities(
        provides={"weight_sync:state_dict", "weight_sync:in_flight"},
        requires={"trainer:state_dict": "it copies the tensors a trainer in this process exports",
                  "inference:load_weights": "it loads them into an inference engine in this process"})

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)
        self.settings = InProcessSyncSettings.own(self.config, "weight")
        self.in_flight: bool = self.config["partial_rollout"]  # the core's key

    def sync_in_background(self, trainer: Any, inference_client: Any, version: int, after_apply: Callable[[], None],
                           on_done: Callable[[BaseException | None], None]) -> bool:
        """``weight.background_push``: the engine in this process takes the trainer's tensors on its own
        thread (:meth:`HFInferenceEngine.push_weights`); False when off, or when the engine is elsewhere
        (its calls cannot carry the callbacks)."""
        if not self.settings.background_push or not isinstance(inference_client, HFInferenceEngine):
            return False
        execute(inference_client.push_weights, deferred(trainer.export_weights), version, self.in_flight,
                self.settings.partial_rollout_prefix == "recompute", after_apply, on_done)
        return True

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        if self.in_flight:  # the running batch takes them at its next decode step
            execute(inference_client.load_weights, deferred(trainer.export_weights), version, True,
                    self.settings.partial_rollout_prefix == "recompute")
        else:
            execute(inference_client.load_weights, deferred(trainer.export_weights), version)
