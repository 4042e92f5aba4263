"""The seed guide's custom trainer, rewritten as the migration page says (SelfHostedTrainer from
nexrl_grpo.trainers, Batch from nexrl_core): a class that overrides only ``_prepare_batch``,
loaded from a file next to the recipe (``trainer.type: python``), trains the tiny Llama on
trajectories of the guide's plain-dict worker (``rollout_worker.type: python``)."""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager
from tests.support.torch_fixtures import TINY_RUN_MONITOR, tiny_services

TRAINER = textwrap.dedent('''
    import torch

    from nexrl_core import Batch
    from nexrl_grpo.trainers import SelfHostedTrainer


    class MyCustomTrainer(SelfHostedTrainer):
        def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict]:
            batch.values["advantages"] = self._compute_advantages(batch)
            return batch, {"custom/mean_advantage": batch.values["advantages"].mean().item()}

        def _compute_advantages(self, batch: Batch):
            rewards, uids = batch.values["rewards"], batch.metadata["uids"]
            advantages = torch.zeros_like(rewards)  # one number per row: the default loss spreads it
            for uid in set(uids):
                rows = [i for i, u in enumerate(uids) if u == uid]
                advantages[rows] = rewards[rows] - rewards[rows].mean()
            return advantages
''')

WORKER = textwrap.dedent('''
    from nexrl_core import BaseRolloutWorker


    class MyRolloutWorker(BaseRolloutWorker):
        def step(self, task):
            answer = self._llm_client.completion(task["prompt"], temperature=0.7, max_tokens=12)
            return self._put_trajectory({"prompt": task["prompt"], "response": answer["response"],
                                         "finish_reason": answer["finish_reason"],
                                         "model_tag": self._llm_client._model_tag})
''')

REWARD = "def score(response, data):\n    return float(len(response) % 3) / 2\n"
STEPS = 3


def test_a_trainer_overriding_only_prepare_batch_trains(tiny_model_dir, tmp_path):
    trainer_class = "MyCustomTrainer"
    for name, text in (("my_trainer.py", TRAINER), ("my_worker.py", WORKER), ("reward.py", REWARD)):
        (tmp_path / name).write_text(text)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
        pm = PluginManager()
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "seed": 3,
        "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": p} for p in ("hello", "count to three", "a b c", "why")]},
        "rollout_worker": {"type": "python", "path": "my_worker.py", "class": "MyRolloutWorker", "num_workers": 2,
                           "evaluator": {"type": "python", "path": "reward.py", "function": "score"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "python", "path": "my_trainer.py", "class": trainer_class,
                    "total_train_steps": STEPS, "save_freq": STEPS},
        "weight": {"sync_mode": "sync", "backend": "in_process"},
        "service": tiny_services(tiny_model_dir),
        "runtime_monitor": TINY_RUN_MONITOR,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    assert type(controller.trainer).__name__ == trainer_class
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == STEPS and summary.errors == []
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/num_trajectories" in r]
    assert len(steps) == STEPS and all(r["train/num_trajectories"] == 4.0 for r in steps)
    # group-centred advantages average to 0; the default loss ran on them
    assert all(abs(r["custom/mean_advantage"]) < 1e-6 and "train/pg_loss" in r for r in steps)
    # the weights moved: the checkpoint differs from the initial model
    saved = load_file(str(tmp_path / "run" / "checkpoints" / f"global_step_{STEPS}" / "model.safetensors"))
    initial = load_file(str(Path(tiny_model_dir) / "model.safetensors"))
    changed = [k for k in initial if k in saved and not torch.equal(initial[k], saved[k].to(initial[k].dtype))]
    assert changed
    # nexrl export finds the class that wrote the checkpoint in its file
    from nexrl_core.cli import main

    checkpoint = tmp_path / "run" / "checkpoints" / f"global_step_{STEPS}"
    assert main(["export", str(checkpoint), str(tmp_path / "exported")]) == 0
    exported = load_file(str(tmp_path / "exported" / "model.safetensors"))
    assert all(torch.equal(exported[k], saved[k]) for k in changed)


def test_the_trainer_and_weight_sync_scaffolds_train_when_selected(tiny_model_dir, tmp_path, monkeypatch):
    """`nexrl new trainer` and `nexrl new weight-sync` packages, registered in-process, run GRPO on
    the tiny Llama in place of self_hosted_grpo and in_process: the scaled advantages reach the
    loss and every new version reaches the engine."""
    import importlib

    from nexrl_core.cli import main

    for kind, name in (("trainer", "scaled"), ("weight-sync", "push")):
        assert main(["new", kind, name, "--dir", str(tmp_path)]) == 0
    monkeypatch.syspath_prepend(str(tmp_path / "nexrl-trainer-scaled"))
    monkeypatch.syspath_prepend(str(tmp_path / "nexrl-weight-sync-push"))
    trainer_plugin = importlib.import_module("nexrl_trainer_scaled.plugin")
    push_plugin = importlib.import_module("nexrl_weight_sync_push.plugin")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
        pm = PluginManager()
    pm.register(trainer_plugin, name="scaled", distribution="nexrl-trainer-scaled")
    pm.register(push_plugin, name="push", distribution="nexrl-weight-sync-push")
    cfg = {
        "run_dir": str(tmp_path / "run"), "seed": 3, "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "arithmetic", "num_rows": 8, "max_value": 5},
        "rollout_worker": {"type": "simple", "num_workers": 2, "sampling": {"max_tokens": 6, "temperature": 1.0},
                           "evaluator": {"type": "python", "path": "reward.py", "function": "score"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "scaled", "advantage_scale": 0.5, "total_train_steps": 2},
        "weight": {"sync_mode": "sync", "backend": "push"},
        "service": tiny_services(tiny_model_dir),
        "runtime_monitor": TINY_RUN_MONITOR,
    }
    (tmp_path / "reward.py").write_text(REWARD)
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == 2 and summary.errors == []
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "train/num_trajectories" in r]
    assert [r["train/advantage_scale"] for r in steps] == [0.5, 0.5]
    assert controller.inference_client.model_version() == 2  # the engine serves what the scaffold pushed
