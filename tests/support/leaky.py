"""A careless plugin for the secret tests (tests/core/test_secrets.py): an evaluator that quotes its
credentials everywhere a plugin could, so a run's outputs show whether nexrl hides them.

- ``api_key``: named like a secret, not declared one;
- ``passphrase``: declared ``Option(secret=True)`` (its name says nothing);
- ``note``: an ordinary option (a recipe may put an environment secret into it).

It logs them (INFO and DEBUG), puts them into the ground truth it returns, and raises an error
quoting them on every sample whose prompt is ``fail``.
"""

from __future__ import annotations

from typing import Any

from loguru import logger

from nexrl_core import EvaluationRunResult, Evaluator, Option, hookimpl


class LeakyEvaluator(Evaluator):
    OPTIONS = {
        "api_key": Option(None, str, "a credential, named like one"),
        "passphrase": Option(None, str, "a credential whose name does not say so", secret=True),
        "note": Option(None, str, "any text"),
    }

    def __init__(self, api_key: str | None = None, passphrase: str | None = None, note: str | None = None):
        self.quoted = " ".join(str(v) for v in (api_key, passphrase, note) if v)
        logger.info(f"leaky evaluator: configured with {self.quoted}")
        logger.debug(f"leaky evaluator: again, for run.log: {self.quoted}")

    def evaluate(self, data: dict[str, Any], evaluation_target: Any) -> EvaluationRunResult:
        if data.get("prompt") == "fail":
            raise RuntimeError(f"the judge refused the credentials {self.quoted}")
        return EvaluationRunResult(reward=1.0, ground_truth=f"judged with {self.quoted}", metrics={},
                                   extra_info={"credentials": self.quoted})


@hookimpl
def nexrl_evaluators():
    return {"leaky": LeakyEvaluator}
