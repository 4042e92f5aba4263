"""Constants and datum builders shared by the Tinker tests."""

from __future__ import annotations

import numpy as np

from tests.support.letters import PROMPTS, letters_recipe

__all__ = ["API_KEY", "MODEL", "PROMPTS", "grpo_recipe", "metrics_rows", "sft_datum", "tinker_plugin_manager"]

API_KEY = "tml-test-0123456789"
MODEL = "tiny"


def sft_datum(tokenizer, text: str, prompt_len: int = 3):
    """A cross-entropy datum over ``text``: targets are the next tokens, the first ``prompt_len - 1`` unweighted."""
    from tinker import types

    ids = tokenizer(text).input_ids
    weights = np.ones(len(ids) - 1, dtype=np.float32)
    weights[:prompt_len - 1] = 0.0
    return types.Datum(model_input=types.ModelInput.from_ints(ids[:-1]),
                       loss_fn_inputs={"target_tokens": np.asarray(ids[1:], dtype=np.int64), "weights": weights})


def grpo_recipe(run_dir, url: str, tokenizer_path: str, *, steps: int, group: int, lr: float = 2e-2,
                workers: int = 4, **sections) -> dict:
    """A remote_api_grpo recipe on the tiny model behind the stand-in at ``url``, over the shared
    letter-share part (:func:`tests.support.letters.letters_recipe`). ``sections`` replace whole
    top-level sections."""
    connection = {"base_url": url, "api_key": API_KEY}
    recipe = letters_recipe(
        run_dir, group=group, workers=workers,
        trainer={"type": "remote_api_grpo", "total_train_steps": steps},
        algorithm={"type": "grpo", "loss_fn": "importance_sampling"},
        weight={"sync_mode": "sync", "backend": "tinker"},
        service={"train_service": {"backend": "tinker", "base_model": MODEL, "lora_rank": 8, "lr": lr, **connection},
                 "inference_service": {"backend": "tinker", "tokenizer_path": tokenizer_path, **connection}},
        runtime_monitor={"stop_timeout": 20, "health_check": {"check_interval": 0.5, "timeout": 20.0},
                         "exception_handling": {"check_interval": 0.05}})
    return {**recipe, **sections}


def tinker_plugin_manager():
    """The installed nexrl-tinker (through its entry point) + the in-process letter_share evaluator."""
    import pytest

    from nexrl_core.plugins import PluginManager
    from tests.support.letters import LetterPlugin

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-tinker")
        pm = PluginManager()
    assert "nexrl-tinker" in {r.distribution for r in pm.records.values()}, pm.failures
    pm.register(LetterPlugin(), name="letters", distribution="nexrl-letters (in-process)")
    return pm


def metrics_rows(run_dir) -> list[dict]:
    from tests.support.metrics import read_metrics

    return read_metrics(run_dir)
