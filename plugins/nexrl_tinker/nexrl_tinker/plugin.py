"""Entry point of nexrl-tinker: registers the remote-API trainers (on-policy distillation where nexrl-grpo is
installed), the tinker train service, and the tinker inference and weight-sync backends."""

from nexrl_core import hookimpl

from .inference import TinkerInferenceClient
from .service import TinkerTrainService
from .trainers import RemoteApiCrossEntropyTrainer, RemoteApiGrpoTrainer
from .weights import TinkerWeightSync


@hookimpl
def nexrl_trainers():
    trainers = {"remote_api_grpo": RemoteApiGrpoTrainer, "remote_api_cross_entropy": RemoteApiCrossEntropyTrainer}
    try:  # on-policy distillation reads nexrl-grpo's distillation keys (the extra nexrl-tinker[opd])
        from .opd import RemoteApiOpdTrainer
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("nexrl_grpo"):
            raise
        return trainers
    return {**trainers, "remote_api_opd": RemoteApiOpdTrainer}


@hookimpl
def nexrl_train_services():
    return {"tinker": TinkerTrainService}


@hookimpl
def nexrl_inference_backends():
    return {"tinker": TinkerInferenceClient}


@hookimpl
def nexrl_weight_sync_backends():
    return {"tinker": TinkerWeightSync}
