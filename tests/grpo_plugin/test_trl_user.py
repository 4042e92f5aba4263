"""What a TRL user brings trains with no adapter code: a data set saved with ``save_to_disk`` (its
own column names) and reward functions written for ``GRPOTrainer(reward_funcs=...)``, through
``nexrl run`` on the tiny model, with a cosine schedule and LoRA as a TRL user would set them."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from nexrl_core.cli import main
from tests.support.letters import tiny_grpo_recipe

datasets = pytest.importorskip("datasets")

REWARDS = textwrap.dedent('''
    def has_e(completions, **kwargs):
        return [float("e" in c) for c in completions]

    def matches_topic(prompts, completions, topic, **kwargs):
        return [float(t in c) for c, t in zip(completions, topic)]
''')


def test_a_saved_data_set_and_trl_reward_functions_train_through_nexrl_run(tiny_model_dir, tmp_path, capsys):
    datasets.Dataset.from_list([{"question": q, "topic": t} for q, t in
                                [("the quick", "fox"), ("what is", "it"), ("hello world", "hello"),
                                 ("count: one", "two")]]).save_to_disk(str(tmp_path / "my_data"))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    recipe = tiny_grpo_recipe(tmp_path / "run", tiny_model_dir, group=4, steps=2, workers=4)
    recipe["data"] = {"type": "huggingface", "path": "my_data", "prompt_column": "question"}
    recipe["rollout_worker"]["evaluator"] = {"type": "reward_funcs", "weights": [1.0, 2.0],
                                             "functions": ["my_rewards.py:has_e", "my_rewards.py:matches_topic"]}
    recipe["service"]["train_service"].update({"lr_scheduler": "cosine", "warmup_ratio": 0.5,
                                               "lora": {"rank": 4, "alpha": 8}})
    path = tmp_path / "recipe.yaml"  # data and rewards are found next to the recipe
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    assert main(["validate", str(path)]) == 0, capsys.readouterr().err
    assert main(["run", str(path)]) == 0, capsys.readouterr().err[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in steps] == [1, 2]
    assert all({"rollout/has_e", "rollout/matches_topic"} <= set(r) for r in steps)
    for r in steps:
        assert r["train/reward_mean"] == pytest.approx(r["rollout/has_e"] + 2.0 * r["rollout/matches_topic"])
    assert [r["train/lr"] for r in steps] == [0.0, pytest.approx(5e-2)]  # warm-up of ceil(0.5 * 2) = 1 step
