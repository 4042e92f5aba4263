"""GRPO with ``service.train_service.lora`` through the real controller on the tiny Llama: every push
gives the engine the trainer's merged weights, step 1 is on policy, the reward rises, the
checkpoints hold the adapter, and a run killed after a checkpoint and resumed ends bit-identical."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from nexrl_core.controller import NexRLController, RunFailed
from nexrl_core.launch.recipe import load_recipe
from nexrl_torch.train.lora import ADAPTER_FOLDER
from tests.support.letters import grpo_plugin_manager, tiny_grpo_recipe
from tests.support.weights import same_weights

STEPS = 6
GROUP = 8
LORA = {"rank": 8, "alpha": 16.0}


def lora_recipe(run_dir: Path, model_dir: str, steps: int = STEPS, **extra) -> dict:
    return tiny_grpo_recipe(run_dir, model_dir, group=GROUP, steps=steps, lr=2e-2,
                            trainer={"save_freq": 3, **extra},
                            service={"train_service": {"lora": dict(LORA)}})


def run(tmp_path: Path, cfg: dict, name: str = "recipe.yaml", *overrides: str):
    path = tmp_path / name
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    controller = NexRLController(load_recipe(str(path), list(overrides)), plugin_manager=grpo_plugin_manager())
    engine, trainer = controller.inference_client, controller.trainer
    served: list[bool] = []
    load_weights = engine.load_weights

    def checking_load_weights(state_dict, version):
        load_weights(state_dict, version)
        merged = trainer.train_service.export_weights()
        served.append(same_weights(engine.model.state_dict(), merged))

    engine.load_weights = checking_load_weights
    controller.run()
    rows = [json.loads(line) for line in (Path(cfg["run_dir"]) / "metrics.jsonl").read_text().splitlines()]
    return [r for r in rows if "train/reward_mean" in r], served, trainer


def test_lora_grpo_trains_serves_merged_weights_and_checkpoints_the_adapter(tiny_model_dir, tmp_path):
    rows, served, trainer = run(tmp_path, lora_recipe(tmp_path / "run", tiny_model_dir))
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert served and all(served)  # every push: the engine holds exactly the trainer's merged weights
    assert abs(rows[0]["train/ppo_kl"]) < 1e-5  # on policy at step 1 (adapted vs merged forward: rounding)
    assert all(r["train/grad_norm"] > 0 for r in rows)
    first, last = sum(r["train/reward_mean"] for r in rows[:2]), sum(r["train/reward_mean"] for r in rows[-2:])
    assert last > first, [r["train/reward_mean"] for r in rows]
    trainable = [n for n, p in trainer.train_service.model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    for step in (3, 6):
        adapter = tmp_path / "run" / "checkpoints" / f"global_step_{step}" / ADAPTER_FOLDER
        assert (adapter / "adapter_config.json").is_file() and (adapter / "adapter_model.safetensors").is_file()
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == LORA["rank"]


def test_a_lora_run_resumed_from_its_checkpoint_ends_bit_identical(tiny_model_dir, tmp_path):
    whole_rows, _, whole = run(tmp_path, lora_recipe(tmp_path / "whole", tiny_model_dir), "whole.yaml")
    # The same run stopped after its step-3 checkpoint, then resumed to the end.
    run(tmp_path, lora_recipe(tmp_path / "cut", tiny_model_dir, steps=3), "cut.yaml")
    resumed_rows, _, resumed = run(tmp_path, lora_recipe(tmp_path / "cut", tiny_model_dir), "resumed.yaml",
                                   "resume.mode=auto")
    assert [r["step"] for r in resumed_rows][-3:] == [4, 5, 6]
    assert all(r["train/grad_norm"] > 0 for r in whole_rows)  # the weights compared below did move
    for a, b in zip(whole_rows[3:], resumed_rows[-3:]):
        assert a["train/reward_mean"] == b["train/reward_mean"] and a["train/grad_norm"] == b["train/grad_norm"]
    want, got = whole.train_service.export_weights(), resumed.train_service.export_weights()
    assert same_weights(want, got)


def test_nexrl_export_writes_the_adapter_or_the_merged_model(tiny_model_dir, tmp_path, capsys):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from nexrl_core.cli import main

    _, _, trainer = run(tmp_path, lora_recipe(tmp_path / "run", tiny_model_dir, steps=3))
    ckpt = tmp_path / "run" / "checkpoints" / "global_step_3"
    assert main(["export", str(ckpt), str(tmp_path / "adapter")]) == 0
    assert main(["export", str(ckpt), str(tmp_path / "merged"), "--merged"]) == 0
    adapter_files = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= adapter_files
    assert "model.safetensors" not in adapter_files and "optimizer.safetensors" not in adapter_files
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True),
                                        str(tmp_path / "adapter"))
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", local_files_only=True)
    ids = torch.tensor([[5, 9, 17, 33, 2, 41]])
    with torch.no_grad():
        want = trainer.train_service.model(input_ids=ids).logits
        assert torch.allclose(adapted(input_ids=ids).logits, want, atol=1e-5)
        assert torch.allclose(merged(input_ids=ids).logits, want, atol=1e-5)


def test_the_served_probe_passes_each_push_and_stops_a_run_whose_pushes_never_arrive(tiny_model_dir, tmp_path):
    from nexrl_core import WeightSyncBackend, execute, hookimpl
    from nexrl_torch.rollout.weights import InProcessWeightSync

    rows, _, _ = run(tmp_path, lora_recipe(tmp_path / "ok", tiny_model_dir, steps=3), "ok.yaml")
    probed = [r for r in rows if "weight/served_version_ok" in r]
    assert [r["step"] for r in probed] == [1, 2, 3]  # each step pushes, and its row carries that push's probe
    assert all(r["weight/served_version_ok"] == 1.0 and r["weight/served_probe_gap"] < 1e-4 for r in probed)

    class LostPush(WeightSyncBackend):
        """Claims to move the tensors, moves the version number only (the bug users of several peers
        report for adapters)."""

        CAPABILITIES = InProcessWeightSync.CAPABILITIES

        def sync(self, trainer, inference_client, version):
            execute(inference_client.set_model_version, version)


    class Plugin:
        @hookimpl
        def nexrl_weight_sync_backends(self):
            return {"lost_push": LostPush}

    pm = grpo_plugin_manager()
    pm.register(Plugin(), name="lost", distribution="nexrl-lost (in-process)")
    cfg = lora_recipe(tmp_path / "lost", tiny_model_dir, steps=3)
    cfg["weight"]["backend"] = "lost_push"
    path = tmp_path / "lost.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    with pytest.raises(RunFailed, match=r"after pushing weights v1, the inference service scores the probe .* away "
                                        r"from the trainer \(weight.served_probe_tolerance 0.001\), and exactly as it "
                                        r"did before the push though the trainer's weights moved: the new weights did "
                                        r"not reach it"):
        controller.run()
    trained = [json.loads(line)["step"] for line in (tmp_path / "lost" / "metrics.jsonl").read_text().splitlines()
               if "train/reward_mean" in line]
    # The run pushes v0 before training (the probe's first trainer reading); step 1 trains on rollouts
    # of those weights, which the engine did serve; the push after it is refused, so no step trains on
    # rollouts of weights that never arrived.
    assert trained == [1]
