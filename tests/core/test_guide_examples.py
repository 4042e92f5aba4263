"""The seed developer guide's extension examples, rewritten as the migration page says (imports from
nexrl_core), run here: a worker that hands on a plain dict, the guide's evaluator, and a worker
and a trainer class loaded from a file next to the recipe (``type: python``)."""

from __future__ import annotations

import json
import textwrap

import pytest
import yaml

from nexrl_core.cli import main
from nexrl_core.trajectory_keys import trajectory_problem

# Modeled on the guide's "Simple Worker Example": a plain dict, no uid, no sampling record, no reward.
WORKER = textwrap.dedent('''
    from typing import Any

    from nexrl_core import BaseRolloutWorker


    class MyRolloutWorker(BaseRolloutWorker):
        def step(self, task: dict[str, Any]) -> str | None:
            if "prompt" not in task:
                return None
            answer = self._llm_client.completion(task["prompt"], temperature=0.7)
            return self._put_trajectory({
                "prompt": task["prompt"],
                "response": answer["response"],
                "finish_reason": answer["finish_reason"],
                "custom_metadata": task.get("metadata", {}),
                "model_tag": self._llm_client._model_tag,
            })


    class NotAWorker:
        pass


    class Unfinished(BaseRolloutWorker):
        pass
''')

# Modeled on the guide's "Custom Evaluator Implementation".
EVALUATOR = textwrap.dedent('''
    from typing import Any

    from nexrl_core import BaseEvaluationTarget, EvaluationRunResult, Evaluator


    class MyTaskEvaluator(Evaluator):
        def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
            answer = evaluation_target.final_answer
            truth = data.get("ground_truth", "")
            reward = 1.0 if answer.strip() == truth.strip() else 0.0
            return EvaluationRunResult(reward=reward, ground_truth=truth,
                                       metrics={"answer_length": float(len(answer)), "exact_match": reward},
                                       extra_info={"agent_answer": answer, "parsed_output": self._parse(answer)})

        def _parse(self, answer: str) -> dict:
            return {"parsed": answer}
''')

TRAINER = textwrap.dedent('''
    from nexrl_core import BaseTrainer


    class CountingTrainer(BaseTrainer):
        NO_MODEL_STATE = True

        def __init__(self, config):
            super().__init__(config)
            self.batches = []

        def train(self, trajectories):
            self.batches.append(trajectories)
            return {"custom/batch": float(len(trajectories))}
''')


@pytest.fixture
def guide_files(tmp_path):
    (tmp_path / "my_worker.py").write_text(WORKER)
    (tmp_path / "evaluator.py").write_text(EVALUATOR)
    (tmp_path / "my_trainer.py").write_text(TRAINER)
    rows = [{"prompt": f"{a} + {b}", "ground_truth": str(a + b), "metadata": {"row": a}} for a in range(8)
            for b in (1,)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def _recipe(worker=None, trainer=None, steps=3):
    return {
        "data": {"type": "file", "path": "train.jsonl"},
        "rollout_worker": {"num_workers": 2, **(worker or {"type": "python", "path": "my_worker.py",
                                                            "class": "MyRolloutWorker"}),
                           "evaluator": {"type": "python", "path": "evaluator.py", "class": "MyTaskEvaluator"}},
        "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 2}},
        "trainer": {"type": "mock", "total_train_steps": steps, **(trainer or {})},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
    }


def test_the_guides_worker_handing_on_a_plain_dict_trains(guide_files, run_local):
    controller, summary = run_local(_recipe())
    assert summary.stopped_by == "finished" and summary.global_step == 3
    trajectories = [t for batch in controller.trainer.batches for t in batch]
    assert len(trajectories) == 12
    for t in trajectories:
        task = t["task"]
        # filled in by the base class from the task in hand ...
        assert t["uid"] == task["uid"] and t["sample_index"] == task["sample_index"]
        # ... from the completion the worker asked for ...
        assert t["sampling"]["temperature"] == 0.7
        assert t["response_token_ids"] == list(t["response"].encode()) and t["prompt_token_ids"]
        assert isinstance(t["model_version"], int)
        # ... and scored by the recipe's evaluator (the guide's), its metrics kept
        assert t["reward"] == float(t["response"].strip() == task["ground_truth"])
        assert t["score"] == {"reward": t["reward"], "answer_length": float(len(t["response"])),
                              "exact_match": t["reward"]}
        assert t["extra_info"]["parsed_output"] == {"parsed": t["response"]}
        # what the worker set itself is kept
        assert t["custom_metadata"] == task["metadata"] and t["model_tag"] == "default"
        assert t["rollout_worker"] == "rollout worker MyRolloutWorker"
        assert trajectory_problem(t, "self_hosted") is None  # a self-hosted trainer could train on it
    assert {t["reward"] for t in trajectories} == {0.0, 1.0}  # the mock learns: both outcomes occur
    # a group is the samples of one task
    by_uid = {}
    for t in trajectories:
        by_uid.setdefault(t["uid"], set()).add(t["sample_index"])
    assert all(indices == {0, 1} for indices in by_uid.values())


def test_a_trainer_class_from_a_file_next_to_the_recipe_trains(guide_files, run_local):
    controller, summary = run_local(_recipe(trainer={"type": "python", "path": "my_trainer.py",
                                                     "class": "CountingTrainer"}, steps=2))
    assert summary.stopped_by == "finished" and summary.global_step == 2
    assert type(controller.trainer).__name__ == "CountingTrainer" and len(controller.trainer.batches) == 2
    rows = [json.loads(line) for line in (guide_files / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["custom/batch"] for r in rows if "custom/batch" in r] == [4.0, 4.0]


@pytest.mark.parametrize("section, message", [
    ({"path": "missing.py", "class": "MyRolloutWorker"},
     "rollout_worker.path: 'missing.py' is not found (a Python file that defines class MyRolloutWorker)"),
    ({"path": "my_worker.py", "class": "Nope"},
     "rollout_worker.class: my_worker.py defines no 'Nope' (classes in it: MyRolloutWorker, NotAWorker, "
     "Unfinished)"),
    ({"path": "my_worker.py", "class": "NotAWorker"},
     "rollout_worker.class: NotAWorker in my_worker.py does not extend nexrl_core.BaseRolloutWorker"),
    ({"path": "my_worker.py", "class": "Unfinished"},
     "rollout_worker.class: Unfinished in my_worker.py leaves abstract methods unimplemented: step"),
    ({"path": "my_worker.py"}, "rollout_worker.class: required"),
    ({"path": "my_worker.py", "class": "MyRolloutWorker", "colour": "red"}, "rollout_worker.colour: unknown key"),
])
def test_validate_and_run_agree_on_a_bad_class_from_a_file(section, message, guide_files, core_pm, capfd,
                                                           monkeypatch, reset_loguru):
    monkeypatch.chdir(guide_files)
    launch = section.pop("launch_mode", "local")
    recipe = {**_recipe(worker={"type": "python", **section}), "launch_mode": launch}
    recipe["run_dir"] = str(guide_files / "run")
    (guide_files / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    for command in ("validate", "run"):
        assert main([command, "recipe.yaml"]) == 2
        err = capfd.readouterr().err
        assert message.replace("my_worker.py", str(guide_files / "my_worker.py")) in err or message in err, err
        assert "Traceback" not in err


# -- the trajectory contract, checked where the trainer takes its batch ------------------------------

STRICT = textwrap.dedent('''
    from nexrl_core import BaseTrainer


    class StrictTrainer(BaseTrainer):
        """Reads what a self-hosted trainer reads, and trains nothing."""
        NO_MODEL_STATE = True
        TRAJECTORY_CONTRACT = "self_hosted"

        def train(self, trajectories):
            return {}
''')

HANDMADE = textwrap.dedent('''
    from nexrl_core import BaseRolloutWorker


    class HandmadeWorker(BaseRolloutWorker):
        """Asks the service with complete() (no seed-style record) and builds the dict itself."""
        def step(self, task):
            from nexrl_core import SamplingParams

            result = self._llm_client.complete(task["prompt"], SamplingParams())
            return self._put_trajectory({"response": result.text, "reward": 1.0,
                                         "prompt_token_ids": result.prompt_token_ids,
                                         "response_token_ids": result.response_token_ids})
''')


def test_a_trajectory_missing_a_key_the_trainer_reads_stops_with_one_line(guide_files, run_local):
    from nexrl_core import RunFailed

    (guide_files / "strict.py").write_text(STRICT)
    (guide_files / "handmade.py").write_text(HANDMADE)
    recipe = _recipe(worker={"type": "python", "path": "handmade.py", "class": "HandmadeWorker"},
                     trainer={"type": "python", "path": "strict.py", "class": "StrictTrainer"})
    with pytest.raises(RunFailed) as failed:
        run_local(recipe)
    message = str(failed.value)
    assert "from rollout worker HandmadeWorker has no 'sampling' (dict (SamplingParams.as_record()): how it was " \
           "sampled" in message
    assert "trainer StrictTrainer reads it (the self_hosted keys of docs/extending.md)" in message
    assert "Traceback" not in message


def test_what_each_contract_asks():
    ok = {"uid": "0:1", "reward": 1.0, "prompt_token_ids": [1], "response_token_ids": [2],
          "sampling": {"temperature": 1.0}}
    assert trajectory_problem(ok, "self_hosted") is None
    assert trajectory_problem({**ok, "reward": True}, "self_hosted") == "has 'reward' of type bool, expected float"
    assert trajectory_problem(ok, "remote_api").startswith("has no 'response_logprobs' (list[float]")
    assert trajectory_problem({"uid": 1, "prompt": "hi", "response": "ho"}, "sft") is None
    assert trajectory_problem({"uid": 1, "prompt_token_ids": [1], "response": "ho"}, "sft") is None
    assert trajectory_problem({"uid": 1, "response": "ho"}, "sft").startswith("has no 'prompt'")
    assert trajectory_problem({**ok, "loss_mask": "1101"}, "agent") == "has 'loss_mask' of type str, expected list[int]"


def test_docs_extending_lists_every_key_of_every_contract():
    from pathlib import Path

    from nexrl_core.trajectory_keys import CONTRACTS

    page = (Path(__file__).resolve().parents[2] / "docs" / "extending.md").read_text(encoding="utf-8")
    for contract, keys in CONTRACTS.items():
        assert f"**{contract}**" in page
        for key in keys:
            assert f"`{key.name}`" in page and key.type_text.split(" (")[0].replace("|", "\\|") in page, key
