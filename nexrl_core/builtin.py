"""The core's own components, registered through the same hooks as any plugin."""

from __future__ import annotations

from .dataloader import FileDataLoader
from .evaluators import ExactMatchEvaluator, NumericAnswerEvaluator
from .hookspecs import hookspec  # noqa: F401  (keeps the spec module imported first)
from .markers import hookimpl
from .mock import InlineDataLoader, MockInferenceClient, MockTrainer
from .openai_client import OpenAICompatibleClient
from .rollout_worker import SimpleRolloutWorker
from .run_log import ConsoleSink, WandbSink
from .tasks import ArithmeticDataLoader, PigLatinRolloutWorker
from .weight_sync import VersionOnlyWeightSync


@hookimpl
def nexrl_dataloaders():
    return {"file": FileDataLoader, "inline": InlineDataLoader, "arithmetic": ArithmeticDataLoader}


@hookimpl
def nexrl_rollout_workers():
    return {"simple": SimpleRolloutWorker, "pig_latin": PigLatinRolloutWorker}


@hookimpl
def nexrl_evaluators():
    return {"exact_match": ExactMatchEvaluator, "numeric_answer": NumericAnswerEvaluator}


@hookimpl
def nexrl_trainers():
    return {"mock": MockTrainer}


@hookimpl
def nexrl_weight_sync_backends():
    return {"version_only": VersionOnlyWeightSync}


@hookimpl
def nexrl_inference_backends():
    return {"openai": OpenAICompatibleClient, "mock": MockInferenceClient}


@hookimpl
def nexrl_metrics_sinks():
    return {"console": ConsoleSink, "wandb": WandbSink}
