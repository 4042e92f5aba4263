"""The seed guide's custom remote-API trainer, rewritten as the migration page says
(RemoteApiTrainer from nexrl_tinker.trainers): a class overriding only ``_prepare_trajectories``,
loaded from a file next to the recipe (``trainer.type: python``), trains the tiny model behind the
Tinker stand-in with the default loss."""

from __future__ import annotations

import copy
import textwrap

import yaml

from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from tests.tinker_plugin.helpers import grpo_recipe, metrics_rows, tinker_plugin_manager

TRAINER = textwrap.dedent('''
    from typing import Any

    from nexrl_core import Trajectory
    from nexrl_tinker.trainers import RemoteApiTrainer


    class MyRemoteTrainer(RemoteApiTrainer):
        def _prepare_trajectories(self, trajectories: list[Trajectory], metrics: dict[str, Any]) -> list[Trajectory]:
            groups: dict[Any, list[float]] = {}
            for traj in trajectories:
                groups.setdefault(traj["uid"], []).append(traj["reward"])
            for traj in trajectories:
                rewards = groups[traj["uid"]]
                traj["advantages"] = traj["reward"] - sum(rewards) / len(rewards)
                traj["custom_field"] = len(traj["response"])
            metrics["custom/mean_length"] = sum(t["custom_field"] for t in trajectories) / len(trajectories)
            return trajectories
''')


def test_a_remote_trainer_overriding_only_prepare_trajectories_trains(standin, tiny_folder, tmp_path):
    (tmp_path / "my_trainer.py").write_text(TRAINER)
    recipe = grpo_recipe(tmp_path / "run", standin.url, tiny_folder, steps=2, group=2)
    recipe["trainer"] = {"type": "python", "path": "my_trainer.py", "class": "MyRemoteTrainer",
                         "total_train_steps": 2}
    del recipe["algorithm"]  # the algorithm is the class's own
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=tinker_plugin_manager())
    train, untouched = controller.trainer.train, []

    def recording_train(trajectories):
        before = copy.deepcopy(trajectories)
        output = train(trajectories)
        untouched.append(trajectories == before)
        return output

    controller.trainer.train = recording_train
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == 2 and summary.errors == []
    # the guide's _prepare_trajectories sets keys on what it gets: this step's copies, not the pool's rows
    assert untouched == [True, True]
    steps = [r for r in metrics_rows(tmp_path / "run") if "train/num_trajectories" in r]
    assert len(steps) == 2 and all(r["custom/mean_length"] > 0 and "train/loss_sum" in r for r in steps)
    assert standin.count("POST /api/v1/forward_backward") == 2
