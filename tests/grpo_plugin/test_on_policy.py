"""On-policy ratios, sampling parameters carried by trajectories, the rollout-vs-trainer mismatch
metrics and the rollout correction, on the tiny Llama.

- Through the real controller at temperatures 0.7 and 1.0: step 1 reads ``ppo_kl`` < 1e-6 and a
  clip fraction of 0, trajectories carry the sampling parameters the worker sent (validation's
  greedy temperature included), and the mismatch metrics are float noise.
- Through the trainer on engine rollouts: a trajectory that misreports its temperature shows up
  in the mismatch metrics; greedy rows are scored at temperature 1; several updates per batch
  compute old log-probs once (ratio 1 at the first update); the truncated-IS correction scales
  each token's gradient by its weight, capped.
"""

from __future__ import annotations

import copy
import json
import math
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
import yaml
from omegaconf import OmegaConf

from nexrl_core import ConfigError
from nexrl_core.controller import NexRLController
from nexrl_core.launch.parts import build_module
from nexrl_core.launch.recipe import load_recipe
from nexrl_core.runtime.inference import SamplingParams
from nexrl_grpo.trainers import SelfHostedGrpoTrainer
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.letters import grpo_plugin_manager
from tests.support.torch_fixtures import TINY_RUN_MONITOR, tiny_services

PROMPTS = ["the quick", "what is", "count: one", "hello world"]
GROUP = 4


def recipe(run_dir: Path, model_dir: str, temperature: float) -> dict:
    return {
        "run_dir": str(run_dir),
        "seed": 11,
        "logger": {"backend": [], "level": "WARNING"},
        "data": {"type": "inline", "rows": [{"prompt": p} for p in PROMPTS]},
        "validate": {"validate_before_train": True, "data": {"type": "inline", "rows": [{"prompt": "hello"}]}},
        "rollout_worker": {"num_workers": 4, "validate_temperature": 0,
                           "sampling": {"max_tokens": 6, "temperature": temperature, "top_k": 50},
                           "evaluator": {"type": "letter_share", "letter": "e"}},
        "trajectory_pool": {"batch_size": 2 * GROUP, "group_size": GROUP, "key_list": ["uid"]},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 1},
        "weight": {"sync_mode": "sync", "backend": "in_process"},
        "service": tiny_services(model_dir),
        "runtime_monitor": TINY_RUN_MONITOR,
    }


@pytest.mark.parametrize("temperature", [0.7, 1.0])
def test_first_step_is_on_policy_at_any_temperature(tiny_model_dir, tmp_path, temperature):
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe(tmp_path / "run", tiny_model_dir, temperature), sort_keys=False))
    controller = NexRLController(load_recipe(str(path)), plugin_manager=grpo_plugin_manager())
    trained, validated = [], []
    train, put_validation = controller.trainer.train, controller.validator.put_trajectory

    def record_train(trajectories):
        trained.extend(trajectories)
        return train(trajectories)

    def record_validation(trajectory):
        validated.append(trajectory)
        return put_validation(trajectory)
    controller.trainer.train, controller.validator.put_trajectory = record_train, record_validation
    summary = controller.run()
    assert summary.stopped_by == "finished" and summary.errors == []

    sent = {"max_tokens": 6, "temperature": temperature, "top_p": 1.0, "top_k": 50, "stop": []}
    assert trained and all({k: t["sampling"][k] for k in sent} == sent for t in trained)
    assert len({t["sampling"]["seed"] for t in trained}) == len(trained)  # the per-request seed travels too
    assert validated and all(t["sampling"]["temperature"] == 0 for t in validated)

    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    (row,) = [r for r in rows if "train/reward_mean" in r]
    assert abs(row["train/ppo_kl"]) < 1e-6 and row["train/pg_clipfrac"] == 0.0, row
    assert row["train/rollout_logprob_diff_max"] < 1e-3 and row["train/rollout_kl_k3"] < 1e-6, row
    assert math.isfinite(row["train/loss"]) and row["train/grad_norm"] > 0
    # samples.jsonl: each sample with its own gap (float noise here), none above the step's
    samples = [json.loads(x) for x in (tmp_path / "run" / "samples.jsonl").read_text().splitlines()]
    assert len(samples) == 4 and all(set(s["logprob_gap"]) == {"max", "position", "token"} for s in samples)
    assert all(0 <= s["logprob_gap"]["max"] <= row["train/rollout_logprob_diff_max"] for s in samples)


# ---------------------------------------------------------------- the trainer on engine rollouts


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    model, tokenizer = load_causal_lm(tiny_model_dir)
    eng = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    yield eng
    eng.close()


def rollouts(engine, temperature: float, n: int = 8, seed: int = 0) -> list[dict]:
    """Trajectories as the simple worker writes them: tokens, log-probs, sampling record, reward."""
    prompt = [{"role": "user", "content": "count: one, two"}]
    params = [SamplingParams(max_tokens=5, temperature=temperature, seed=seed + i) for i in range(n)]
    with ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: engine.complete(prompt, p), params))
    return [{"uid": f"g{i // 4}", "sample_index": i % 4, "prompt_token_ids": r.prompt_token_ids,
             "response_token_ids": r.response_token_ids, "response_logprobs": r.response_logprobs,
             "sampling": p.as_record(), "reward": float(i % 3), "model_version": 0}
            for i, (r, p) in enumerate(zip(results, params))]


def make_trainer(model_dir: str, service: dict | None = None, **algorithm) -> SelfHostedGrpoTrainer:
    # lr must be > 0; 1e-30 moves no float32 weight (each step is far below a weight's last bit).
    train_service = {"model_path": model_dir, "lr": 1e-30, "grad_clip": 0, "num_threads": 1, **(service or {})}
    config = OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 8},
        "rollout_worker": {}, "algorithm": algorithm,
        "service": {"train_service": train_service, "inference_service": {}},
    })
    trainer = build_module(SelfHostedGrpoTrainer, config)
    trainer.initialize_workers()
    return trainer


def test_mismatch_metrics_see_a_misreported_temperature(tiny_model_dir, engine):
    trainer = make_trainer(tiny_model_dir)
    honest = rollouts(engine, 0.7)
    metrics = trainer.train(honest).metrics
    assert metrics["train/rollout_logprob_diff_max"] < 1e-3
    lying = [{**t, "sampling": {**t["sampling"], "temperature": 1.0}} for t in honest]
    metrics = trainer.train(lying).metrics
    assert metrics["train/rollout_logprob_diff_mean"] > 0.05 and metrics["train/rollout_kl_k3"] > 1e-3, metrics
    assert metrics["train/rollout_logprob_diff_max"] >= metrics["train/rollout_logprob_diff_mean"]
    assert abs(metrics["train/ppo_kl"]) < 1e-6  # the ratio stays the trainer's own


def test_micro_batches_report_the_whole_batch_mismatch(tiny_model_dir, engine):
    """Per-micro-batch metrics combine by name: the max as a max, means weighted by tokens."""
    # A mismatch growing with the row: the batch's max sits in the last micro-batch only.
    batch = [{**t, "response_logprobs": [lp - 0.01 * i * (k + 1) for k, lp in enumerate(t["response_logprobs"])]}
             for i, t in enumerate(rollouts(engine, 0.7))]
    whole = make_trainer(tiny_model_dir, rollout_correction={"enabled": True}).train(batch).metrics
    split = make_trainer(tiny_model_dir, service={"micro_batch_size": 3},
                         rollout_correction={"enabled": True}).train(batch).metrics
    for name in ("rollout_logprob_diff_mean", "rollout_logprob_diff_max", "rollout_kl_k3", "rollout_is_weight_mean",
                 "rollout_is_capped_frac", "ppo_kl", "pg_clipfrac"):
        # Smaller forwards round differently (~1e-6 per log-prob); a max averaged by tokens would be far off.
        assert split[f"train/{name}"] == pytest.approx(whole[f"train/{name}"], rel=1e-4, abs=1e-5), name
    assert whole["train/rollout_logprob_diff_max"] > 2 * whole["train/rollout_logprob_diff_mean"] > 0


def test_greedy_rows_are_scored_at_temperature_one(tiny_model_dir, engine):
    trainer = make_trainer(tiny_model_dir)
    greedy = rollouts(engine, 0.0)
    assert all(t["sampling"]["temperature"] == 0 for t in greedy)
    metrics = trainer.train(greedy).metrics
    assert metrics["train/rollout_logprob_diff_max"] < 1e-3, metrics


def test_a_trajectory_without_sampling_record_is_refused(tiny_model_dir, engine):
    trainer = make_trainer(tiny_model_dir)
    batch = rollouts(engine, 1.0)
    del batch[3]["sampling"]
    with pytest.raises(ConfigError, match=r"trajectory g0#3 does not say how it was sampled"):
        trainer.train(batch)


def test_several_updates_compute_old_logprobs_once_before_the_first(tiny_model_dir, engine):
    trainer = make_trainer(tiny_model_dir, ppo_epochs=2)
    forwards = []
    forward = trainer.train_service.forward
    trainer.train_service.forward = lambda batch: forwards.append(1) or forward(batch)
    metrics = trainer.train(rollouts(engine, 0.7)).metrics
    assert forwards == [1]
    # lr 1e-30: the weights never move, so the precomputed old log-probs are the current ones.
    assert abs(metrics["train/ppo_kl"]) < 1e-6 and metrics["train/pg_clipfrac"] == 0.0
    assert metrics["train/rollout_logprob_diff_max"] < 1e-3


def _grads(trainer) -> torch.Tensor:
    return torch.cat([p.grad.reshape(-1) for p in trainer.train_service._params if p.grad is not None])


def test_rollout_correction_weights_each_token_and_caps(tiny_model_dir, engine):
    batch = rollouts(engine, 0.7)
    grads = {}
    for name, shift, correction in [("off", 0.0, {"enabled": False}), ("x1.5", math.log(1.5), {"enabled": True}),
                                    ("capped", math.log(3.0), {"enabled": True, "cap": 2.0})]:
        trainer = make_trainer(tiny_model_dir, rollout_correction=correction)
        # Rollout log-probs lower than the trainer's by `shift`: every weight is exp(shift), capped.
        shifted = [{**t, "response_logprobs": [lp - shift for lp in t["response_logprobs"]]} for t in batch]
        step = trainer.train_service.optim_step
        # called only by this iteration's train()
        trainer.train_service.optim_step = lambda: (grads.__setitem__(name, _grads(trainer)), step())[1]  # noqa: B023
        metrics = trainer.train(shifted).metrics
        if name == "off":
            assert "train/rollout_is_weight_mean" not in metrics
        elif name == "x1.5":
            assert metrics["train/rollout_is_weight_mean"] == pytest.approx(1.5, rel=1e-3)
            assert metrics["train/rollout_is_capped_frac"] == 0.0
        else:
            assert metrics["train/rollout_is_weight_mean"] == pytest.approx(2.0, rel=1e-6)
            assert metrics["train/rollout_is_capped_frac"] == 1.0
    # Weights of 1.5 carry the engine-vs-trainer noise (~1e-5 relative); capped ones are exactly 2.
    scale = float(grads["off"].abs().max())
    torch.testing.assert_close(grads["x1.5"], 1.5 * grads["off"], rtol=0, atol=1e-4 * scale)
    torch.testing.assert_close(grads["capped"], 2.0 * grads["off"], rtol=0, atol=1e-6 * scale)
    assert not torch.allclose(grads["x1.5"], grads["off"], rtol=0, atol=0.1 * scale)


def test_rollout_correction_needs_rollout_logprobs(tiny_model_dir, engine):
    trainer = make_trainer(tiny_model_dir, rollout_correction={"enabled": True})
    batch = [{**t, "response_logprobs": None} for t in rollouts(engine, 1.0)]
    with pytest.raises(ConfigError, match="rollout_correction.enabled: the rollout returned no log-probs"):
        trainer.train(batch)


def test_a_bf16_engine_shows_in_the_mismatch_metrics_and_the_correction_weighs_it(tiny_model_dir, engine):
    """Rollouts from a bf16 engine scored by a float32 trainer: the training-inference mismatch GPU
    users meet with vLLM. The metrics show it (a float32 engine reads < 1e-3, see above) and the
    truncated-IS correction gives each token its weight, near 1."""
    model, tokenizer = load_causal_lm(tiny_model_dir, dtype="bfloat16")
    half = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    try:
        batch = rollouts(half, 1.0)
    finally:
        half.close()
    trainer = make_trainer(tiny_model_dir, rollout_correction={"enabled": True, "cap": 2.0})
    metrics = trainer.train(batch).metrics
    assert 1e-3 < metrics["train/rollout_logprob_diff_mean"] < 0.1, metrics
    assert metrics["train/rollout_logprob_diff_max"] > 1e-2 and metrics["train/rollout_kl_k3"] > 1e-6, metrics
    assert metrics["train/rollout_is_weight_mean"] != 1.0
    assert metrics["train/rollout_is_weight_mean"] == pytest.approx(1.0, abs=0.05)
    assert abs(metrics["train/ppo_kl"]) < 1e-6  # the PPO ratio stays the trainer's own


# ---------------------------------------------------------------- each sample's own log-prob gap


def own_logprobs(model, trajectory: dict) -> list[float]:
    """The trainer-side log-prob of each response token, computed here one sequence at a time (no
    padding, no micro-batches) at the trajectory's temperature."""
    prompt, response = trajectory["prompt_token_ids"], trajectory["response_token_ids"]
    ids = torch.tensor([prompt + response])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(prompt) - 1:-1].float()
    logp = torch.log_softmax(logits / trajectory["sampling"]["temperature"], dim=-1)
    return logp[torch.arange(len(response)), torch.tensor(response)].tolist()


def skewed(batch: list[dict]) -> list[dict]:
    """Rollout log-probs off by a different amount at a different token in each sample."""
    out = []
    for i, t in enumerate(batch):
        lps = list(t["response_logprobs"])
        lps[i % len(lps)] -= 0.05 * (i + 1)
        out.append({**t, "response_logprobs": lps})
    return out


def expected_gaps(model, batch: list[dict]) -> list[tuple[float, int]]:
    gaps = []
    for t in batch:
        diffs = [abs(a - b) for a, b in zip(own_logprobs(model, t), t["response_logprobs"])]
        gaps.append((max(diffs), diffs.index(max(diffs))))
    return gaps


@pytest.mark.parametrize("service", [{}, {"micro_batch_size": 3}], ids=["one-pass", "micro-batches"])
def test_each_sample_records_its_own_largest_logprob_gap(tiny_model_dir, engine, service):
    model, tokenizer = load_causal_lm(tiny_model_dir)
    batch = skewed(rollouts(engine, 0.7))
    want = expected_gaps(model, batch)
    trainer = make_trainer(tiny_model_dir, service=service)
    before = copy.deepcopy(batch)
    output = trainer.train(batch)
    metrics = output.metrics
    assert batch == before  # the trainer wrote nothing into the trajectories it was given
    got = [output.samples[i].logprob_gap for i in range(len(batch))]
    assert [g["max"] for g in got] == pytest.approx([m for m, _ in want], abs=1e-5)
    assert [g["position"] for g in got] == [p for _, p in want] == [i % len(t["response_token_ids"])
                                                                    for i, t in enumerate(batch)]
    assert [g["token"] for g in got] == [tokenizer.decode([t["response_token_ids"][g["position"]]])
                                         for g, t in zip(got, batch)]
    assert len({round(g["max"], 4) for g in got}) == len(batch)  # each sample its own, not the step's
    assert max(g["max"] for g in got) == pytest.approx(metrics["train/rollout_logprob_diff_max"], abs=1e-6)


def test_several_updates_record_the_gap_of_the_weights_the_step_started_from(tiny_model_dir, engine):
    model, _ = load_causal_lm(tiny_model_dir)
    batch = skewed(rollouts(engine, 0.7))
    want = expected_gaps(model, batch)
    trainer = make_trainer(tiny_model_dir, service={"lr": 1e-2}, ppo_epochs=2)
    samples = trainer.train(batch).samples
    assert [samples[i].logprob_gap["max"] for i in range(len(batch))] == pytest.approx([m for m, _ in want], abs=1e-5)


def test_without_rollout_logprobs_no_sample_records_a_gap(tiny_model_dir, engine):
    batch = [{**t, "response_logprobs": None} for t in rollouts(engine, 0.7)]
    samples = make_trainer(tiny_model_dir).train(batch).samples
    assert len(samples) == len(batch) and all(s.logprob_gap is None and s.advantage is not None
                                              for s in samples.values())
