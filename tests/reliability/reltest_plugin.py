"""Test-only nexrl plugin for the reliability suite.

Subprocess runs (``nexrl run``) load it through an entry point of a throw-away
distribution that ``conftest.plugin_env`` lays out in a temporary folder; in-process runs
register the module directly with ``PluginManager.register``.

- evaluator ``letter_share``: reward = share of the reply's characters among ``letters``
  (continuous, so GRPO groups of a random tiny model have non-zero advantages);
- trainer ``crash_on_save_grpo``: the GRPO trainer, killed by SIGKILL in the middle of
  writing the checkpoint of step ``crash_save_step`` (after the model files, before the
  checkpoint is complete).
"""

from __future__ import annotations

import functools
import os
import signal
from typing import Any

from nexrl_core import EvaluationRunResult, Evaluator, Option, hookimpl


class LetterShareEvaluator(Evaluator):
    def __init__(self, letters: str = "aeiou"):
        self.letters = set(letters)

    def evaluate(self, data: dict[str, Any], evaluation_target: Any) -> EvaluationRunResult:
        text = evaluation_target.final_answer
        share = sum(ch in self.letters for ch in text) / len(text) if text else 0.0
        return EvaluationRunResult(reward=share, ground_truth="", metrics={"share": share})


@hookimpl
def nexrl_evaluators():
    return {"letter_share": LetterShareEvaluator}


@functools.lru_cache(maxsize=None)
def _grpo_trainers() -> dict[str, type]:
    try:
        from nexrl_grpo.trainers import SelfHostedGrpoTrainer
    except ImportError:  # core-only environment
        return {}

    class CrashOnSaveGrpoTrainer(SelfHostedGrpoTrainer):
        OPTIONS = {"crash_save_step": Option(0, int)}

        def save_model_state(self, folder: str) -> None:
            super().save_model_state(folder)
            if self.global_step == int(self._config.get("crash_save_step", 0)):
                os.kill(os.getpid(), signal.SIGKILL)  # mid-save: model written, core state not yet

    return {"crash_on_save_grpo": CrashOnSaveGrpoTrainer}


@hookimpl
def nexrl_trainers():
    return dict(_grpo_trainers())
