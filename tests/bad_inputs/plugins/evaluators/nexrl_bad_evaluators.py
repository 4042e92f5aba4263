"""Evaluators that misbehave on rows flagged ``"misbehave": true`` (and score the others with
an exact match against ``answer``)."""

from nexrl_core import BaseEvaluationTarget, EvaluationRunResult, Evaluator, hookimpl


class _Base(Evaluator):
    def good(self, data, target: BaseEvaluationTarget) -> EvaluationRunResult:
        same = float(target.final_answer.strip() == str(data["answer"]))
        return EvaluationRunResult(reward=same, ground_truth=str(data["answer"]), metrics={"accuracy": same})


class WrongResultType(_Base):
    """Returns a plain dict instead of an EvaluationRunResult."""

    def evaluate(self, data, evaluation_target):
        if data.get("misbehave"):
            return {"reward": 1.0}
        return self.good(data, evaluation_target)


class RaisesOnSome(_Base):
    """Raises on the flagged rows."""

    def evaluate(self, data, evaluation_target):
        if data.get("misbehave"):
            raise ValueError(f"cannot score {data['prompt']!r}")
        return self.good(data, evaluation_target)


class NanReward(_Base):
    """Returns a NaN reward on the flagged rows."""

    def evaluate(self, data, evaluation_target):
        if data.get("misbehave"):
            return EvaluationRunResult(reward=float("nan"), ground_truth=str(data["answer"]))
        return self.good(data, evaluation_target)


class AlwaysRaises(_Base):
    """Raises on every row: a run with it trains on nothing."""

    def evaluate(self, data, evaluation_target):
        raise KeyError("expected_answer")


class TargetChars(Evaluator):
    """Options described only by an annotated constructor (no OPTIONS declared)."""

    def __init__(self, target_chars: int = 3, letter: str = "a"):
        self.target_chars = target_chars
        self.letter = letter

    def evaluate(self, data, evaluation_target):
        text = evaluation_target.final_answer
        return EvaluationRunResult(reward=float(text.count(self.letter) >= self.target_chars))


@hookimpl
def nexrl_evaluators():
    return {"wrong_result_type": WrongResultType, "raises_on_some": RaisesOnSome, "nan_reward": NanReward,
            "always_raises": AlwaysRaises, "target_chars": TargetChars}
