"""Entry point of nexrl-torch: registers the local train service, the in-process inference engine and
the in-process weight sync."""

from nexrl_core import hookimpl

from .rollout.weights import HFInferenceBackend, InProcessWeightSync
from .train.service import LocalTorchTrainService


@hookimpl
def nexrl_train_services():
    return {"local_torch": LocalTorchTrainService}


@hookimpl
def nexrl_inference_backends():
    return {"hf": HFInferenceBackend}


@hookimpl
def nexrl_weight_sync_backends():
    return {"in_process": InProcessWeightSync}
