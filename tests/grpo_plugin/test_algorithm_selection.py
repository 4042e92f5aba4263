"""``algorithm.type`` / ``algorithm.policy_loss`` select from the registry, with nexrl-grpo installed:
``nexrl validate`` and ``nexrl run`` reject an unknown name (did you mean) or a key nobody reads
with the same message; ``dr_grpo`` trains with its own advantages and loss normaliser; a
plugin's estimator is picked by name and used by a real run."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from nexrl_core import ConfigError, algorithms, hookimpl
from nexrl_core.controller import NexRLController
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.grpo_plugin.test_on_policy import make_trainer, recipe, rollouts
from tests.support.letters import grpo_plugin_manager

REPO_ROOT = Path(__file__).resolve().parents[2]


def _nexrl(*args: str) -> subprocess.Popen:
    script = Path(sys.executable).with_name("nexrl")
    cmd = [str(script)] if script.is_file() else [shutil.which("nexrl") or "nexrl"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "NEXRL_LOAD_PLUGINS": "nexrl-grpo,nexrl-torch"}
    return subprocess.Popen(cmd + list(args), cwd=REPO_ROOT, env=env, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)


@pytest.mark.parametrize("overrides,expected", [
    (["+algorithm.type=grpp"], "algorithm.type: unknown advantage estimator 'grpp'. Did you mean 'grpo'?"),
    (["+algorithm.type=dr_grpo", "+algorithm.epsilon=0.1"], "algorithm.epsilon: unknown key"),
    (["+algorithm.policy_loss=ppo_clp"], "algorithm.policy_loss: unknown policy loss 'ppo_clp'. Did you mean "
                                         "'ppo_clip'? Available: 'dual_clip' (nexrl-grpo), 'gspo' (nexrl-grpo), "
                                         "'ppo_clip' (nexrl-grpo), 'topr' (nexrl-grpo)."),
    (["+algorithm.policy_loss=dual_clip", "+algorithm.clip_ratio_c=0.5"],
     "algorithm.clip_ratio_c: expected a number > 1"),
    (["+algorithm.critic_warmup=2"], "algorithm.critic_warmup: unknown key"),  # grpo trains no critic
    (["+algorithm.type=gae", "+algorithm.critic.lr=0"], "algorithm.critic.lr: expected a positive number, got 0"),
    (["+algorithm.type=gae", "+algorithm.critic.value_clp=0.2"], "did you mean 'algorithm.critic.value_clip'?"),
    (["+algorithm.kl_loss_type=k4"], "algorithm.kl_loss_type: 'k4' is not one of"),
    (["+algorithm.adv_estimator=gae"], "algorithm.adv_estimator: no longer a recipe key: the advantage estimator "
                                       "is algorithm.type"),
    (["algorithm.loss_agg_mode=token_mean"], "algorithm.loss_agg_mode: 'token_mean' is not one of"),
    (["+algorithm.do_old_log_prob_compute=true"], "algorithm.do_old_log_prob_compute: unknown key"),
    (["+algorithm.rollout_correction.cap=0.5"], "algorithm.rollout_correction.cap: expected a number >= 1, got 0.5"),
    (["+algorithm.rollout_correction.enable=true"], "did you mean 'algorithm.rollout_correction.enabled'?"),
    (["+service.train_service.temperature=0.7"], "service.train_service.temperature: no longer a recipe key: each row is scored at the "
                                                  "temperature its trajectory was sampled with"),
])
def test_validate_and_run_reject_the_same_way(tmp_path, overrides, expected):
    cfg = load_recipe(str(REPO_ROOT / "recipes" / "quickstart.yaml"), [f"run_dir={tmp_path / 'run'}", *overrides])
    pm = grpo_plugin_manager()
    problems = check_config(cfg, pm)  # what `nexrl validate` prints
    assert len(problems) == 1 and expected in problems[0], problems  # one problem, one line: no cascade
    with pytest.raises(ConfigError) as info:  # what `nexrl run` stops with, before loading any model
        NexRLController(cfg, plugin_manager=pm)
    assert expected in str(info.value)


def test_cli_validate_and_run_agree_on_an_unknown_estimator(tmp_path):
    args = ["recipes/quickstart.yaml", f"run_dir={tmp_path / 'run'}", "+algorithm.type=grpp"]
    validate, run = _nexrl("validate", *args), _nexrl("run", *args)  # both import torch: overlap them
    _, v_err = validate.communicate(timeout=120)
    _, r_err = run.communicate(timeout=120)
    expected = "algorithm.type: unknown advantage estimator 'grpp'. Did you mean 'grpo'?"
    assert validate.returncode == 2 and expected in v_err, v_err
    assert run.returncode == 2 and expected in r_err, r_err  # bad input: exit 2, like validate
    assert "Traceback" not in v_err + r_err


def test_dr_grpo_uses_group_centred_advantages_and_the_constant_normaliser(tiny_model_dir):
    trainer = make_trainer(tiny_model_dir, type="dr_grpo")
    assert trainer.selection.options["loss_agg_mode"] == "seq-mean-token-sum-norm"
    assert make_trainer(tiny_model_dir, type="dr_grpo", loss_agg_mode="token-mean").selection.options[
        "loss_agg_mode"] == "token-mean"  # the recipe's choice wins over the estimator's default
    seen = {}
    prepare = trainer._prepare_batch

    def record(batch):
        batch, metrics = prepare(batch)
        seen["advantages"], seen["mask"] = batch.values["advantages"].numpy(), batch.values["response_mask"].numpy()
        seen["max_tokens"] = batch.metadata["max_tokens"]
        return batch, metrics
    trainer._prepare_batch = record
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    try:
        batch = rollouts(engine, 1.0)
    finally:
        engine.close()
    metrics = trainer.train(batch).metrics
    assert np.isfinite(metrics["train/loss"]) and seen["max_tokens"] == 5
    rewards = np.array([t["reward"] for t in batch])
    for i, t in enumerate(batch):
        members = [j for j, u in enumerate(batch) if u["uid"] == t["uid"]]
        want = rewards[i] - rewards[members].mean()  # no division by the group std
        assert np.allclose(seen["advantages"][i][seen["mask"][i] > 0], want, atol=1e-6)


def _double_score(data: algorithms.AdvantageInputs, *, factor: float = 2.0):
    """A third party's estimator: ``factor`` times the row's score."""
    score = (data.token_level_rewards * data.response_mask).sum(-1)
    adv = factor * score[:, None] * data.response_mask
    return adv, adv


def _sign_reinforce(log_prob, old_log_prob, advantages, response_mask, context, *, weight: float = 1.0):
    """A third party's loss: REINFORCE on the advantage's sign, ``-weight * sign(A) * logp``."""
    import torch

    per_token = -weight * torch.sign(advantages) * log_prob
    loss = (per_token * response_mask).sum() / context.batch_num_tokens
    return loss, {"sign_positive_share": float((advantages > 0).float().mean())}


class DoublePlugin:
    @hookimpl
    def nexrl_advantage_estimators(self):
        return {"double_score": _double_score}

    @hookimpl
    def nexrl_policy_losses(self):
        return {"sign_reinforce": _sign_reinforce}


def test_a_plugin_estimator_and_loss_are_used_by_a_real_run(tiny_model_dir, tmp_path):
    cfg = recipe(tmp_path / "run", tiny_model_dir, 1.0)
    cfg["validate"]["validate_before_train"] = False
    cfg["algorithm"] = {"type": "double_score", "factor": 3.0, "policy_loss": "sign_reinforce", "weight": 0.5}
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    pm = grpo_plugin_manager()
    pm.register(DoublePlugin(), name="double", distribution="nexrl-double (in-process)")
    controller = NexRLController(load_recipe(str(path)), plugin_manager=pm)
    trainer = controller.trainer
    seen = []
    prepare = trainer._prepare_batch
    trainer._prepare_batch = lambda batch: (lambda out: (seen.append(out[0]), out)[1])(prepare(batch))
    seen_logp = []
    make_loss_fn = trainer._loss_fn

    def recording_loss_fn(batch):
        loss_fn = make_loss_fn(batch)
        return lambda log_probs, mb: (seen_logp.append(log_probs.detach().clone()), loss_fn(log_probs, mb))[1]
    trainer._loss_fn = recording_loss_fn
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == []
    assert trainer.selection.functions["type"].distribution == "nexrl-double (in-process)"
    assert trainer.selection.functions["policy_loss"].distribution == "nexrl-double (in-process)"
    (batch,) = seen
    v = batch.values
    scores = v["rewards"].numpy()
    for i in range(len(scores)):
        valid = v["response_mask"][i].numpy() > 0
        assert np.allclose(v["advantages"][i].numpy()[valid], 3.0 * scores[i], atol=1e-6)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "train/loss" in r]
    # The plugin's loss ran: its metric is logged, and its value is -0.5 * token mean of sign(A) * logp.
    assert row["train/sign_positive_share"] == pytest.approx(float((v["advantages"] > 0).float().mean()))
    (logp,) = seen_logp
    mask = v["response_mask"]
    want = float(-0.5 * (torch.sign(v["advantages"]) * logp * mask).sum() / mask.sum())
    assert row["train/loss"] == pytest.approx(want, rel=1e-5) and want != 0.0
