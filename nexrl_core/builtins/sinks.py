"""Built-in experiment loggers: the console and Weights & Biases."""

from __future__ import annotations

import os
from typing import Any

from loguru import logger

from ..errors import ConfigError
from ..markers import hookimpl
from ..options import Option


class ConsoleSink:
    def __init__(self, config: Any, run_dir: str):
        pass

    def log(self, metrics: dict[str, Any], step: int) -> None:
        shown = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in sorted(metrics.items())
                          if k.startswith(("train/reward", "val/", "timing/step", "train/loss", "train/num")))
        logger.info(f"step {step}: {shown}")

    def close(self) -> None:
        pass


class WandbSink:
    """Weights & Biases (options under ``logger.wandb``); offline when no API key is configured."""

    OPTIONS = {
        "project": Option(None, str, "W&B project (default: project_name)"),
        "entity": Option(None, str, "W&B team or user"),
        "mode": Option(None, str, "online | offline | disabled (default: online when WANDB_API_KEY is set)",
                       choices=("online", "offline", "disabled")),
        "tags": Option([], list[str], "tags of the W&B run"),
    }

    def __init__(self, config: Any, run_dir: str):
        try:
            import wandb
        except ImportError:
            raise ConfigError("logger.backend: 'wandb' needs the wandb package (pip install wandb)") from None
        own = (config.get("logger", {}) or {}).get("wandb", {}) or {}
        mode = own.get("mode") or ("online" if os.environ.get("WANDB_API_KEY") else "offline")
        self._run = wandb.init(project=str(own.get("project") or config.get("project_name", "nexrl")),
                               entity=own.get("entity"), tags=list(own.get("tags") or []),
                               name=str(config.get("experiment_name", "run")), dir=run_dir, mode=mode,
                               config=_plain(config))

    def log(self, metrics: dict[str, Any], step: int) -> None:
        self._run.log(metrics, step=step)

    def close(self) -> None:
        self._run.finish()


def _plain(config: Any) -> Any:
    try:
        from omegaconf import OmegaConf

        return OmegaConf.to_container(config, resolve=True)
    except Exception:
        return {}


@hookimpl
def nexrl_metrics_sinks():
    return {"console": ConsoleSink, "wandb": WandbSink}
