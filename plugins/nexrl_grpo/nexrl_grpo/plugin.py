"""Entry point of nexrl-grpo: registers its trainers, train service, inference backend, weight sync and policy
losses."""

from nexrl_core import hookimpl

from . import losses
from .train_service import LocalTorchTrainService
from .trainers import SelfHostedCrossEntropyTrainer, SelfHostedGrpoTrainer
from .weights import HFInferenceBackend, InProcessWeightSync


@hookimpl
def nexrl_trainers():
    return {"self_hosted_grpo": SelfHostedGrpoTrainer, "self_hosted_cross_entropy": SelfHostedCrossEntropyTrainer}


@hookimpl
def nexrl_train_services():
    return {"local_torch": LocalTorchTrainService}


@hookimpl
def nexrl_inference_backends():
    return {"hf": HFInferenceBackend}


@hookimpl
def nexrl_weight_sync_backends():
    return {"in_process": InProcessWeightSync}


@hookimpl
def nexrl_policy_losses():
    return dict(losses.POLICY_LOSSES)
