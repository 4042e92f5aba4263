"""Entry point of nexrl-tinker: registers its inference and weight-sync backends."""

from nexrl_core import hookimpl

from .inference import TinkerInferenceClient
from .weights import TinkerWeightSync


@hookimpl
def nexrl_inference_backends():
    return {"tinker": TinkerInferenceClient}


@hookimpl
def nexrl_weight_sync_backends():
    return {"tinker": TinkerWeightSync}
