"""Entry point of nexrl-rewards: registers its evaluators like any third-party plugin."""

from __future__ import annotations

from nexrl_core import hookimpl

from .code_sandbox import CodeSandboxEvaluator
from .instruction_following import InstructionFollowingEvaluator
from .llm_judge import LLMJudgeEvaluator
from .math_rule import MathRuleEvaluator


@hookimpl
def nexrl_evaluators():
    return {"math_rule": MathRuleEvaluator, "code_sandbox": CodeSandboxEvaluator, "llm_judge": LLMJudgeEvaluator,
            "instruction_following": InstructionFollowingEvaluator}
