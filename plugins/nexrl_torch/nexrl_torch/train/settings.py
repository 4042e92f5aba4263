"""The ``local_torch`` train service's recipe keys (``service.train_service``), declared once: read by
the service (:mod:`.service`) and by its memory plan (:mod:`nexrl_torch.plan`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nexrl_core import setting

from ..models import AutoFlag, ModelSettings, _auto_flag
from .distributed import PARALLEL_MODES
from .lora import LoraSettings

# Compute precisions of training. bfloat16 is mixed precision: the model's matmuls and attention run
# under bf16 autocast while the weights, their gradients and Adam's state stay float32, and the
# log-softmax and loss are float32 (float16 would need loss scaling: not offered).
TRAIN_DTYPES = ("float32", "bfloat16")


def _betas(value: list[float]) -> str | None:
    return None if len(value) == 2 and all(0 <= b < 1 for b in value) else \
        f"expected [beta1, beta2], each in [0, 1), got {list(value)}"


@dataclass(frozen=True, kw_only=True)
class TrainServiceSettings(ModelSettings):
    """``service.train_service`` of the ``local_torch`` service: the model's keys and the trainer's."""

    dtype: Literal["float32", "bfloat16", "auto"] = setting(  # no float16 here
        "float32", "compute precision; bfloat16 = bf16 autocast with float32 master weights, optimizer state, "
                   "log-softmax and loss; auto: bfloat16 on a GPU that computes it and on a CPU that computes it "
                   "natively (AVX512-BF16, AMX), else float32")
    lr: float = setting(1e-6, "AdamW learning rate", gt=0)
    weight_decay: float = setting(0.0, "AdamW weight decay", ge=0)
    betas: list[float] = setting([0.9, 0.999], "AdamW betas", check=_betas)
    eps: float = setting(1e-8, "AdamW epsilon", gt=0)
    grad_clip: float | None = setting(1.0, "gradient-norm clip (<= 0 or null: none)")
    seed: int | None = setting(None, "seed of torch, numpy and python RNGs (default: the recipe's seed)")
    micro_batch_size: int | None = setting(None, "rows per forward pass (null: the whole batch)", ge=1)
    packing: AutoFlag = setting(None, "packed sequences without padding: auto | true | false", check=_auto_flag)
    max_tokens_per_pack: int = setting(2048, "tokens per packed sequence (a longer group is split, its prompt "
                                             "repeated)", ge=1)
    activation_checkpointing: bool = setting(False, "keep only each layer's input for the backward and compute "
                                                    "the rest again there (packed or not): less activation "
                                                    "memory, about one more forward's compute per step")
    world_size: int = setting(1, "data-parallel ranks training this model, one process each (the first is the "
                                 "trainer's; on a GPU box rank r takes cuda:r); see parallel", ge=1)
    parallel: str = setting("auto", "how ranks share the model: fsdp (FSDP2: parameters, gradients and "
                                    "optimizer state sharded) | ddp (replicated: for models too small to "
                                    "shard) | auto (fsdp with several ranks, none with one); fsdp or ddp with "
                                    "world_size 1 runs one rank through the same code",
                            choices=("auto", *PARALLEL_MODES))
    offload_optimizer: bool = setting(False, "keep AdamW's state in host memory between steps (moved to the "
                                             "device for the step only): less device memory, a copy each way "
                                             "per step")
    lr_scheduler: Literal["constant", "linear", "cosine"] = setting(
        "constant", "how the learning rate moves over the run (transformers' schedulers): constant, linear (to 0 at "
                    "the last step) or cosine (to 0), each after the warm-up")
    warmup_steps: int = setting(0, "optimizer steps of linear warm-up from 0 to lr", ge=0)
    warmup_ratio: float = setting(0.0, "warm-up as a share of total_steps (instead of warmup_steps)", ge=0, le=1)
    total_steps: int | None = setting(None, "optimizer steps a decaying lr_scheduler spans (default: the run's "
                                            "trainer.total_train_steps)", ge=1)
    lora: LoraSettings | None = setting(None, "train LoRA adapters (peft) on the frozen base instead of every "
                                              "weight: {rank, alpha, dropout, target_modules, base_dtype}; the "
                                              "engine is sent the merged weights; null: full fine-tuning")
