"""Entry point of nexrl-torch: registers the local train service, the in-process inference engine and
the in-process weight sync. Registered lazily: they import torch and transformers, which a recipe of
other components never loads."""

from nexrl_core import Lazy, hookimpl


@hookimpl
def nexrl_train_services():
    return {"local_torch": Lazy("nexrl_torch.train.service:LocalTorchTrainService")}


@hookimpl
def nexrl_inference_backends():
    return {"hf": Lazy("nexrl_torch.rollout.weights:HFInferenceBackend")}


@hookimpl
def nexrl_weight_sync_backends():
    return {"in_process": Lazy("nexrl_torch.rollout.weights:InProcessWeightSync")}
