"""Entry point of nexrl-vllm: the `vllm` inference backend and the vLLM weight-sync backends."""

from nexrl_core import hookimpl

from .client import VLLMClient
from .weight_sync import VLLMDiskWeightSync, VLLMLoraWeightSync, VLLMNcclWeightSync


@hookimpl
def nexrl_inference_backends():
    return {"vllm": VLLMClient}


@hookimpl
def nexrl_weight_sync_backends():
    return {"vllm_disk": VLLMDiskWeightSync, "vllm_lora": VLLMLoraWeightSync, "vllm_nccl": VLLMNcclWeightSync}
