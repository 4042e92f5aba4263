"""``rollout_worker.evaluator.type: python``: a reward from a plain function in a file (issue 18,
item 8), or from an Evaluator class in a file (``class``: what NexRL's evaluator_module_path
migrates to, issue 30). The function's answers become the trajectories' rewards and metrics in a real run;
every problem with the file or the function is one line from ``validate`` and ``run`` alike;
an exception inside it points at the user's file and line."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from nexrl_core.builtins.python_reward import as_result
from nexrl_core.cli import main
from nexrl_core.evaluation import EvaluationRunResult
from nexrl_core.testing import make_recipe

REWARD = textwrap.dedent('''
    import re

    CALLS = []


    def score(response, data, bonus=0.0):
        """1 when the reply's last number is the answer, plus a bonus for a bare number."""
        numbers = re.findall(r"-?[0-9]+", response)
        correct = bool(numbers) and int(numbers[-1]) == int(data["answer"])
        return {"reward": float(correct) + (bonus if response.strip().isdigit() else 0.0),
                "correct": correct, "chars": len(response), "parsed": numbers[-1] if numbers else None}


    def flaky(response, data):
        if int(data["answer"]) % 2:
            raise ValueError("odd answers are not supported yet")
        return True


    from nexrl_core import Evaluator, EvaluationRunResult


    class SumEvaluator(Evaluator):
        """The seed's evaluator shape: evaluate(data, evaluation_target)."""

        def __init__(self, scale=1.0):
            self.scale = scale

        def evaluate(self, data, evaluation_target):
            correct = evaluation_target.final_answer.strip() == str(data["answer"])
            return EvaluationRunResult(reward=self.scale * correct, ground_truth=str(data["answer"]),
                                       metrics={"exact": float(correct)})


    class Half(Evaluator):
        pass


    class NoEvaluate:
        pass


    LIMIT = 3
''')


def _recipe(tmp_path, evaluator, steps=2):
    return make_recipe(rollout_worker={"evaluator": evaluator}, trainer={"total_train_steps": steps},
                       service={"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 3}})


@pytest.fixture
def reward_file(tmp_path):
    path = tmp_path / "my_reward.py"
    path.write_text(REWARD)
    return path


def test_the_function_scores_every_sample_of_a_real_run(tmp_path, reward_file, run_local):
    evaluator = {"type": "python", "path": str(reward_file), "function": "score", "kwargs": {"bonus": 0.25}}
    controller, summary = run_local(_recipe(tmp_path, evaluator, steps=3))
    assert summary.stopped_by == "finished" and summary.global_step == 3
    trajectories = [t for batch in controller.trainer.batches for t in batch]
    assert len(trajectories) == 12
    for t in trajectories:
        response, answer = t["response"], int(t["task"]["answer"])
        correct = int(response) == answer  # the mock answers a bare number
        assert t["reward"] == float(correct) + 0.25  # kwargs reached the function
        assert t["score"] == {"reward": t["reward"], "correct": float(correct), "chars": float(len(response))}
        assert t["extra_info"] == {"parsed": response}
    assert {t["reward"] for t in trajectories} == {0.25, 1.25}  # the mock learns: both outcomes occur
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    means = [r["train/reward_mean"] for r in rows if "train/reward_mean" in r]
    assert means == [pytest.approx(sum(t["reward"] for t in b) / len(b)) for b in controller.trainer.batches]


def test_an_evaluator_class_scores_every_sample_of_a_real_run(tmp_path, reward_file, run_local):
    evaluator = {"type": "python", "path": str(reward_file), "class": "SumEvaluator", "kwargs": {"scale": 2.0}}
    controller, summary = run_local(_recipe(tmp_path, evaluator, steps=3))
    assert summary.stopped_by == "finished" and summary.global_step == 3
    trajectories = [t for batch in controller.trainer.batches for t in batch]
    for t in trajectories:
        correct = t["response"].strip() == str(t["task"]["answer"])
        assert t["reward"] == 2.0 * correct  # kwargs reached the constructor
        assert t["score"] == {"reward": t["reward"], "exact": float(correct)}
    assert {t["reward"] for t in trajectories} == {0.0, 2.0}


def test_an_exception_in_the_function_fails_the_sample_and_points_at_its_line(tmp_path, reward_file, run_local):
    evaluator = {"type": "python", "path": str(reward_file), "function": "flaky"}
    recipe = _recipe(tmp_path, evaluator)
    recipe["runtime_monitor"] = {"failed_samples": {"enabled": False}}
    controller, summary = run_local(recipe)
    assert summary.stopped_by == "finished"
    errors = [json.loads(line) for line in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()]
    assert errors and all(int(e["item"]["answer"]) % 2 == 1 for e in errors)
    assert all(t["reward"] == 1.0 for b in controller.trainer.batches for t in b)  # True -> 1.0
    message = errors[0]["message"]
    assert message.startswith("evaluator 'python' (nexrl-core) raised ValueError: odd answers are not supported yet")
    assert message.endswith(f"({reward_file}:17 in flaky)")
    assert errors[0]["response"].lstrip("-").isdigit()


def test_what_the_function_may_return():
    assert as_result(True, "f").reward == 1.0 and as_result(0, "f").reward == 0.0
    assert as_result(0.5, "f") == EvaluationRunResult(reward=0.5)
    given = EvaluationRunResult(reward=2.0, metrics={"a": 1.0})
    assert as_result(given, "f") is given
    result = as_result({"reward": 1, "ground_truth": "4", "ok": True, "note": "fine"}, "f")
    assert result == EvaluationRunResult(reward=1.0, ground_truth="4", metrics={"ok": 1.0}, extra_info={"note": "fine"})
    with pytest.raises(TypeError, match=r"f returned a dict without 'reward' \(keys: score\)"):
        as_result({"score": 1.0}, "f")
    with pytest.raises(TypeError, match="f returned list; expected a number"):
        as_result([1.0], "f")
    with pytest.raises(TypeError, match="f returned reward 'high', not a number"):
        as_result({"reward": "high"}, "f")


BAD = {  # evaluator mapping (paths relative to the recipe in tmp_path; an existing one is resolved) -> the one error line
    "missing": ({"path": "nope.py"}, "rollout_worker.evaluator.path: 'nope.py' is not found (a Python file that "
                                     "defines score())"),
    "folder": ({"path": "."}, "rollout_worker.evaluator.path: '{tmp}' is a folder (a Python file that "
                                        "defines score())"),
    "no_function": ({"path": "my_reward.py", "function": "scroe"},
                    "rollout_worker.evaluator.function: {tmp}/my_reward.py defines no 'scroe' (functions in it: flaky, "
                    "score)"),
    "kwargs": ({"path": "my_reward.py", "function": "flaky", "kwargs": {"bonus": 1}},
               "rollout_worker.evaluator.function: flaky(response, data) in {tmp}/my_reward.py cannot be called "
               "as flaky(response, data, bonus=...): got an unexpected keyword argument 'bonus'"),
    "syntax": ({"path": "broken.py"}, "{tmp}/broken.py:3: invalid syntax (the file of rollout_worker.evaluator.path)"),
    "import_raises": ({"path": "raises.py"}, "rollout_worker.evaluator.path: importing {tmp}/raises.py raised "
                                             "ModuleNotFoundError: No module named 'not_installed_anywhere' "
                                             "(raises.py:1 in <module>)"),
    "typo": ({"path": "my_reward.py", "fucntion": "score"},
             "rollout_worker.evaluator.fucntion: unknown key; did you mean 'rollout_worker.evaluator.function'? "
             "(evaluator 'python' accepts: path, function, class, kwargs)"),
    "no_path": ({}, "rollout_worker.evaluator.path: required (Python file that defines the reward function)"),
    "no_class": ({"path": "my_reward.py", "class": "SumEvaluatr"},
                 "rollout_worker.evaluator.class: {tmp}/my_reward.py defines no 'SumEvaluatr' (classes in it: "
                 "Half, NoEvaluate, SumEvaluator)"),
    "not_a_class": ({"path": "my_reward.py", "class": "LIMIT"},
                    "rollout_worker.evaluator.class: {tmp}/my_reward.py has a int, not a class, named 'LIMIT' "
                    "(classes in it: Half, NoEvaluate, SumEvaluator)"),
    "no_evaluate": ({"path": "my_reward.py", "class": "NoEvaluate"},
                    "rollout_worker.evaluator.class: NoEvaluate in {tmp}/my_reward.py has no evaluate(data, "
                    "evaluation_target) method (subclass nexrl_core.Evaluator)"),
    "abstract": ({"path": "my_reward.py", "class": "Half"},
                 "rollout_worker.evaluator.class: Half in {tmp}/my_reward.py leaves abstract methods "
                 "unimplemented: evaluate"),
    "class_kwargs": ({"path": "my_reward.py", "class": "SumEvaluator", "kwargs": {"bonus": 1}},
                     "rollout_worker.evaluator.kwargs: SumEvaluator(scale=1.0) in {tmp}/my_reward.py cannot be "
                     "built as SumEvaluator(bonus=...): got an unexpected keyword argument 'bonus'"),
    "function_and_class": ({"path": "my_reward.py", "function": "shaped", "class": "SumEvaluator"},
                           "rollout_worker.evaluator: give function or class, not both"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_a_bad_function_is_one_line_from_validate_and_run(case, tmp_path, reward_file, core_pm, capfd, monkeypatch,
                                                         reset_loguru):
    (tmp_path / "broken.py").write_text("def score(response, data):\n    return 1\ndef (:\n")
    (tmp_path / "raises.py").write_text("import not_installed_anywhere\n")
    monkeypatch.chdir(tmp_path)
    evaluator, expected = BAD[case]
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({"run_dir": str(tmp_path / "run"),
                                      **_recipe(tmp_path, {"type": "python", **evaluator})}))
    for command in ("validate", "run"):
        code = main([command, str(recipe)])
        err = capfd.readouterr().err
        lines = [line for line in err.splitlines() if line.startswith("error: ")]
        assert code == 2 and lines == ["error: " + expected.format(tmp=tmp_path)], err
        assert "Traceback" not in err
    assert not (tmp_path / "run").exists()
