"""LoRA adapters on a frozen base, through ``peft``.

The train service keeps its model a plain transformers model: peft injects its adapter layers into
the model's linears in place (``get_peft_model``), so the packed forward, the log-prob convention
and the engine see the same module tree as without adapters. Only the adapters train. The frozen
base weights are float32 as the masters of a full fine-tune are, or bfloat16 (``base_dtype``) under
the service's bf16 autocast, at half their memory; the adapters stay float32 either way.

What leaves the service is always the merged model (each adapted weight ``W + alpha / rank * B A``,
under the plain names): the in-process engine loads it as it loads a full fine-tune's weights and
decodes at full speed, with no adapter work per token. A checkpoint holds both the merged model (a
``from_pretrained`` folder, as every checkpoint of this service) and the adapter in PEFT's own format
in :data:`ADAPTER_FOLDER` (``PeftModel.from_pretrained(base, folder / "adapter")`` loads it); a resume
reads the adapter only, onto the base from ``model_path``, so it is bit-exact.

With several ranks (``world_size``), DDP and FSDP2 see only the adapters as trainable, so only
their gradients cross ranks; under FSDP2 the merged weights and the adapter are gathered tensor by
tensor, and rank 0 alone sends or writes them.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from nexrl_core import Settings, setting

ADAPTER_FOLDER = "adapter"  # inside a checkpoint: PEFT's adapter_config.json + adapter_model.safetensors
ADAPTER_NAME = "default"  # peft's name of the one adapter a model gets without naming it
PEFT_PREFIX = "base_model.model."  # where the PeftModel wrapper holds the model, in its tensors' names

@dataclass(frozen=True, kw_only=True)
class LoraSettings(Settings):
    """``service.train_service.lora``."""

    rank: int = setting(16, "adapter rank r: each adapted weight W learns a B A of rank r", ge=1)
    alpha: float = setting(32.0, "the update is scaled by alpha / rank", gt=0)
    dropout: float = setting(0.0, "dropout on an adapter's input while training", ge=0, lt=1)
    target_modules: str | list[str] = setting("all-linear", "the linears that get adapters: all-linear (every "
                                                            "linear of the decoder, not the LM head) or a list of "
                                                            "module names (e.g. [q_proj, k_proj, v_proj, o_proj])")
    base_dtype: Literal["float32", "bfloat16"] = setting(
        "float32", "precision of the frozen base weights: bfloat16 halves their memory (its matmuls run in bf16 "
                   "under the service's bf16 autocast anyway); the adapters and their optimizer state stay float32",
        needs="service.train_service.dtype == bfloat16")


def add_adapters(model: torch.nn.Module, settings: LoraSettings) -> Any:
    """Inject LoRA adapters into ``model`` in place and freeze its base weights; returns the
    ``PeftModel`` wrapper (for saving and loading the adapter in PEFT's format)."""
    from peft import LoraConfig, get_peft_model

    targets = settings.target_modules
    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=targets if isinstance(targets, str) else list(targets),
                        bias="none", task_type="CAUSAL_LM")
    try:
        with warnings.catch_warnings():
            # peft asks transformers a deprecated question on every model (transformers 5.x warns)
            warnings.filterwarnings("ignore", message=r"`is_gradient_checkpointing` is deprecated",
                                    category=FutureWarning)
            wrapped = get_peft_model(model, config)
    except ValueError as exc:  # e.g. target modules the model does not have
        raise ValueError(f"lora.target_modules: {exc}") from None
    if wrapped.base_model.model is not model:
        raise ValueError("lora: peft did not adapt the model in place")
    if settings.base_dtype == "bfloat16":
        for parameter in model.parameters():
            if not parameter.requires_grad and parameter.is_floating_point():
                parameter.data = parameter.data.to(torch.bfloat16)
    return wrapped


def _adapted_layers(model: torch.nn.Module) -> dict[str, Any]:
    from peft.tuners.lora import LoraLayer

    return {name: module for name, module in model.named_modules() if isinstance(module, LoraLayer)}


def _plain_name(name: str) -> str:
    """A tensor's name in the model without adapters: peft moves a wrapped module under ``base_layer``
    (twice for a MoE's experts, whose two fused parameters are wrapped one inside the other)."""
    return name.replace(".base_layer", "")


def merged_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's tensors under their plain names, each adapted weight merged with its adapter:
    what a model without adapters would hold. Tensors without an adapter are the live ones
    (detached); merged ones are new tensors."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict().items():
        if ".lora_" not in name:  # the adapters' own factors are folded in below
            state[_plain_name(name)] = tensor.detach()
    with torch.no_grad():
        for owner, layer in _adapted_layers(model).items():
            # A linear's adapter is on its weight; one on a bare parameter names it (MoE experts).
            target = f"{_plain_name(owner)}.{getattr(layer, 'parameter_name', None) or 'weight'}"
            if target not in state:
                raise ValueError(f"lora: the adapter of {owner} targets {target}, which the model does not hold")
            base, delta = state[target], layer.get_delta_weight(ADAPTER_NAME)
            if delta.shape != base.shape:
                raise ValueError(f"lora: the adapter of {owner} gives a {tuple(delta.shape)} update for {target} "
                                 f"{tuple(base.shape)}")
            state[target] = base + delta.to(base.dtype)
    return state


def adapter_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The adapters' own tensors under the model's names (live, detached; an FSDP2 model's are shards)."""
    return {name: tensor.detach() for name, tensor in model.state_dict().items() if ".lora_" in name}


def _saved_names(wrapped: Any, tensors: dict[str, torch.Tensor]) -> dict[str, str]:
    """PEFT's name in ``adapter_model.safetensors`` of each adapter tensor (model name -> saved name),
    asked of peft itself so the two directions cannot drift apart."""
    from peft import get_peft_model_state_dict

    by_identity = {id(tensor): name for name, tensor in tensors.items()}
    saved = get_peft_model_state_dict(wrapped, state_dict={f"{PEFT_PREFIX}{k}": v for k, v in tensors.items()},
                                      adapter_name=ADAPTER_NAME)
    names = {key: by_identity.get(id(tensor)) for key, tensor in saved.items()}
    if None in names.values():  # this peft copies the tensors it is given: names cannot be matched this way
        raise RuntimeError("lora: this peft version's adapter names cannot be matched to the model's (FSDP2 needs it)")
    return {name: key for key, name in names.items() if name is not None}


def save_adapter(wrapped: Any, folder: Path, tensors: dict[str, torch.Tensor] | None = None) -> None:
    """The adapter in PEFT's format: ``folder/adapter_config.json`` and ``adapter_model.safetensors``;
    ``tensors`` (the adapter's whole tensors by model name) stand in for the model's own, which an
    FSDP2 model holds as shards."""
    state = None if tensors is None else {f"{PEFT_PREFIX}{k}": v.contiguous() for k, v in tensors.items()}
    wrapped.save_pretrained(str(folder), safe_serialization=True, **({} if state is None else {"state_dict": state}))


def read_adapter(wrapped: Any, folder: Path) -> dict[str, torch.Tensor]:
    """The whole tensors of an adapter :func:`save_adapter` wrote, by the model's names (for a model
    whose own tensors are shards: each rank keeps its part)."""
    from safetensors.torch import load_file

    saved = load_file(str(_adapter_file(folder)))
    names = {key: name for name, key in _saved_names(wrapped, adapter_tensors(wrapped.base_model.model)).items()}
    unexpected, missing = sorted(set(saved) - set(names)), sorted(set(names) - set(saved))
    if unexpected or missing:
        raise ValueError(f"{folder}: the adapter does not fit this model's lora settings (unexpected "
                         f"{unexpected[:3]}, missing {missing[:3]})")
    return {names[key]: tensor for key, tensor in saved.items()}


def _adapter_file(folder: Path) -> Path:
    weights = folder / "adapter_model.safetensors"
    if not weights.is_file():
        raise ValueError(f"{folder}: no adapter_model.safetensors (not an adapter this service saved)")
    return weights


def check_checkpoint(folder: Path, adapters: Any) -> None:
    """A checkpoint's adapter and the service's lora settings agree: both or neither."""
    has_adapter = (folder / ADAPTER_FOLDER).is_dir()
    if adapters is None and has_adapter:
        raise ValueError(f"{folder}: the checkpoint holds a LoRA adapter; resume with the "
                         f"service.train_service.lora it was trained with")
    if adapters is not None and not has_adapter:
        raise ValueError(f"{folder}: the checkpoint holds no LoRA adapter (a full fine-tune); resume "
                         f"without service.train_service.lora, or start a fresh run")


def load_adapter(wrapped: Any, folder: Path) -> None:
    """Load an adapter :func:`save_adapter` wrote into ``wrapped``'s adapter, exactly."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    result = set_peft_model_state_dict(wrapped, load_file(str(_adapter_file(folder))), adapter_name=ADAPTER_NAME)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    missing = [k for k in getattr(result, "missing_keys", []) or [] if "lora_" in k]
    if unexpected or missing:
        raise ValueError(f"{folder}: the adapter does not fit this model's lora settings (unexpected "
                         f"{unexpected[:3]}, missing {missing[:3]})")
