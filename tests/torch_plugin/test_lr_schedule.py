"""The local train service's learning-rate schedule (``lr_scheduler`` with ``warmup_steps`` or
``warmup_ratio``, transformers' schedulers): each step's lr follows the formula, a resume mid-schedule
is bit-exact, and bad combinations name their keys."""

from __future__ import annotations

import math

import pytest
import torch
import yaml

from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import random_batch, train_step
from tests.support.weights import same_weights

LR = 1e-2


def service(model_dir, **keys):
    return LocalTorchTrainService({"model_path": model_dir, "lr": LR, "seed": 3, **keys})


def expected(kind: str, step: int, warmup: int, total: int) -> float:
    """The lr of optimizer step ``step`` (0-based), written out: linear warm-up from 0, then the decay."""
    if step < warmup:
        return LR * step / warmup
    if kind == "constant":
        return LR
    progress = (step - warmup) / (total - warmup)
    return LR * (1 - progress) if kind == "linear" else LR * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind,keys,warmup", [
    ("cosine", {"warmup_ratio": 0.25}, 2),  # ceil(0.25 * 8)
    ("linear", {"warmup_steps": 3}, 3),
    ("constant", {"warmup_steps": 2}, 2),
])
def test_each_step_uses_the_scheduled_lr(tiny_model_dir, kind, keys, warmup):
    svc = service(tiny_model_dir, lr_scheduler=kind, total_steps=8, **keys)
    lrs = [train_step(svc, random_batch(step))["lr"] for step in range(8)]
    assert lrs == pytest.approx([expected(kind, k, warmup, 8) for k in range(8)], rel=1e-9, abs=1e-12)


def test_a_resume_mid_schedule_is_bit_exact(tiny_model_dir, tmp_path):
    keys = {"lr_scheduler": "cosine", "warmup_steps": 2, "total_steps": 6}
    batches = [random_batch(seed) for seed in range(6)]
    whole = service(tiny_model_dir, **keys)
    # steps 1-2 warm up from lr 0; step 3 moves the weights: equal weights below are trained ones
    assert [train_step(whole, batch)["grad_norm"] > 0 for batch in batches[:3]] == [True] * 3
    whole.save_checkpoint(tmp_path / "ckpt", {})
    state = torch.get_rng_state()
    want = [train_step(whole, batch)["lr"] for batch in batches[3:]]

    resumed = service(tiny_model_dir, **keys)
    resumed.load_checkpoint(tmp_path / "ckpt")
    torch.set_rng_state(state)
    got = [train_step(resumed, batch)["lr"] for batch in batches[3:]]
    assert got == want
    assert same_weights(whole.export_weights(), resumed.export_weights())
    with pytest.raises(ValueError, match="trained with an lr_scheduler"):
        service(tiny_model_dir).load_checkpoint(tmp_path / "ckpt")


def test_bad_schedules_name_their_keys(tiny_model_dir, tmp_path, capsys):
    with pytest.raises(ValueError, match="warmup_steps and warmup_ratio: set one of them"):
        service(tiny_model_dir, lr_scheduler="cosine", warmup_steps=1, warmup_ratio=0.1, total_steps=4)
    with pytest.raises(ValueError, match="lr_scheduler: cosine with warm-up or decay needs total_steps"):
        service(tiny_model_dir, lr_scheduler="cosine")
    from nexrl_core.cli import main
    from tests.support.letters import tiny_grpo_recipe

    path = tmp_path / "recipe.yaml"
    recipe = tiny_grpo_recipe(tmp_path / "run", tiny_model_dir, group=2, steps=2)
    recipe["rollout_worker"]["evaluator"] = {"type": "exact_match"}  # an installed one: main() loads entry points
    path.write_text(yaml.safe_dump(recipe))
    assert main(["validate", str(path), "service.train_service.lr_scheduler=cosine",
                 "service.train_service.warmup_ratio=0.1"]) == 0
    assert main(["validate", str(path), "service.train_service.lr_scheduler=cosin"]) == 2
    assert "service.train_service.lr_scheduler: 'cosin' is not one of" in capsys.readouterr().err
