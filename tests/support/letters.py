"""A dense toy reward for tiny-model GRPO tests, packaged like a third-party evaluator plugin."""

import pytest

from nexrl_core import EvaluationRunResult, Evaluator, hookimpl
from nexrl_core.plugins import PluginManager
from nexrl_core.testing import make_recipe

PROMPTS = ["the quick", "what is", "count: one", "hello world"]


class LetterShareEvaluator(Evaluator):
    """Reward = share of ``letter`` among the reply's characters (dense, so groups are rarely flat)."""

    def __init__(self, letter: str = "e"):
        self.letter = letter

    def evaluate(self, data, evaluation_target) -> EvaluationRunResult:
        text = evaluation_target.final_answer
        share = sum(ch == self.letter for ch in text) / max(len(text), 1)
        return EvaluationRunResult(reward=share, ground_truth=self.letter, metrics={"letter_share": share})


class LetterPlugin:
    """What a third-party evaluator package's entry-point module would hold."""

    @hookimpl
    def nexrl_evaluators(self):
        return {"letter_share": LetterShareEvaluator}


def grpo_plugin_manager() -> PluginManager:
    """The installed nexrl-grpo and nexrl-torch (through their entry points, nothing else) + the in-process evaluator."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
        pm = PluginManager()
    assert {"nexrl-grpo", "nexrl-torch"} <= {r.distribution for r in pm.records.values()}, pm.failures
    pm.register(LetterPlugin(), name="letters", distribution="nexrl-letters (in-process)")
    return pm


def letters_recipe(run_dir, *, group: int, workers: int = 4, seed: int = 42, **sections) -> dict:
    """A tiny-model recipe's shared part: every prompt of :data:`PROMPTS` once per step (one batch of
    ``len(PROMPTS)`` groups of ``group``), up to 6 tokens a reply, rewarded by the share of the letter
    'e' in it; a quiet logger. ``sections`` (trainer, service, weight, ...) merge in as
    :func:`nexrl_core.testing.make_recipe` merges them."""
    return make_recipe(None, run_dir=str(run_dir), seed=seed, logger={"backend": [], "level": "WARNING"},
                       data={"type": "inline", "rows": [{"prompt": p} for p in PROMPTS]},
                       rollout_worker={"num_workers": workers, "sampling": {"max_tokens": 6, "temperature": 1.0},
                                       "evaluator": {"type": "letter_share", "letter": "e"}},
                       trajectory_pool={"batch_size": len(PROMPTS) * group, "group_size": group,
                                        "key_list": ["uid"]},
                       **sections)


def tiny_grpo_recipe(run_dir, model_dir: str, *, group: int, steps: int, workers: int = 8, seed: int = 42,
                     lr: float = 5e-2, **sections) -> dict:
    """:func:`letters_recipe` trained by the self-hosted GRPO trainer on the tiny model at ``model_dir``
    (the HF engine, weights pushed in process, one torch thread each); ``sections`` merge in."""
    base = letters_recipe(
        run_dir, group=group, workers=workers, seed=seed,
        trainer={"type": "self_hosted_grpo", "total_train_steps": steps},
        weight={"sync_mode": "sync", "backend": "in_process"},
        service={"train_service": {"model_path": model_dir, "lr": lr, "grad_clip": 1.0, "num_threads": 1},
                 "inference_service": {"backend": "hf", "model_path": model_dir, "num_threads": 1}},
        runtime_monitor={"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 10.0},
                         "exception_handling": {"check_interval": 0.05}})
    return make_recipe(base, **sections)
