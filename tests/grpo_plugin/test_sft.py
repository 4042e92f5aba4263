"""Supervised fine-tuning through the real controller: the ``self_hosted_cross_entropy`` trainer of
nexrl-grpo fed by the core's ``pig_latin`` rollout worker (targets computed, not sampled) on the
tiny Llama. The per-token NLL of the targets (``train/nll``) falls over a few steps, the engine
keeps receiving the trained weights, and the final checkpoint loads with transformers.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from nexrl_core.builtins.workers import pig_latin
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.plugins import PluginManager
from tests.support.torch_fixtures import TINY_RUN_MONITOR, tiny_services

SENTENCES = ["the quick brown fox", "hello world", "jumps over the lazy dog", "what is two plus three"]
STEPS = 6


def test_cross_entropy_on_pig_latin_lowers_nll(tiny_model_dir, tmp_path):
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("NEXRL_LOAD_PLUGINS", "nexrl-grpo,nexrl-torch")
        pm = PluginManager()
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "seed": 5,
        "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": s} for s in SENTENCES]},
        "rollout_worker": {"type": "pig_latin", "num_workers": 2},
        "trajectory_pool": {"batch_size": len(SENTENCES), "group_size": 1, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_cross_entropy", "total_train_steps": STEPS, "save_freq": STEPS},
        "weight": {"sync_mode": "sync", "backend": "in_process"},
        "service": tiny_services(tiny_model_dir),
        "runtime_monitor": TINY_RUN_MONITOR,
    }
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)

    seen: list[tuple[str, str]] = []
    trajectories_seen: list[dict] = []
    train = controller.trainer.train

    def record(trajectories):
        seen.extend((t["task"]["prompt"], t["response"]) for t in trajectories)
        trajectories_seen.extend(trajectories)
        return train(trajectories)
    controller.trainer.train = record

    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.global_step == STEPS and summary.errors == []
    # The worker's targets are the pig-latin translations of the prompts.
    assert seen and all(response == pig_latin(prompt) for prompt, response in seen)
    assert {p for p, _ in seen} == set(SENTENCES)
    # The trainer tokenizes the chat prompt exactly as the engine would have.
    engine, trainer = controller.inference_client, controller.trainer
    traj = trajectories_seen[0]
    prompt_ids, response_ids = trainer._token_ids(traj)
    assert prompt_ids == engine.encode_prompt(traj["prompt"])
    assert all(isinstance(i, int) for i in prompt_ids + response_ids)
    assert response_ids[-1] == engine.tokenizer.eos_token_id

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train_rows = [r for r in rows if "train/nll" in r]
    assert [r["step"] for r in train_rows] == list(range(1, STEPS + 1))
    nll = [r["train/nll"] for r in train_rows]
    assert all(x > 0 for x in nll), nll
    # Same four targets every step: the model memorises them.
    assert nll[-1] < 0.7 * nll[0], f"NLL did not fall enough: {nll}"
    assert sum(nll[-2:]) < sum(nll[:2]), nll
    assert all(r["train/loss"] == pytest.approx(r["train/nll"], rel=1e-5) for r in train_rows)

    assert engine.model_version() == trainer.global_step == STEPS
    name = "model.embed_tokens.weight"
    assert torch.equal(engine.model.state_dict()[name], trainer.train_service.model.state_dict()[name])

    from transformers import AutoModelForCausalLM

    ckpt = Path(cfg["run_dir"]) / "checkpoints" / f"global_step_{STEPS}"
    model = AutoModelForCausalLM.from_pretrained(str(ckpt))
    assert torch.equal(model.state_dict()[name], trainer.train_service.model.state_dict()[name])
