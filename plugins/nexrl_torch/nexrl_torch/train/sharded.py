"""Checkpoints of a train service whose model FSDP2 shards across ranks (safetensors and JSON only).

The folder stays what a one-process checkpoint is, an HF folder ``from_pretrained`` loads (the full
model gathered to rank 0 in ``model.safetensors``), plus the optimizer's state as every rank's
shards, written and read by torch.distributed.checkpoint through its safetensors storage
(``optimizer/``; ``optimizer.json`` holds the parameter groups). A checkpoint resumes on any
world size: torch.distributed.checkpoint reads the shards a new layout needs, and a one-process
checkpoint's ``optimizer.safetensors`` is spread over the shards. With LoRA the model file is the
merged model and the adapter sits in PEFT's format beside it, as in one process; a resume reads the
adapter only.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

OPTIMIZER_FOLDER = "optimizer"
TIED_HEAD = ("lm_head.weight", "model.embed_tokens.weight")  # saved once, as transformers does


def _flat(state: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {f"{name}.{key}": value for name, entries in state["state"].items() for key, value in entries.items()
            if torch.is_tensor(value)}


def _groups(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [{**group, "betas": tuple(group["betas"])} if "betas" in group else dict(group) for group in groups]


def save(service: Any, folder: Path) -> None:
    """Every rank: the model gathered to rank 0, the optimizer's shards (collectives)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict

    optimizer = get_optimizer_state_dict(service.model, service.optimizer)
    dcp.save(_flat(optimizer), storage_writer=dcp.HuggingFaceStorageWriter(path=str(folder / OPTIMIZER_FOLDER),
                                                                            save_distributed=True))
    if service.adapters is not None:
        _save_adapted(service, folder)
    else:
        _save_full(service, folder, get_model_state_dict(service.model, options=StateDictOptions(
            full_state_dict=True, cpu_offload=True)))
    if service.ranks.leader:
        (folder / "optimizer.json").write_text(json.dumps({"layout": "sharded", "param_groups": optimizer["param_groups"]},
                                                          indent=1, sort_keys=True))


def _save_full(service: Any, folder: Path, full: dict[str, torch.Tensor]) -> None:
    if not service.ranks.leader:
        return
    config = service.model.config
    config.save_pretrained(folder)
    if getattr(service.model, "generation_config", None) is not None:
        service.model.generation_config.save_pretrained(folder)
    tied = getattr(config, "tie_word_embeddings", False)
    save_file({k: v.contiguous() for k, v in full.items() if not (tied and k == TIED_HEAD[0])},
              str(folder / "model.safetensors"), metadata={"format": "pt"})


def _save_adapted(service: Any, folder: Path) -> None:
    """LoRA: the merged model (a from_pretrained folder) and the adapter in PEFT's format, each
    gathered tensor by tensor (collectives on every rank) and kept by rank 0 only."""
    from .distributed import GatheredWeights
    from .lora import ADAPTER_FOLDER, adapter_tensors, merged_state, save_adapter

    keep = service.ranks.leader
    merged = {k: v.cpu() for k, v in GatheredWeights(merged_state(service.model)).items() if keep}
    adapter = {k: v.cpu() for k, v in GatheredWeights(adapter_tensors(service.model)).items() if keep}
    if keep:
        if getattr(service.model.config, "tie_word_embeddings", False):
            merged.pop(TIED_HEAD[0], None)  # gathered copies no longer share storage: saved once, as transformers does
        service.model.save_pretrained(folder, state_dict=merged)
        save_adapter(service.adapters, folder / ADAPTER_FOLDER, adapter)


def load_model(service: Any, folder: Path) -> None:
    """Every rank reads the full weights and keeps its shard (with LoRA: the adapter's, onto the base
    from ``model_path``)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    from .lora import ADAPTER_FOLDER, check_checkpoint, read_adapter

    check_checkpoint(folder, service.adapters)
    if service.adapters is not None:
        set_model_state_dict(service.model, read_adapter(service.adapters, folder / ADAPTER_FOLDER),
                             options=StateDictOptions(full_state_dict=True, strict=False))
        return
    full = model_tensors(folder)
    head, embed = TIED_HEAD
    if getattr(service.model.config, "tie_word_embeddings", False) and head not in full and embed in full:
        full[head] = full[embed]
    set_model_state_dict(service.model, full, options=StateDictOptions(full_state_dict=True))


def load_optimizer(service: Any, folder: Path) -> None:
    """The optimizer state of ``folder`` into this service's layout, whichever wrote it."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_optimizer_state_dict,
        set_optimizer_state_dict,
    )

    meta = json.loads((folder / "optimizer.json").read_text())
    if (folder / OPTIMIZER_FOLDER).is_dir():
        target = get_optimizer_state_dict(service.model, service.optimizer)  # this layout, state initialised
        # One process reads every shard itself: without no_dist it would join whatever process group
        # lives in this process (another service's ranks) and wait there for ranks that never come.
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)  # that is the intent
            dcp.load(_flat(target), storage_reader=dcp.HuggingFaceStorageReader(path=str(folder / OPTIMIZER_FOLDER)),
                     no_dist=service.ranks is None)
        set_optimizer_state_dict(service.model, service.optimizer,
                                 {"state": target["state"], "param_groups": _groups(meta["param_groups"])})
        return
    # One process wrote it (optimizer.safetensors: state by parameter index): spread it over the shards.
    names = meta["param_names"]
    state: dict[str, dict[str, Any]] = {}
    for key, value in {**load_file(str(folder / "optimizer.safetensors")), **meta["scalar_state"]}.items():
        _, index, entry = key.split(".", 2)
        state.setdefault(names[int(index)], {})[entry] = value
    groups = [{**group, "params": [names[i] for i in group["params"]]} for group in _groups(meta["param_groups"])]
    set_optimizer_state_dict(service.model, service.optimizer, {"state": state, "param_groups": groups},
                             options=StateDictOptions(full_state_dict=True))


def model_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """Every tensor of an HF folder's safetensors files."""
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else ["model.safetensors"]
    tensors: dict[str, torch.Tensor] = {}
    for name in files:
        tensors.update(load_file(str(folder / name)))
    return tensors
