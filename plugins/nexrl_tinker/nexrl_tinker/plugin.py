"""Entry point of nexrl-tinker: registers the remote-API trainers, the tinker train service, and the tinker
inference and weight-sync backends."""

from nexrl_core import hookimpl

from .inference import TinkerInferenceClient
from .service import TinkerTrainService
from .trainers import RemoteApiCrossEntropyTrainer, RemoteApiGrpoTrainer
from .weights import TinkerWeightSync


@hookimpl
def nexrl_trainers():
    return {"remote_api_grpo": RemoteApiGrpoTrainer, "remote_api_cross_entropy": RemoteApiCrossEntropyTrainer}


@hookimpl
def nexrl_train_services():
    return {"tinker": TinkerTrainService}


@hookimpl
def nexrl_inference_backends():
    return {"tinker": TinkerInferenceClient}


@hookimpl
def nexrl_weight_sync_backends():
    return {"tinker": TinkerWeightSync}
