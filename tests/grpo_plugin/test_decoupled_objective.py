"""``algorithm.objective: decoupled`` (issue #47 item 3): AReaL's decoupled PPO in the GRPO trainer.

- The loss, through the trainer's own ``loss_fn``, against a direct float64 computation on a
  hand-made batch whose tokens come from mixed weight versions (behaviour != proximal !=
  current on every token; tokens above the cap, clipped on both sides, advantages of both signs),
  in several aggregation modes: value, gradient and metrics.
- The standard objective is unchanged bit for bit (the key omitted or set to ``standard``; the
  policy loss called directly); decoupled equals standard + the rollout correction at the same
  cap, since nexrl's old log-probs were always the trainer's own (the proximal policy).
- The proximal log-probs are computed once per batch, and only when the weights move within it.
- A tiny-model run with the decoupled objective in fully-async mode trains (non-zero gradients).
"""

from __future__ import annotations

import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nexrl_core import Batch, ConfigError
from nexrl_core.controller import NexRLController
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.runtime.inference import SamplingParams
from nexrl_grpo.losses import LossContext, ppo_clip
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.letters import grpo_plugin_manager, tiny_grpo_recipe

# ---------------------------------------------------------------- the hand-made batch
# Three rows of four response tokens (row 1 has three), trained at weight version 5: the proximal
# policy is version 5 (the weights the step starts from), "current" the weights after an update.
VERSIONS = [[3, 3, 4, 4],   # a partial rollout: cut by the update 3 -> 4 and continued
            [5, 5, 5, -1],  # sampled by the proximal weights themselves: only the engine's noise
            [4, 4, 4, 4]]
MASK = [[1, 1, 1, 1], [1, 1, 1, 0], [1, 1, 1, 1]]
BEHAVIOUR = [[-1.20, -0.40, -2.10, -0.90],   # the sampler's log-prob of each token, under its version
             [-0.50, -1.00, -0.30, 0.00],
             [-2.50, -0.70, -1.60, -0.20]]
PROXIMAL = [[-0.70, -0.55, -0.60, -1.00],    # weights ratio pi_prox / pi_behav: 1.65, 0.86, 4.48, 0.90
            [-0.48, -1.01, -0.31, 0.00],     # 1.02, 0.99, 0.99
            [-0.40, -0.90, -1.20, -0.05]]    # 8.17 (capped), 0.82, 1.49, 1.16
CURRENT = [[-0.50, -0.80, -0.45, -1.30],     # ratio pi / pi_prox: 1.22 (clipped, A > 0), 0.78, 1.16, 0.74
           [-0.40, -1.10, -0.20, 0.00],      # 1.08, 0.91, 1.12
           [-0.45, -0.66, -1.50, -0.01]]     # 0.95, 1.27 (A < 0: not clipped), 0.74 (clipped), 1.04
ADVANTAGES = [0.8, -1.5, -0.6]
CAP = 5.0
CLIP = 0.2


def reference(mode: str, cap: float | None = CAP) -> tuple[float, list[list[float]], dict[str, float]]:
    """The decoupled loss computed directly in float64 (plain Python floats), its gradient with
    respect to the current log-probs and its metrics. ``cap`` None: the standard objective (no
    behaviour weight)."""
    per_token, grad_token, weights, clipped = {}, {}, [], []
    for i, row in enumerate(MASK):
        for t, valid in enumerate(row):
            if not valid:
                continue
            a = ADVANTAGES[i]
            w = 1.0 if cap is None else min(math.exp(PROXIMAL[i][t] - BEHAVIOUR[i][t]), cap)
            r = math.exp(CURRENT[i][t] - PROXIMAL[i][t])
            unclipped, clip = -a * r, -a * min(max(r, 1 - CLIP), 1 + CLIP)
            per_token[i, t] = w * max(unclipped, clip)
            grad_token[i, t] = 0.0 if clip > unclipped else w * -a * r  # d/dlogp of w * (-A r)
            weights.append(w)
            clipped.append(clip > unclipped)
    counts = [sum(row) for row in MASK]
    if mode == "token-mean":
        scale = {(i, t): 1 / sum(counts) for i, t in per_token}
    elif mode == "seq-mean-token-mean":
        scale = {(i, t): 1 / (counts[i] * len(MASK)) for i, t in per_token}
    else:  # seq-mean-token-sum
        scale = {(i, t): 1 / len(MASK) for i, t in per_token}
    loss = sum(per_token[k] * scale[k] for k in per_token)
    grad = [[grad_token.get((i, t), 0.0) * scale.get((i, t), 0.0) for t in range(4)] for i in range(3)]
    n = len(weights)
    metrics = {"pg_clipfrac": sum(clipped) / n,
               "ppo_kl": sum(PROXIMAL[i][t] - CURRENT[i][t] for i, t in per_token) / n}
    if cap is not None:
        metrics.update(behav_imp_weight_mean=sum(weights) / n, behav_imp_weight_max=max(weights),
                       behav_imp_weight_capped_frac=sum(math.exp(PROXIMAL[i][t] - BEHAVIOUR[i][t]) > cap
                                                        for i, t in per_token) / n)
    return loss, grad, metrics


def trainer(**algorithm) -> SelfHostedGrpoTrainer:
    """The GRPO trainer, its algorithm resolved; no model (its loss_fn needs none)."""
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 3}, "rollout_worker": {},
        "algorithm": algorithm,
        "service": {"train_service": {"model_path": "/no/model/needed"}, "inference_service": {}}})
    return build_module(SelfHostedGrpoTrainer, config)


def tensor(rows) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64)


def run_loss(owner: SelfHostedGrpoTrainer, proximal: bool = True):
    """``owner``'s loss_fn on the hand-made batch: (loss, d loss / d current log-probs, metrics)."""
    mask, behaviour = tensor(MASK), tensor(BEHAVIOUR)
    loss_fn = owner._loss_fn(Batch({"rollout_log_probs": behaviour}, {"max_tokens": 4}))
    log_probs = tensor(CURRENT).requires_grad_(True)
    mb = {"advantages": tensor(ADVANTAGES)[:, None].expand(3, 4).contiguous(), "response_mask": mask,
          "rollout_log_probs": behaviour, "batch_num_seqs": 3, "batch_num_tokens": float(mask.sum())}
    if proximal:  # the no-grad pass before the first update, computed once per batch
        mb["old_log_probs"] = tensor(PROXIMAL)
    loss, metrics = loss_fn(log_probs, mb)
    loss.backward()
    return loss.detach(), log_probs.grad, {k: v for k, v in metrics.items() if k != "rows"}


def test_the_hand_made_batch_mixes_versions_and_policies():
    for i, row in enumerate(MASK):
        for t, valid in enumerate(row):
            if valid:
                assert len({BEHAVIOUR[i][t], PROXIMAL[i][t], CURRENT[i][t]}) == 3, (i, t)
    assert {v for row in VERSIONS for v in row if v >= 0} == {3, 4, 5} and len(set(VERSIONS[0])) == 2


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum"])
def test_decoupled_loss_matches_a_float64_reference(mode):
    loss, grad, metrics = run_loss(trainer(objective="decoupled", behav_imp_weight_cap=CAP, loss_agg_mode=mode,
                                           clip_ratio_low=CLIP, clip_ratio_high=CLIP))
    want_loss, want_grad, want_metrics = reference(mode)
    assert loss.dtype == torch.float64 and float(loss) == pytest.approx(want_loss, rel=1e-13, abs=1e-15)
    torch.testing.assert_close(grad, tensor(want_grad), rtol=1e-13, atol=1e-15)
    for name, value in want_metrics.items():
        assert metrics[name] == pytest.approx(value, rel=1e-12, abs=1e-15), name
    # what the batch exercises: a capped weight, clipping on both sides, gradients that flow and stop
    assert 0 < metrics["behav_imp_weight_capped_frac"] < 1 and metrics["behav_imp_weight_max"] == pytest.approx(CAP)
    assert 0 < metrics["pg_clipfrac"] < 1 and (grad == 0).any() and (grad != 0).sum() > 6
    # the standard objective on the same tokens: no behaviour weight, a different loss
    standard, _, _ = run_loss(trainer(loss_agg_mode=mode, clip_ratio_low=CLIP, clip_ratio_high=CLIP))
    assert float(standard) == pytest.approx(reference(mode, cap=None)[0], rel=1e-13, abs=1e-15)
    assert abs(float(standard) - want_loss) > 0.05


def test_the_behaviour_weight_is_truncated_at_its_cap():
    _, grad_low, low = run_loss(trainer(objective="decoupled", behav_imp_weight_cap=1.5))
    assert low["behav_imp_weight_max"] == pytest.approx(1.5) and low["behav_imp_weight_capped_frac"] == pytest.approx(3 / 11)
    want = reference("seq-mean-token-mean", cap=1.5)
    assert low["behav_imp_weight_mean"] == pytest.approx(want[2]["behav_imp_weight_mean"], rel=1e-12)
    torch.testing.assert_close(grad_low, tensor(want[1]), rtol=1e-13, atol=1e-15)


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "dual_clip", "gspo", "topr"])
@pytest.mark.parametrize("proximal", [True, False], ids=["several-updates", "one-update"])
def test_standard_objective_is_unchanged_bit_for_bit(policy_loss, proximal):
    omitted = run_loss(trainer(policy_loss=policy_loss), proximal)
    explicit = run_loss(trainer(policy_loss=policy_loss, objective="standard"), proximal)
    assert torch.equal(omitted[0], explicit[0]) and torch.equal(omitted[1], explicit[1])
    assert omitted[2] == explicit[2] and not any(k.startswith("behav_") for k in omitted[2])
    if policy_loss == "ppo_clip":  # the policy loss itself, called directly: nothing else in the loss
        log_probs = tensor(CURRENT).requires_grad_(True)
        mask = tensor(MASK)
        old = tensor(PROXIMAL) if proximal else log_probs.detach()
        direct, _ = ppo_clip(log_probs, old, tensor(ADVANTAGES)[:, None].expand(3, 4), mask,
                             LossContext(batch_num_seqs=3, batch_num_tokens=float(mask.sum()), max_response_length=4))
        direct.backward()
        assert torch.equal(direct.detach(), omitted[0]) and torch.equal(log_probs.grad, omitted[1])


@pytest.mark.parametrize("policy_loss", ["ppo_clip", "dual_clip", "gspo", "topr"])
def test_decoupled_is_the_rollout_correction_against_the_proximal_policy(policy_loss):
    """nexrl's old log-probs are the trainer's own (the proximal policy), so the standard objective
    with the truncated-IS correction at the same cap computes the same loss; only the names of the
    weight's metrics differ."""
    decoupled = run_loss(trainer(policy_loss=policy_loss, objective="decoupled", behav_imp_weight_cap=3.0))
    corrected = run_loss(trainer(policy_loss=policy_loss, rollout_correction={"enabled": True, "cap": 3.0}))
    assert torch.equal(decoupled[0], corrected[0]) and torch.equal(decoupled[1], corrected[1])
    assert decoupled[2]["behav_imp_weight_mean"] == corrected[2]["rollout_is_weight_mean"]
    assert decoupled[2]["behav_imp_weight_capped_frac"] == corrected[2]["rollout_is_capped_frac"]


def test_decoupled_needs_the_samplers_logprobs_and_no_second_correction():
    with pytest.raises(ConfigError, match=r"algorithm.objective: decoupled weights each token by pi_prox / pi_behav, "
                                          r"but the rollout returned no log-probs"):
        trainer(objective="decoupled")._loss_fn(Batch({}, {"max_tokens": 4}))
    with pytest.raises(ConfigError, match=r"algorithm.rollout_correction.enabled: algorithm.objective: decoupled "
                                          r"already weights each token"):  # nexrl validate says it first
        trainer(objective="decoupled", rollout_correction={"enabled": True})._loss_fn(
            Batch({"rollout_log_probs": tensor(BEHAVIOUR)}, {"max_tokens": 4}))


# ---------------------------------------------------------------- on the tiny model


@pytest.fixture(scope="module")
def behaviour_batch(tiny_model_dir):
    """Engine rollouts whose log-probs are made lower by ln 1.5: as if older weights had sampled them."""
    model, tokenizer = load_causal_lm(tiny_model_dir)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    prompt = [{"role": "user", "content": "count: one, two"}]
    params = [SamplingParams(max_tokens=5, temperature=0.7, seed=i) for i in range(8)]
    try:
        with ThreadPoolExecutor(8) as pool:
            results = list(pool.map(lambda p: engine.complete(prompt, p), params))
    finally:
        engine.close()
    shift = math.log(1.5)
    return [{"uid": f"g{i // 4}", "sample_index": i % 4, "prompt_token_ids": r.prompt_token_ids,
             "response_token_ids": r.response_token_ids, "response_logprobs": [lp - shift for lp in r.response_logprobs],
             "sampling": p.as_record(), "reward": float(i % 3), "model_version": 0}
            for i, (r, p) in enumerate(zip(results, params))]


def model_trainer(model_dir: str, **algorithm) -> SelfHostedGrpoTrainer:
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 8}, "rollout_worker": {},
        "algorithm": algorithm, "service": {"inference_service": {}, "train_service": {
            "model_path": model_dir, "lr": 1e-2, "grad_clip": 0, "num_threads": 1}}})
    owner = build_module(SelfHostedGrpoTrainer, config)
    owner.initialize_workers()
    return owner


@pytest.mark.parametrize("epochs,passes", [(1, 0), (2, 1)])
def test_proximal_logprobs_are_computed_once_per_batch_when_the_weights_move(tiny_model_dir, behaviour_batch,
                                                                             epochs, passes):
    owner = model_trainer(tiny_model_dir, objective="decoupled", ppo_epochs=epochs)
    forwards = []
    forward = owner.train_service.forward
    owner.train_service.forward = lambda batch: forwards.append(1) or forward(batch)
    metrics = owner.train([dict(t) for t in behaviour_batch]).metrics
    assert len(forwards) == passes
    # every weight is pi_prox / pi_behav = 1.5 at the first update (the engine's noise aside)
    if epochs == 1:
        assert metrics["train/behav_imp_weight_mean"] == pytest.approx(1.5, rel=1e-3)
        assert abs(metrics["train/ppo_kl"]) < 1e-6  # the ratio against the proximal policy is 1
    else:  # the last update's metrics: the weights moved since the proximal pass, the weights did not
        assert metrics["train/behav_imp_weight_mean"] == pytest.approx(1.5, rel=1e-3)
        assert metrics["train/ppo_kl"] != 0
    assert metrics["train/behav_imp_weight_capped_frac"] == 0 and metrics["train/grad_norm"] > 0


def test_a_decoupled_run_in_fully_async_mode_trains(tiny_model_dir, tmp_path):
    steps, bound = 4, 2
    cfg = tiny_grpo_recipe(tmp_path / "run", tiny_model_dir, group=4, steps=steps, workers=6, seed=3,
                           algorithm={"objective": "decoupled", "ppo_epochs": 2},
                           weight={"sync_mode": "fully-async", "staleness_threshold": bound},
                           logger={"samples_every": 1})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    summary = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager()).run()
    assert summary.stopped_by == "finished" and summary.errors == [], summary
    run_dir = Path(cfg["run_dir"])
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    rows = [r for r in rows if "train/reward_mean" in r]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for r in rows:
        assert r["train/grad_norm"] > 0 and math.isfinite(r["train/loss"]), r
        assert 0 < r["train/behav_imp_weight_mean"] <= 5.0 and r["train/behav_imp_weight_max"] <= 5.0, r
        assert 0 <= r["train/token_staleness_max"] <= bound and r["train/staleness_max"] <= bound, r
        assert "train/rollout_logprob_diff_max" in r and "train/rollout_is_weight_mean" not in r
    assert any(r["train/ppo_kl"] != 0 for r in rows)  # the second update's ratio is against the proximal policy
    samples = [json.loads(x) for x in (run_dir / "samples.jsonl").read_text().splitlines() if x.strip()]
    assert samples and all(s["token_versions"] == [s["model_version"]] * len(s["token_versions"]) for s in samples)
