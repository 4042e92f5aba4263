"""``type: python`` classes (a rollout worker and a trainer loaded from files next to the recipe)
with ``launch_mode: ray``: the driver reads each file once and the text travels to the actors,
which compile it under the file's name (a traceback there names file:line); no class is pickled.
Torch-free, on the session's local Ray cluster."""

from __future__ import annotations

import json
import linecache
import os
import pickle
import sys
import textwrap
import traceback

import pytest
import yaml

from nexrl_core.controller import NexRLController, RunFailed
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.runtime.python_class import ClassSource, class_from_file

WORKER = textwrap.dedent('''
    import os

    from nexrl_core import BaseRolloutWorker


    class PidWorker(BaseRolloutWorker):
        def step(self, task):
            answer = self._llm_client.completion(task["prompt"], temperature=0.7)
            return self._put_trajectory({"prompt": task["prompt"], "response": answer["response"],
                                         "finish_reason": answer["finish_reason"], "worker_pid": os.getpid()})


    class FailingWorker(PidWorker):
        def step(self, task):
            raise ValueError(f"no thanks, {task['prompt']}")
''')
FAIL_LINE = WORKER.splitlines().index('        raise ValueError(f"no thanks, {task[\'prompt\']}")') + 1

TRAINER = textwrap.dedent('''
    import os

    from nexrl_core import BaseTrainer


    class PidTrainer(BaseTrainer):
        NO_MODEL_STATE = True

        def train(self, trajectories):
            pids = {t["worker_pid"] for t in trajectories}
            return {"custom/trainer_pid": float(os.getpid()), "custom/worker_pids": float(len(pids)),
                    "custom/worker_pid": float(min(pids))}
''')


EVALUATOR = textwrap.dedent('''
    from nexrl_core import EvaluationRunResult, Evaluator


    class LengthEvaluator(Evaluator):
        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult(reward=float(len(evaluation_target.final_answer) > 0), ground_truth="",
                                       metrics={}, extra_info={})
''')


@pytest.fixture
def files(tmp_path):
    (tmp_path / "evaluator.py").write_text(EVALUATOR)
    (tmp_path / "my_worker.py").write_text(WORKER)
    (tmp_path / "my_trainer.py").write_text(TRAINER)
    rows = [{"prompt": f"{a} + 1", "answer": str(a + 1)} for a in range(8)]
    (tmp_path / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def recipe(files, worker: str) -> str:
    data = {
        "launch_mode": "ray", "run_dir": str(files / "run"),
        "logger": {"backend": [], "level": "WARNING"},
        "runtime_monitor": {"stop_timeout": 10},
        "data": {"type": "file", "path": "train.jsonl"},
        "rollout_worker": {"type": "python", "path": "my_worker.py", "class": worker, "num_workers": 2,
                           "evaluator": {"type": "python", "path": "evaluator.py", "class": "LengthEvaluator"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "python", "path": "my_trainer.py", "class": "PidTrainer", "total_train_steps": 2},
        "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 2}},
    }
    (files / "recipe.yaml").write_text(yaml.safe_dump(data))
    return str(files / "recipe.yaml")


def test_classes_from_files_run_in_ray_actors(ray_cluster, files, core_pm, reset_loguru):
    summary = NexRLController(load_recipe(recipe(files, "PidWorker")), plugin_manager=core_pm).run()
    assert summary.stopped_by == "finished" and summary.global_step == 2, summary
    rows = [json.loads(x) for x in (files / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "custom/trainer_pid" in r]
    assert len(rows) == 2
    for r in rows:  # both classes ran in actors of their own, not in this process
        assert os.getpid() not in (r["custom/trainer_pid"], r["custom/worker_pid"])
        assert r["custom/trainer_pid"] != r["custom/worker_pid"]
        assert r["train/reward_mean"] == 1.0  # the evaluator from a file scored every sample (in the worker's actor)


def test_an_error_in_an_actor_names_the_users_file_and_line(ray_cluster, files, core_pm, reset_loguru):
    with pytest.raises(RunFailed) as failed:
        NexRLController(load_recipe(recipe(files, "FailingWorker")), plugin_manager=core_pm).run()
    assert "rollout worker FailingWorker raised ValueError: no thanks, " in str(failed.value)
    assert f"({files / 'my_worker.py'}:{FAIL_LINE} in step)" in str(failed.value), failed.value


def test_the_class_travels_as_its_text_not_its_file(files):
    """What an actor receives: the class rebuilt from the text the driver read, under the file's
    name, though the file is gone (another machine of the cluster need not have it)."""
    from nexrl_core.launch.ray.actors import Slot
    from nexrl_core.runtime import python_class

    path = str(files / "my_worker.py")
    cls = class_from_file(path, "FailingWorker", "rollout_worker")
    source = ClassSource.of(cls)
    assert source is not None and source.path == path and source.text == WORKER and source.name == "FailingWorker"
    assert ClassSource.of(Slot) is None  # an installed class travels as itself
    payload = pickle.dumps(Slot("rollout_worker", 0, cls, {"num_workers": 1}))
    os.remove(path)
    python_class._modules.clear()  # as in a fresh process
    for name in [n for n in sys.modules if n.startswith("nexrl_recipe_file_")]:
        del sys.modules[name]
    linecache.clearcache()
    slot = pickle.loads(payload)
    assert slot.cls is not cls and slot.cls.__name__ == "FailingWorker" and slot.config == {"num_workers": 1}
    assert slot.cls.__mro__[1].__name__ == "PidWorker"
    assert sys.modules[slot.cls.__module__].__file__ == path
    with pytest.raises(ValueError) as raised:
        slot.cls.step(None, {"prompt": "x"})
    frame = traceback.extract_tb(raised.value.__traceback__)[-1]
    assert (frame.filename, frame.lineno, frame.name) == (path, FAIL_LINE, "step")
    assert frame.line == 'raise ValueError(f"no thanks, {task[\'prompt\']}")'  # the line, from the text
