"""TRL-style reward functions (``evaluator.type: reward_funcs``): functions written for TRL's
``GRPOTrainer(reward_funcs=...)`` score a real run unchanged, with a helper module imported from
beside their file; the reward is the weighted sum; each function's score is its own metric; a
function that cannot be called as TRL calls one is one line from validate and run."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from nexrl_core.builtins.python_reward import RewardFunctionsEvaluator
from nexrl_core.cli import main
from nexrl_core.evaluation import BaseEvaluationTarget
from nexrl_core.testing import make_recipe

# What a TRL user already has: reward functions over lists, dataset columns as keyword arguments.
REWARDS = textwrap.dedent('''
    import re

    from reward_helpers import last_number   # a module beside this file


    def accuracy_reward(completions, answer, **kwargs):
        return [1.0 if last_number(c) == int(a) else 0.0 for c, a in zip(completions, answer)]


    def length_penalty(prompts, completions, **kwargs):
        return [-0.01 * len(c) for c in completions]


    def only_even(completions, answer, **kwargs):
        return [None if int(a) % 2 else 1.0 for a in answer]


    def chat_format(completions, **kwargs):
        return [float(c[0]["role"] == "assistant" and bool(c[0]["content"])) for c in completions]


    def no_completions(prompts, answer):
        return [0.0]


    def two_scores(completions, **kwargs):
        return [1.0, 2.0]
''')
HELPERS = "import re\n\ndef last_number(text):\n    found = re.findall(r'-?[0-9]+', text)\n    return int(found[-1]) if found else None\n"


@pytest.fixture
def reward_dir(tmp_path):
    (tmp_path / "rewards.py").write_text(REWARDS)
    (tmp_path / "reward_helpers.py").write_text(HELPERS)
    return tmp_path


def _recipe(evaluator, steps=2):
    return make_recipe(rollout_worker={"evaluator": evaluator}, trainer={"total_train_steps": steps},
                       service={"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 3}})


def test_trl_reward_functions_score_a_real_run_with_weights_and_a_metric_each(reward_dir, run_local):
    evaluator = {"type": "reward_funcs", "weights": [1.0, 0.5],
                 "functions": [f"{reward_dir}/rewards.py:accuracy_reward", f"{reward_dir}/rewards.py:length_penalty"]}
    controller, summary = run_local(_recipe(evaluator, steps=3))
    assert summary.stopped_by == "finished" and summary.global_step == 3
    trajectories = [t for batch in controller.trainer.batches for t in batch]
    for t in trajectories:
        correct = float(int(t["response"]) == int(t["task"]["answer"]))  # the mock answers a bare number
        penalty = -0.01 * len(t["response"])
        assert t["score"]["accuracy_reward"] == correct and t["score"]["length_penalty"] == pytest.approx(penalty)
        assert t["reward"] == pytest.approx(correct + 0.5 * penalty)
    assert {t["score"]["accuracy_reward"] for t in trajectories} == {0.0, 1.0}  # the mock learns
    rows = [json.loads(line) for line in (reward_dir / "run" / "metrics.jsonl").read_text().splitlines()]
    names = {k for r in rows for k in r}
    assert {"rollout/accuracy_reward", "rollout/length_penalty"} <= names, names  # each function's mean score


def test_none_skips_a_function_and_a_chat_prompt_gets_a_chat_completion(reward_dir):
    evaluator = RewardFunctionsEvaluator(functions=[f"{reward_dir}/rewards.py:only_even", f"{reward_dir}/rewards.py:accuracy_reward"])
    odd = evaluator.evaluate({"prompt": "1 + 2", "answer": "3"}, BaseEvaluationTarget("3"))
    assert odd.reward == 1.0 and odd.metrics == {"accuracy_reward": 1.0}  # only_even said None
    even = evaluator.evaluate({"prompt": "1 + 3", "answer": "4"}, BaseEvaluationTarget("5"))
    assert even.reward == 1.0 and even.metrics == {"only_even": 1.0, "accuracy_reward": 0.0}
    chat = RewardFunctionsEvaluator(functions=[f"{reward_dir}/rewards.py:chat_format"])
    assert chat.evaluate({"prompt": [{"role": "user", "content": "hi"}]}, BaseEvaluationTarget("hello")).reward == 1.0
    with pytest.raises(ValueError, match="every reward function returned None"):
        RewardFunctionsEvaluator(functions=[f"{reward_dir}/rewards.py:only_even"]).evaluate(
            {"prompt": "1", "answer": "1"}, BaseEvaluationTarget("1"))
    with pytest.raises(TypeError, match=r"reward function accuracy_reward of .*rewards.py: .*'answer'.* \(it is called "
                                        r"with prompts, completions and the data row's columns: none\)"):
        RewardFunctionsEvaluator(functions=[f"{reward_dir}/rewards.py:accuracy_reward"]).evaluate(
            {"prompt": "1"}, BaseEvaluationTarget("1"))
    with pytest.raises(TypeError, match=r"returned \[1.0, 2.0\]; expected a list with one score per completion"):
        RewardFunctionsEvaluator(functions=[f"{reward_dir}/rewards.py:two_scores"]).evaluate(
            {"prompt": "1"}, BaseEvaluationTarget("1"))


@pytest.mark.parametrize("functions,weights,line", [
    (["rewards.py:no_completions"], None,
     "rollout_worker.evaluator.functions[0]: no_completions(prompts, answer) in {d}/rewards.py takes no 'completions' "
     "(TRL's reward functions are name(prompts, completions, **kwargs))"),
    (["rewards.py:missing"], None, "rollout_worker.evaluator.functions[0]: {d}/rewards.py defines no function 'missing'"),
    (["rewards.py"], None, "rollout_worker.evaluator.functions[0]: '{d}/rewards.py' is not 'file.py:name'"),
    (["nowhere.py:f"], None,
     "rollout_worker.evaluator.functions[0]: 'nowhere.py' is not found (a Python file that defines f())"),
    (["rewards.py:accuracy_reward", "rewards.py:length_penalty"], [1.0],
     "rollout_worker.evaluator.weights: 1 weights for 2 functions"),
])
def test_a_bad_reward_function_is_one_line_from_validate_and_run(functions, weights, line, reward_dir, core_pm,
                                                                 capfd, monkeypatch):
    recipe = make_recipe(_recipe({"type": "reward_funcs", "functions": functions, "weights": weights}),
                         run_dir=str(reward_dir / "run"))
    path = reward_dir / "recipe.yaml"  # relative file names are looked up next to the recipe
    path.write_text(yaml.safe_dump(recipe))
    monkeypatch.chdir(reward_dir.parent)
    for command in ("validate", "run"):
        assert main([command, str(path)]) == 2
        err = capfd.readouterr().err
        assert f"error: {line.format(d=reward_dir)}" in err.splitlines(), err
        assert "Traceback" not in err


BATCHED = textwrap.dedent('''
    import json
    import os

    CALLS = os.path.join(os.path.dirname(__file__), "calls.jsonl")


    def accuracy_logged(completions, answer, **kwargs):
        with open(CALLS, "a") as f:
            f.write(json.dumps(len(completions)) + "\\n")
        return [float(c.strip() == str(a)) for c, a in zip(completions, answer)]


    def fails_on_seven(completions, answer, **kwargs):
        if "7" in [str(a) for a in answer]:
            raise RuntimeError("cannot score 7")
        return [1.0 for _ in completions]
''')


def _calls(folder):
    path = folder / "calls.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def test_a_worker_that_takes_several_tasks_calls_each_function_once_for_them(tmp_path, run_local):
    """tasks_per_call: 4 makes one call with lists of 4 (TRL's batch); the rewards are those of
    per-sample calls (tasks_per_call: 1, lists of 1)."""
    rewards = {}
    for per_call in (1, 4):
        folder = tmp_path / f"per_call_{per_call}"
        folder.mkdir()
        (folder / "rewards.py").write_text(BATCHED)
        recipe = make_recipe(rollout_worker={"num_workers": 1, "tasks_per_call": per_call, "evaluator": {
            "type": "reward_funcs", "functions": [f"{folder}/rewards.py:accuracy_logged"]}},
            trainer={"total_train_steps": 2}, run_dir=str(folder / "run"),
            service={"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 3}})
        controller, summary = run_local(recipe)
        assert summary.global_step == 2
        trained = [t for batch in controller.trainer.batches for t in batch]
        rewards[per_call] = sorted((t["uid"], t["sample_index"], t["response"], t["reward"]) for t in trained)
        assert set(_calls(folder)) == {per_call}, _calls(folder)
    assert rewards[1] == rewards[4]
    assert {r[-1] for r in rewards[4]} == {0.0, 1.0}


def test_in_a_batch_only_the_samples_a_function_fails_on_fail(tmp_path):
    (tmp_path / "rewards.py").write_text(BATCHED)
    evaluator = RewardFunctionsEvaluator(functions=[f"{tmp_path}/rewards.py:fails_on_seven"])
    items = [({"prompt": f"{a} + 0", "answer": str(a)}, BaseEvaluationTarget(str(a))) for a in (5, 7, 9)]
    results = evaluator.evaluate_many(items)
    assert [r.reward for r in (results[0], results[2])] == [1.0, 1.0]
    assert isinstance(results[1], RuntimeError) and str(results[1]) == "cannot score 7"
