"""The critic of value-based estimators (``algorithm.type: gae``): a value model trained alongside
the policy, in this process.

The value model is the policy's transformer (without its LM head) and a scalar head: ``V_t`` is
read at the position that predicts response token ``t`` (the state before it is emitted), the
position the actor's log-prob of that token comes from. It starts from the policy's initial
weights with a zero head (every value 0). :class:`CriticService` is a
:class:`~nexrl_torch.train.service.LocalTorchTrainService` whose per-token output is the value:
the same micro-batching, AdamW step and safetensors checkpoints.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from nexrl_core import Settings, setting
from nexrl_torch.logprobs import position_ids_from_mask
from nexrl_torch.models import DEVICE_HELP, device_problem
from nexrl_torch.train.service import LocalTorchTrainService

from .losses import LossAggMode


@dataclass(frozen=True, kw_only=True)
class CriticSettings(Settings):
    """``algorithm.critic``: the value model and its optimizer."""

    lr: float = setting(1e-5, "the critic's AdamW learning rate", gt=0)
    weight_decay: float = setting(0.0, "the critic's AdamW weight decay", ge=0)
    grad_clip: float = setting(1.0, "the critic's gradient-norm clip (<= 0: none)")
    value_clip: float | None = setting(0.5, "clip range of the new values around the old ones in the value loss "
                                            "(null: unclipped)", gt=0)
    loss_agg_mode: LossAggMode = setting("token-mean", "how the value loss's tokens reduce")
    micro_batch_size: int | None = setting(None, "rows per critic forward (null: service.train_service."
                                                 "micro_batch_size)", ge=1)
    device: str | None = setting(None, f"where the value model lives (null: the policy's device; {DEVICE_HELP})",
                                 check=device_problem)


@dataclass(frozen=True, kw_only=True)
class CriticAlgorithmSettings(Settings):
    """The ``algorithm.*`` keys the GRPO trainer reads when the estimator needs values (ALGORITHM_INPUTS)."""

    critic_warmup: int = setting(0, "the first N training steps update only the critic (the policy waits for a "
                                    "value function worth following)", ge=0)
    critic: CriticSettings = setting(CriticSettings, "the value model trained alongside the policy")


CRITIC_OPTIONS = CriticSettings.options()
CRITIC_ALGORITHM_OPTIONS = CriticAlgorithmSettings.options()


class ValueModel(torch.nn.Module):
    """A causal LM's transformer with a scalar value head."""

    def __init__(self, backbone: torch.nn.Module, hidden_size: int):
        super().__init__()
        self.backbone = backbone
        self.value_head = torch.nn.Linear(hidden_size, 1)
        # Zero head: every value starts at 0, so the first advantages are the plain returns.
        torch.nn.init.zeros_(self.value_head.weight)
        torch.nn.init.zeros_(self.value_head.bias)
        self.value_head.to(next(backbone.parameters()).dtype)

    @classmethod
    def from_causal_lm(cls, model: torch.nn.Module) -> ValueModel:
        """A copy of ``model``'s transformer (its current weights) under a fresh head."""
        backbone = copy.deepcopy(model.base_model)
        if backbone is model:
            raise ValueError(f"{type(model).__name__} exposes no transformer under an LM head (base_model)")
        backbone.requires_grad_(True).train()
        return cls(backbone, int(model.config.hidden_size))

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                response_length: int) -> torch.Tensor:
        """Values ``[B, response_length]`` (float32) of the states before each response token."""
        if response_length <= 0:
            return input_ids.new_zeros((input_ids.shape[0], 0), dtype=torch.float32)
        hidden = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                               use_cache=False).last_hidden_state
        # Position P - 1 + t has seen the prompt and response tokens < t.
        return self.value_head(hidden[:, -response_length - 1:-1]).squeeze(-1).float()

    def save_pretrained(self, folder: str | Path) -> None:
        """``model.safetensors`` (every tensor of the module) and the transformer's ``config.json``."""
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        save_file({k: v.detach().contiguous().cpu() for k, v in self.state_dict().items()},
                  str(folder / "model.safetensors"))
        config = getattr(self.backbone, "config", None)
        meta = config.to_dict() if config is not None else {}
        (folder / "config.json").write_text(json.dumps({**meta, "nexrl_value_model": True}, indent=1, default=str))


class CriticService(LocalTorchTrainService):
    """A :class:`ValueModel` and its AdamW optimizer: ``forward`` gives values ``[B, R]``,
    ``forward_backward(batch, loss_fn)`` hands each micro-batch's values to ``loss_fn``.

    Checkpoints hold the value model, the tokenizer and the optimizer (safetensors/JSON); the
    process's RNG state belongs to the policy's checkpoint and is not written twice.
    """

    def __init__(self, config: Mapping[str, Any], *, model: ValueModel, tokenizer: Any):
        # Padded forwards only (packing computes log-probs), and no reseeding of the process's RNGs.
        super().__init__({**config, "packing": False, "seed": None}, model=model, tokenizer=tokenizer)

    def _logprobs(self, mb: dict[str, Any], packs: int | None = None) -> torch.Tensor:
        """The critic's per-token output, where the policy's log-probs come from: its values (never
        packed, so ``packs`` is always None)."""
        attention_mask = mb["attention_mask"]
        position_ids = mb.get("position_ids")
        position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids
        return self.model(mb["input_ids"], attention_mask, position_ids, mb["responses"].shape[1])

    @staticmethod
    def _save_rng(folder: Path) -> None:
        pass

    @staticmethod
    def _load_rng(folder: Path) -> None:
        pass
