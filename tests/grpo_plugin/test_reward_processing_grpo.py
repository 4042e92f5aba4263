"""The GRPO trainer's reward-processing step on the tiny Llama: per-domain settings reach the
gradient, a sample-level mask removes rows from the loss only, an all-masked batch moves no
weight, the running statistics travel in the checkpoint, and the recipe keys are checked alike by
`nexrl validate` and `nexrl run`."""

from __future__ import annotations

import random

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nexrl_core.launch.parts import build_module
from nexrl_core.launch.preflight import validate_recipe
from nexrl_core.launch.recipe import RecipeProblems, load_recipe
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from tests.support.letters import grpo_plugin_manager

MAX_TOKENS = 5


def make_trainer(model_dir: str, lr: float = 1e-30, **algorithm) -> SelfHostedGrpoTrainer:
    # lr must be > 0; 1e-30 moves no float32 weight (each step is far below a weight's last bit).
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 8},
        "rollout_worker": {}, "algorithm": algorithm,
        "service": {"train_service": {"model_path": model_dir, "lr": lr, "grad_clip": 0, "num_threads": 1},
                    "inference_service": {}},
    })
    trainer = build_module(SelfHostedGrpoTrainer, config)
    trainer.initialize_workers()
    return trainer


def trajectories(groups: dict[str, tuple[str, list[float], list[bool]]], seed: int = 0) -> list[dict]:
    """``{uid: (domain, rewards, truncated)}`` -> trajectories with random tokens (the same uid and
    sample index always get the same tokens)."""
    out = []
    for uid, (domain, rewards, truncated) in groups.items():
        rng = random.Random(f"{seed}|{uid}")
        prompt = [rng.randrange(5, 90) for _ in range(4)]
        for i, (reward, cut) in enumerate(zip(rewards, truncated)):
            length = MAX_TOKENS if cut else rng.randrange(1, MAX_TOKENS)
            out.append({"uid": uid, "sample_index": i, "domain": domain, "reward": reward,
                        "finish_reason": "length" if cut else "stop", "prompt_token_ids": prompt,
                        "response_token_ids": [rng.randrange(5, 90) for _ in range(length)],
                        "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS}, "model_version": 0})
    return out


def grads(trainer: SelfHostedGrpoTrainer, batch: list[dict]) -> tuple[torch.Tensor, dict]:
    captured = {}
    step = trainer.train_service.optim_step

    def capture():
        captured["g"] = torch.cat([p.grad.reshape(-1) for p in trainer.train_service._params if p.grad is not None])
        return step()
    trainer.train_service.optim_step = capture
    metrics = trainer.train(batch).metrics
    return captured["g"], metrics


def assert_same_gradient(a: torch.Tensor, b: torch.Tensor) -> None:
    # Another batch layout (rows, packing) rounds differently: float noise relative to the largest entry.
    scale = float(b.abs().max())
    assert scale > 0
    torch.testing.assert_close(a, b, rtol=0, atol=1e-5 * scale)


def test_a_domains_scale_reaches_the_gradient(tiny_model_dir):
    groups = {"m0": ("math", [1.0, 0.0, 0.0, 1.0], [False] * 4),
              "c0": ("code", [0.5, 0.0, 1.0, 0.0], [False] * 4)}
    processed = make_trainer(tiny_model_dir, norm_adv_by_std=False,
                             reward_processing={"domains": {"code": {"scale": 3.0}}})
    g_processed, metrics = grads(processed, trajectories(groups))
    # the same thing written into the rewards, processing off
    scaled = {**groups, "c0": ("code", [3 * r for r in groups["c0"][1]], [False] * 4)}
    g_manual, _ = grads(make_trainer(tiny_model_dir, norm_adv_by_std=False), trajectories(scaled))
    assert_same_gradient(g_processed, g_manual)
    assert metrics["train/code/processed_reward_mean"] == pytest.approx(3 * 0.375)
    assert metrics["train/math/processed_reward_mean"] == pytest.approx(0.5)


def test_masked_rows_leave_the_loss_and_nothing_else(tiny_model_dir):
    # overlong: mask on a group whose every response was cut off = training without that group
    groups = {"a": ("math", [1.0, 0.0, 0.5, 0.0], [False] * 4),
              "b": ("math", [1.0, 0.0, 0.0, 0.0], [True] * 4),
              "c": ("code", [0.0, 1.0, 1.0, 0.0], [False, False, True, False])}
    masked = make_trainer(tiny_model_dir, reward_processing={"overlong": "mask", "domains": {"code": {"overlong": "keep"}}})
    g_masked, metrics = grads(masked, trajectories(groups))
    without_b = {k: v for k, v in groups.items() if k != "b"}
    g_without, _ = grads(make_trainer(tiny_model_dir), trajectories(without_b))
    assert_same_gradient(g_masked, g_without)
    assert metrics["train/math/masked_frac"] == 0.5 and metrics["train/code/masked_frac"] == 0.0
    assert metrics["train/math/truncated_frac"] == 0.5 and metrics["train/code/truncated_frac"] == 0.25
    # a mask that cuts a group in half keeps the masked rows in the group's baseline
    half = {"a": ("math", [1.0, 0.0, 0.5, 0.0], [False, True, False, True])}
    trainer = make_trainer(tiny_model_dir, reward_processing={"overlong": "mask"})
    batch, _ = trainer._prepare_batch(trainer._process_trajectories(trajectories(half)))
    rows = batch.values["response_mask"].sum(-1)
    assert (rows[[1, 3]] == 0).all() and (rows[[0, 2]] > 0).all()
    adv = batch.values["advantages"][:, 0]
    mean, std = 0.375, torch.tensor([1.0, 0.0, 0.5, 0.0]).std().item()
    assert adv[[0, 2]].tolist() == pytest.approx([(1.0 - mean) / (std + 1e-6), (0.5 - mean) / (std + 1e-6)], rel=1e-5)


def test_an_all_masked_batch_moves_no_weight(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, lr=0.1, reward_processing={"mask_flat_groups": True})
    before = [p.detach().clone() for p in trainer.train_service._params]
    metrics = trainer.train(trajectories({"f": ("math", [1.0] * 4, [False] * 4)})).metrics
    assert metrics["train/update_skipped"] == 1.0 and metrics["train/math/masked_frac"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.train_service._params))


def test_running_statistics_are_saved_and_restored(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, reward_processing={"norm": "running"})
    trainer.train(trajectories({"a": ("math", [1.0, 0.0, 0.0, 0.0], [False] * 4)}))
    state = trainer.algorithm_state()
    assert state["reward_running"]["math"]["count"] == 4
    restored = make_trainer(tiny_model_dir, reward_processing={"norm": "running"})
    restored.load_algorithm_state(state)
    batch = trajectories({"b": ("math", [1.0, 1.0, 0.0, 0.0], [False] * 4)})
    a = trainer._prepare_batch(trainer._process_trajectories(batch))[0].values["token_level_scores"]
    b = restored._prepare_batch(restored._process_trajectories(batch))[0].values["token_level_scores"]
    torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_reward_processing_keys_are_checked_alike_by_validate_and_run(tiny_model_dir, tmp_path):
    base = {
        "run_dir": str(tmp_path / "run"),
        "data": {"type": "multi_domain", "domain_interleave_probs": {"math": 1, "code": 1},
                 "domains": {"math": {"type": "inline", "rows": [{"prompt": "a"}]},
                             "code": {"type": "inline", "rows": [{"prompt": "b"}]}}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo"},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": tiny_model_dir},
                    "inference_service": {"backend": "hf", "model_path": tiny_model_dir}},
    }
    pm = grpo_plugin_manager()
    good = {**base, "algorithm": {"reward_processing": {"norm": "group", "domains": {"code": {"scale": 0.5}}}}}
    path = tmp_path / "good.yaml"
    path.write_text(yaml.safe_dump(good))
    assert validate_recipe(load_recipe(str(path)), pm) == []
    bad = {**base, "algorithm": {"reward_processing": {"norm": "batch", "domains": {"code": {"clip": 0}}}}}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    expected = ["algorithm.reward_processing.domains.code.clip: expected a positive number or null, got 0"]
    assert validate_recipe(load_recipe(str(path)), pm) == expected
    from nexrl_core.controller import NexRLController

    with pytest.raises(RecipeProblems) as exc:
        NexRLController(load_recipe(str(path)), plugin_manager=pm)
    assert exc.value.problems == expected


def test_an_agent_trajectory_of_two_sequences_is_one_sample_masked_on_both_rows(tiny_model_dir):
    """A multi-turn trajectory (``segments``) is one sample of its group: cut off in its last turn,
    ``overlong: mask`` leaves both of its rows out of the loss, and the group's statistics count
    its reward once."""
    prompt = [11, 12, 13, 14]
    segments = [{"prompt_token_ids": prompt, "response_token_ids": [20, 21], "response_logprobs": None},
                {"prompt_token_ids": [30, 31], "response_token_ids": [40, 41, 42, 43, 44], "response_logprobs": None}]
    agent = {"uid": "g", "sample_index": 0, "domain": "tools", "reward": 1.0, "segments": segments,
             "prompt_token_ids": prompt, "response_token_ids": [20, 21],
             "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS}, "model_version": 0}
    others = [{"uid": "g", "sample_index": i, "domain": "tools", "reward": r, "prompt_token_ids": prompt,
               "response_token_ids": [50 + i, 60 + i], "finish_reason": "stop",
               "sampling": {"temperature": 1.0, "max_tokens": MAX_TOKENS}, "model_version": 0}
              for i, r in ((1, 0.0), (2, 0.5))]
    trainer = make_trainer(tiny_model_dir, reward_processing={"overlong": "mask"})
    batch, metrics = trainer._prepare_batch(trainer._process_trajectories([agent] + others))
    assert batch.metadata["row_trajectory"] == [0, 0, 1, 2]
    assert batch.metadata["truncated"] == [True, True, False, False]  # the last turn hit max_tokens
    rows = batch.values["response_mask"].sum(-1)
    assert rows.tolist() == [0.0, 0.0, 2.0, 2.0]
    assert metrics["train/tools/masked_frac"] == pytest.approx(1 / 3)  # per trajectory, not per row
    # GRPO over the three trajectory rewards (1, 0, 0.5): the masked one still sets the baseline
    std = torch.tensor([1.0, 0.0, 0.5]).std().item()
    adv = batch.values["advantages"][:, 0]
    assert adv[2:].tolist() == pytest.approx([(0.0 - 0.5) / (std + 1e-6), (0.5 - 0.5) / (std + 1e-6)], abs=1e-6)
