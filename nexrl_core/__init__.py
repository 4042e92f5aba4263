"""nexrl-core: hook specs, plugin manager, controller and data flow of the nexrl RL framework."""

from . import algorithms
from .api import run
from .config.options import REQUIRED, Capabilities, Option, check_options, component_options
from .controller import NexRLController, RunFailed, RunSummary
from .dataloader import BaseDataLoader
from .errors import ConfigError, DataError, ErrorReporter, ErrorSeverity, NexRLError, PluginError
from .evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from .inference import CompletionResult, InferenceClient, InferenceError, SamplingParams
from .launch.processes import StartedProcess, rendezvous_host, start_processes
from .markers import hookimpl
from .plugins import PluginManager, get_plugin_manager
from .rollout_worker import BaseRolloutWorker, ItemFailure
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
from .runtime.logs import demote_library_log
from .runtime.module import NexRLModule
from .runtime.threaded import ThreadedModule
from .tool_calls import as_text_messages, parse_tool_calls, render_tool_calls, tools_system_prompt
from .train_service import StepResult, TrainService
from .trainer import BaseTrainer
from .trajectory_pool import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    TrajectoryPool,
    TrajectoryPoolInstance,
)
from .types import Batch, ModelTag, NexRLRole, Trajectory, trajectory_reward, trajectory_segments
from .validator import Validator
from .weight_sync import WeightSyncBackend, WeightSyncController

# The built-in components most often subclassed (imported last: they build on the names above).
# isort: split
from .builtins.dataloaders import FileDataLoader  # noqa: E402
from .builtins.workers import SimpleRolloutWorker  # noqa: E402

__all__ = [
    "REQUIRED", "ActivityTracker", "ActivityTrackerProxy", "BaseDataLoader", "BaseEvaluationTarget", "BaseRolloutWorker",
    "BaseTrainer", "Batch", "Capabilities", "CompletionResult", "ConfigError", "DataError", "Deferred", "ErrorReporter",
    "ErrorSeverity",
    "EvaluationRunResult", "Evaluator", "FileDataLoader", "GroupedTrajectoryStore", "HierarchicalTrajectoryStore",
    "InferenceClient", "InferenceError", "ItemFailure", "ModelTag", "ModuleUnavailable", "NexRLController",
    "NexRLError", "NexRLModule", "NexRLRole", "Option", "PluginError", "PluginManager", "RpcTimeout", "RunFailed",
    "RunSummary",
    "SamplingParams", "StepResult", "TrainService", "SimpleRolloutWorker", "SimpleTrajectoryStore", "ThreadedModule", "Trajectory",
    "TrajectoryPool", "TrajectoryPoolInstance", "Validator", "WeightSyncBackend", "WeightSyncController",
    "algorithms", "check_options", "component_options", "deferred", "execute", "execute_async",
    "execute_with_timeout", "get_plugin_manager", "hookimpl", "OpenAICompatibleClient", "trajectory_reward",
    "trajectory_segments",
    "as_text_messages", "parse_tool_calls", "render_tool_calls", "tools_system_prompt",
    "algorithms", "check_options", "component_options", "demote_library_log", "execute", "execute_async", "execute_with_timeout",
    "get_plugin_manager", "hookimpl", "OpenAICompatibleClient", "StartedProcess", "rendezvous_host", "start_processes",
    "run",
]


def __getattr__(name: str):
    # Imported on first use: it pulls in the `openai` package, which most imports of nexrl_core never need.
    if name == "OpenAICompatibleClient":
        from .builtins.openai_client import OpenAICompatibleClient

        return OpenAICompatibleClient
    from ._moved import MOVED

    if f"{__name__}.{name}" in MOVED:  # `nexrl_core.schema` after `import nexrl_core`: the deprecated alias
        import importlib

        return importlib.import_module(f"{__name__}.{name}")
    raise AttributeError(f"module 'nexrl_core' has no attribute {name!r}")
