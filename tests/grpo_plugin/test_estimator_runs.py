"""Each estimator (and each policy loss, the KL loss term) trains the tiny Llama through the real
controller on a toy task, selected by name in the recipe: the reward rises. The critic of ``gae``:
its value loss falls on a fixed batch, ``critic_warmup`` holds the policy back, and a checkpoint
restores it exactly (safetensors/JSON only)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml

from nexrl_core import ConfigError
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import load_recipe
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.grpo_plugin.test_on_policy import make_trainer, rollouts
from tests.support.letters import grpo_plugin_manager, tiny_grpo_recipe

STEPS = 6
GROUP = 4


def recipe(run_dir: Path, model_dir: str, algorithm: dict) -> dict:
    return tiny_grpo_recipe(run_dir, model_dir, group=GROUP, steps=STEPS, seed=5, algorithm=algorithm)


def run(tmp_path: Path, model_dir: str, algorithm: dict) -> list[dict]:
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path / "run", model_dir, algorithm), sort_keys=False))
    summary = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager()).run()
    assert summary.stopped_by == "finished" and summary.errors == [], summary
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    return rows


RUNS = {
    "grpo": {"type": "grpo"},
    "dr_grpo": {"type": "dr_grpo"},
    "rloo+dual_clip": {"type": "rloo", "policy_loss": "dual_clip", "loss_agg_mode": "token-mean"},
    "reinforce_plus_plus+topr": {"type": "reinforce_plus_plus", "policy_loss": "topr",
                                 "loss_agg_mode": "seq-mean-token-sum"},
    # No warm-up here (test_critic_warmup_trains_only_the_critic_first covers it): with one step of
    # six held back, the rise depended on the rollouts' timing on a loaded machine.
    "gae": {"type": "gae", "lam": 1.0, "critic": {"lr": 1e-2}},
    "grpo+gspo+kl_loss": {"type": "grpo", "policy_loss": "gspo", "use_kl_loss": True, "kl_loss_coef": 0.01},
}


@pytest.mark.parametrize("name", list(RUNS))
def test_each_estimator_and_loss_raises_the_reward(tiny_model_dir, tmp_path, name):
    algorithm = RUNS[name]
    rows = run(tmp_path, tiny_model_dir, algorithm)
    rewards = [r["train/reward_mean"] for r in rows]
    first, last = sum(rewards[:2]) / 2, sum(rewards[-2:]) / 2
    assert last > first + 0.1, f"{name}: reward did not rise over {STEPS} steps: {rewards}"
    if algorithm["type"] == "reinforce_plus_plus":  # KL in the reward is its default
        assert all("train/kl_penalty" in r and "train/kl_coef" in r for r in rows)
    if algorithm.get("use_kl_loss"):
        assert all(r["train/kl_loss"] >= 0 for r in rows) and rows[-1]["train/kl_loss"] > 0
    if algorithm["type"] == "gae":
        assert [r["critic/warmup"] for r in rows] == [0.0] * STEPS and all("train/loss" in r for r in rows)
        assert all("critic/vf_loss" in r and "critic/grad_norm" in r for r in rows)


# ---------------------------------------------------------------- the critic on fixed batches


@pytest.fixture(scope="module")
def batch(tiny_model_dir):
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    try:
        return rollouts(engine, 1.0)
    finally:
        engine.close()


def test_the_critic_value_loss_falls_on_a_fixed_batch(tiny_model_dir, batch):
    # lam = gamma = 1: the targets are the Monte-Carlo returns, fixed while the critic learns them.
    trainer = make_trainer(tiny_model_dir, type="gae", lam=1.0, critic={"lr": 1e-2, "value_clip": None})
    losses = [trainer.train(batch).metrics["critic/vf_loss"] for _ in range(8)]
    assert max(losses[-3:]) < 0.4 * losses[0] and losses[1] < losses[0], losses


def _actor(trainer) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in trainer.train_service.export_weights().items()}


def _critic(trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.critic.model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_critic_warmup_trains_only_the_critic_first(tiny_model_dir, batch):
    trainer = make_trainer(tiny_model_dir, {"lr": 1e-2}, type="gae", critic_warmup=2)
    for step in range(3):
        actor, critic = _actor(trainer), _critic(trainer)
        trainer.global_step = step  # what BaseTrainer has counted when train() runs
        metrics = trainer.train(batch).metrics
        assert not _equal(critic, _critic(trainer))
        assert _equal(actor, _actor(trainer)) == (step < 2), step
        assert metrics["critic/warmup"] == float(step < 2) and ("train/loss" in metrics) == (step >= 2)


def test_the_critic_is_checkpointed_and_resumed_exactly(tiny_model_dir, batch, tmp_path):
    algorithm = {"type": "gae", "critic": {"lr": 1e-2}}
    first = make_trainer(tiny_model_dir, {"lr": 1e-2}, **algorithm)
    first.train(batch)
    first.save_model_state(str(tmp_path / "ckpt"))
    files = sorted(p.relative_to(tmp_path / "ckpt").as_posix() for p in (tmp_path / "ckpt").rglob("*") if p.is_file())
    assert "critic/model.safetensors" in files and "critic/optimizer.safetensors" in files
    assert all(f.endswith((".safetensors", ".json", ".jinja", ".txt", ".model")) for f in files), files
    resumed = make_trainer(tiny_model_dir, {"lr": 1e-2}, **algorithm)
    assert not _equal(_critic(first), _critic(resumed))
    resumed.load_model_state(str(tmp_path / "ckpt"))
    assert _equal(_critic(first), _critic(resumed)) and _equal(_actor(first), _actor(resumed))
    # The next step is the same step: critic optimizer state (Adam moments, step count) came back too.
    want, got = first.train(batch).metrics, resumed.train(batch).metrics
    assert _equal(_critic(first), _critic(resumed)) and _equal(_actor(first), _actor(resumed))
    assert got["critic/vf_loss"] == want["critic/vf_loss"] and got["train/loss"] == want["train/loss"]


def test_a_checkpoint_without_a_critic_is_refused_by_gae(tiny_model_dir, batch, tmp_path):
    plain = make_trainer(tiny_model_dir)
    plain.save_model_state(str(tmp_path / "ckpt"))
    with pytest.raises(ConfigError, match=r"the checkpoint has no critic \(critic/\), but algorithm.type 'gae'"):
        make_trainer(tiny_model_dir, type="gae").load_model_state(str(tmp_path / "ckpt"))


def test_micro_batched_critic_gives_the_whole_batch_value_loss(tiny_model_dir, batch):
    algorithm = {"type": "gae", "critic": {"lr": 1e-2, "loss_agg_mode": "seq-mean-token-mean"}}
    whole = make_trainer(tiny_model_dir, **algorithm)
    split = make_trainer(tiny_model_dir, {"micro_batch_size": 3}, **algorithm)
    assert split.critic.micro_batch_size == 3 and whole.critic.micro_batch_size is None
    for _ in range(2):  # the second step starts from trained (nonzero) values
        want, got = whole.train(batch).metrics, split.train(batch).metrics
        for name in ("critic/vf_loss", "critic/loss", "critic/vpred_mean", "critic/values_mean"):
            assert got[name] == pytest.approx(want[name], rel=1e-4, abs=1e-6), name
