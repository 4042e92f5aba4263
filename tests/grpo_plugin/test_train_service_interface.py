"""nexrl-grpo's local torch service as a core train service (``nexrl_core.TrainService``), and the
self-hosted GRPO trainer driving a *plugin's* service of the same batch format, chosen with
``service.train_service.backend`` (the trainer no longer hard-wires the local one)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from nexrl_core import StepResult, TrainService, hookimpl
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import grpo_loss, random_batch
from tests.support.letters import grpo_plugin_manager
from tests.support.torch_fixtures import TINY_RUN_MONITOR


def test_the_local_service_implements_the_interface(tiny_model_and_tokenizer, tmp_path):
    model, tokenizer = tiny_model_and_tokenizer
    service = LocalTorchTrainService({"lr": 1e-2, "seed": 3}, model=model, tokenizer=tokenizer)
    assert isinstance(service, TrainService) and service.BATCH_FORMAT == "torch_tensors"
    batch = random_batch(0)
    before = {k: v.clone() for k, v in service.sampling_client().items()}
    result = service.train_step(batch, grpo_loss())
    assert isinstance(result, StepResult)
    assert {"loss", "pg_clipfrac", "ppo_kl", "grad_norm", "lr"} <= set(result.metrics)
    after = service.sampling_client()  # the live tensors, by name
    assert after.keys() == before.keys() and any(not torch.equal(after[k], before[k]) for k in after)

    service.save_state(str(tmp_path / "ck"), extra_state={"step": 1})
    other = LocalTorchTrainService({"lr": 1e-2}, model=type(model)(model.config), tokenizer=tokenizer)
    assert other.load_state(str(tmp_path / "ck")) == {"step": 1}
    assert all(torch.equal(other.sampling_client()[k], after[k]) for k in after)
    # The optimizer state came with it: the next step moves both to the same weights (with fresh Adam
    # moments it would not).
    again = random_batch(1)
    assert other.train_step(again, grpo_loss()).metrics == service.train_step(again, grpo_loss()).metrics
    assert all(torch.equal(other.sampling_client()[k], service.sampling_client()[k]) for k in after)
    fresh = LocalTorchTrainService({"lr": 1e-2}, model=type(model)(model.config), tokenizer=tokenizer)
    fresh.load_state(str(tmp_path / "ck"))
    fresh.optimizer.state.clear()
    fresh.train_step(again, grpo_loss())
    assert any(not torch.equal(fresh.sampling_client()[k], service.sampling_client()[k]) for k in after)


class CountingTorchService(LocalTorchTrainService):
    """A third party's service taking the same batches (here: the local one, counting its steps)."""

    built: list["CountingTorchService"] = []

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.steps = 0
        CountingTorchService.built.append(self)

    def optim_step(self):
        self.steps += 1
        return super().optim_step()


class CountingTorchPlugin:
    @hookimpl
    def nexrl_train_services(self):
        return {"counting_torch": CountingTorchService}


def test_the_self_hosted_trainer_drives_the_service_the_recipe_names(tiny_model_dir, tmp_path):
    pm = grpo_plugin_manager()
    pm.register(CountingTorchPlugin(), name="counting_torch", distribution="nexrl-counting-torch (in-process)")
    recipe = {
        "run_dir": str(tmp_path / "run"), "seed": 5, "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": "the quick"}, {"prompt": "hello world"}]},
        "rollout_worker": {"num_workers": 2, "sampling": {"max_tokens": 4},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 2, "save_freq": 2},
        "weight": {"sync_mode": "sync", "backend": "in_process"},
        "service": {"train_service": {"backend": "counting_torch", "model_path": tiny_model_dir, "lr": 1e-2,
                                      "num_threads": 1},
                    "inference_service": {"backend": "hf", "model_path": tiny_model_dir, "num_threads": 1}},
        "runtime_monitor": TINY_RUN_MONITOR,
    }
    path = Path(tmp_path / "recipe.yaml")
    path.write_text(yaml.safe_dump(recipe, sort_keys=False))
    CountingTorchService.built.clear()
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == []
    assert [type(s) for s in CountingTorchService.built] == [CountingTorchService]
    service = CountingTorchService.built[0]
    assert controller.trainer.train_service is service and service.steps == 2
    assert service.config["seed"] == 5  # built by from_config: the recipe's seed
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "train/grad_norm" in r] == [1, 2]
    assert (tmp_path / "run" / "checkpoints" / "global_step_2" / "optimizer.safetensors").is_file()
