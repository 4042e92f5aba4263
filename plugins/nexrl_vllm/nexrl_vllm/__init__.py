"""nexrl-vllm: vLLM as nexrl's rollout inference service, with disk and NCCL weight sync."""

from .client import VLLMClient
from .control import SyncPhaseError, VLLMControl
from .server import ManagedVLLMServer, ServeOptions, ServerStartError
from .transport import NcclTransport, TensorTransport
from .weight_sync import VLLMDiskWeightSync, VLLMLoraWeightSync, VLLMNcclWeightSync

__all__ = ["ManagedVLLMServer", "NcclTransport", "ServeOptions", "ServerStartError", "SyncPhaseError",
           "TensorTransport", "VLLMClient", "VLLMControl", "VLLMDiskWeightSync", "VLLMLoraWeightSync",
           "VLLMNcclWeightSync"]
