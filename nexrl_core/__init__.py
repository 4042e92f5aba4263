"""nexrl-core: hook specs, plugin manager, controller and data flow of the nexrl RL framework."""

from typing import TYPE_CHECKING

from . import algorithms
from .api import run
from .cli import migration_table as _migration_table  # noqa: F401  (the checks' hints for NexRL keys)
from .config.options import REQUIRED, Capabilities, Option, check_options, component_options
from .config.settings import Settings, setting
from .controller import NexRLController, RunFailed, RunSummary
from .dataloader import BaseDataLoader
from .errors import ConfigError, DataError, ErrorReporter, ErrorSeverity, NexRLError, PluginError
from .evaluation import (
    ANSWER_FIELDS,
    BaseEvaluationTarget,
    EvaluationRunResult,
    Evaluator,
    required_row_field,
    row_field,
)
from .launch.processes import (
    StartedProcess,
    processes_are_actors,
    rendezvous_host,
    share,
    start_objects,
    start_processes,
)
from .markers import Lazy, hookimpl
from .plugins import PluginManager, get_plugin_manager
from .rollout_worker import BaseRolloutWorker, ItemFailure, RolloutParts
from .runtime.activity import ActivityTracker, ActivityTrackerProxy
from .runtime.execute import (
    Deferred,
    ModuleUnavailable,
    RpcTimeout,
    deferred,
    execute,
    execute_async,
    execute_with_timeout,
)
from .runtime.inference import CompletionResult, InferenceClient, InferenceError, SamplingParams
from .runtime.logs import demote_library_log
from .runtime.memory_plan import MemoryItem, MemoryPlan, PlanInputs, Saving
from .runtime.module import NexRLModule
from .runtime.sinks import MetricsSink
from .runtime.threaded import ThreadedModule
from .runtime.train_service import StepResult, TrainService
from .tool_calls import as_text_messages, parse_tool_calls, render_tool_calls, tools_system_prompt
from .trainer import BaseTrainer, TrainerParts
from .trajectory_pool import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    TrajectoryPool,
    TrajectoryPoolInstance,
)
from .types import (
    Batch,
    ModelTag,
    NexRLRole,
    SampleResult,
    TrainOutput,
    Trajectory,
    TrajectoryBatch,
    trajectory_reward,
    trajectory_segments,
    trajectory_token_versions,
)
from .validator import Validator
from .weight_sync import WeightSyncBackend, WeightSyncController

__all__ = [
    "ActivityTracker", "ActivityTrackerProxy", "BaseDataLoader", "BaseEvaluationTarget", "BaseRolloutWorker",
    "BaseTrainer", "Batch", "Capabilities", "CompletionResult", "ConfigError", "DataError", "Deferred",
    "ErrorReporter", "ErrorSeverity", "EvaluationRunResult", "Evaluator", "FileDataLoader",
    "GroupedTrajectoryStore", "HierarchicalTrajectoryStore", "InferenceClient", "InferenceError", "ItemFailure", "Lazy",
    "MemoryItem", "MemoryPlan", "MetricsSink", "PlanInputs", "Saving",
    "ModelTag", "ModuleUnavailable", "NexRLController", "NexRLError", "NexRLModule", "NexRLRole",
    "OpenAICompatibleClient", "Option", "PluginError", "PluginManager", "REQUIRED", "RpcTimeout", "RunFailed",
    "RolloutParts", "RunSummary", "SamplingParams", "Settings", "SimpleRolloutWorker", "SimpleTrajectoryStore", "StartedProcess", "StepResult",
    "SampleResult", "ThreadedModule", "TrainOutput", "TrainService", "TrainerParts", "Trajectory", "TrajectoryBatch", "TrajectoryPool", "TrajectoryPoolInstance", "Validator",
    "WeightSyncBackend", "WeightSyncController", "algorithms", "as_text_messages", "check_options",
    "component_options", "deferred", "demote_library_log", "execute", "execute_async", "execute_with_timeout",
    "get_plugin_manager", "hookimpl", "parse_tool_calls", "processes_are_actors", "render_tool_calls", "rendezvous_host",
    "share", "start_objects", "start_processes",
    "ANSWER_FIELDS", "required_row_field", "row_field",
    "run", "setting", "tools_system_prompt", "trajectory_reward", "trajectory_segments", "trajectory_token_versions",
]

# Built-ins (and the `openai` package the client needs) load on first use: a broken built-in
# plugin is reported by the plugin manager and must not break `import nexrl_core`.
if TYPE_CHECKING:  # what the lazy names are, for type checkers and editors
    from .builtins.dataloaders import FileDataLoader
    from .builtins.openai_client import OpenAICompatibleClient
    from .builtins.workers import SimpleRolloutWorker

_LAZY = {
    "FileDataLoader": "nexrl_core.builtins.dataloaders",
    "SimpleRolloutWorker": "nexrl_core.builtins.workers",
    "OpenAICompatibleClient": "nexrl_core.builtins.openai_client",
}


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value  # later reads skip this function
        return value
    raise AttributeError(f"module 'nexrl_core' has no attribute {name!r}")
