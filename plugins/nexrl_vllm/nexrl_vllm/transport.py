"""The tensor path of ``vllm_nccl``: the trainer process broadcasts tensors to vLLM's workers.

This is the one piece that needs a GPU and vLLM in the trainer's process: it joins vLLM's NCCL
weight-transfer group as rank 0 (vLLM's workers take ranks 1..N, ``rank_offset`` 1) and
broadcasts with vLLM's own trainer-side helper, so the wire layout (packed buffers included)
always matches what the server unpacks. The HTTP phases around it live in ``weight_sync.py``;
a test substitutes another :class:`TensorTransport` to drive them on the CPU.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from nexrl_core import ConfigError

NCCL_INSTALL_HINT = ("weight.backend vllm_nccl broadcasts from the trainer process with vLLM's NCCL helper: "
                     "install vllm there too (pip install 'nexrl-vllm[serve]'), on a machine with CUDA GPUs")


class TensorTransport(ABC):
    """Moves tensors from the trainer to the server's workers while the server's ``update_weights`` waits."""

    @abstractmethod
    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        """Join the group as rank 0 (blocks until every worker joined)."""

    @abstractmethod
    def send(self, named_tensors: Sequence[tuple[str, Any]], packed: bool) -> None:
        """Broadcast the tensors in order (the order of ``update_info.names``)."""

    def close(self) -> None:
        pass


class NcclTransport(TensorTransport):
    """NCCL broadcast through vLLM's ``NCCLWeightTransferEngine`` (trainer side)."""

    def __init__(self, device: Any = None):
        try:
            import torch
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerSendWeightsArgs,
                NCCLWeightTransferEngine,
            )
        except ImportError as exc:
            raise ConfigError(f"{NCCL_INSTALL_HINT} ({exc})") from None
        if not torch.cuda.is_available():
            raise ConfigError("weight.backend vllm_nccl needs a CUDA GPU in the trainer process (NCCL); "
                              "use vllm_disk without one")
        self._torch = torch
        self._engine = NCCLWeightTransferEngine
        self._args = NCCLTrainerSendWeightsArgs
        self.device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
        self.group: Any = None

    def init(self, master_address: str, master_port: int, world_size: int) -> None:
        self._torch.cuda.set_device(self.device)
        self.group = self._engine.trainer_init(
            {"master_address": master_address, "master_port": master_port, "world_size": world_size})

    def send(self, named_tensors: Sequence[tuple[str, Any]], packed: bool) -> None:
        device = self.device
        # Each sync broadcasts from a new thread, whose current CUDA device is cuda:0 until it says otherwise.
        self._torch.cuda.set_device(device)
        on_device = ((name, t.to(device, non_blocking=True)) for name, t in named_tensors)
        self._engine.trainer_send_weights(iterator=on_device, trainer_args=self._args(group=self.group, packed=packed))
        self._torch.cuda.synchronize(device)

    def close(self) -> None:
        self.group = None
