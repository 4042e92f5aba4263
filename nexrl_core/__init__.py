"""nexrl-core: hook specs, plugin manager, controller and data flow of the nexrl RL framework."""

from . import algorithms
from .runtime.activity import ActivityTracker, ActivityTrackerProxy
from .controller import NexRLController, RunFailed, RunSummary
from .dataloader import BaseDataLoader
from .errors import ConfigError, DataError, ErrorReporter, ErrorSeverity, NexRLError, PluginError
from .evaluation import BaseEvaluationTarget, EvaluationRunResult, Evaluator
from .runtime.execute import ModuleUnavailable, RpcTimeout, execute, execute_async, execute_with_timeout
from .inference import CompletionResult, InferenceClient, InferenceError, SamplingParams
from .markers import hookimpl
from .options import REQUIRED, Capabilities, Option, check_options, component_options
from .plugins import PluginManager, get_plugin_manager
from .runtime.module import NexRLModule
from .runtime.threaded import ThreadedModule
from .rollout_worker import BaseRolloutWorker, ItemFailure
from .trainer import BaseTrainer
from .trajectory_pool import (GroupedTrajectoryStore, HierarchicalTrajectoryStore, SimpleTrajectoryStore,
                              TrajectoryPool, TrajectoryPoolInstance)
from .types import Batch, ModelTag, NexRLRole, Trajectory
from .validator import Validator
from .weight_sync import WeightSyncBackend, WeightSyncController

# The built-in components most often subclassed (imported last: they build on the names above).
from .builtins.dataloaders import FileDataLoader  # noqa: E402
from .builtins.workers import SimpleRolloutWorker  # noqa: E402

__all__ = [
    "REQUIRED", "ActivityTracker", "ActivityTrackerProxy", "BaseDataLoader", "BaseEvaluationTarget", "BaseRolloutWorker",
    "BaseTrainer", "Batch", "Capabilities", "CompletionResult", "ConfigError", "DataError", "ErrorReporter", "ErrorSeverity",
    "EvaluationRunResult", "Evaluator", "FileDataLoader", "GroupedTrajectoryStore", "HierarchicalTrajectoryStore",
    "InferenceClient", "InferenceError", "ItemFailure", "ModelTag", "ModuleUnavailable", "NexRLController",
    "NexRLError", "NexRLModule", "NexRLRole", "Option", "PluginError", "PluginManager", "RpcTimeout", "RunFailed",
    "RunSummary",
    "SamplingParams", "SimpleRolloutWorker", "SimpleTrajectoryStore", "ThreadedModule", "Trajectory",
    "TrajectoryPool", "TrajectoryPoolInstance", "Validator", "WeightSyncBackend", "WeightSyncController",
    "algorithms", "check_options", "component_options", "execute", "execute_async", "execute_with_timeout",
    "get_plugin_manager", "hookimpl", "OpenAICompatibleClient",
]


def __getattr__(name: str):
    # Imported on first use: it pulls in the `openai` package, which most imports of nexrl_core never need.
    if name == "OpenAICompatibleClient":
        from .builtins.openai_client import OpenAICompatibleClient

        return OpenAICompatibleClient
    raise AttributeError(f"module 'nexrl_core' has no attribute {name!r}")
