from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
import torch

from nexrl_core import algorithms
from nexrl_core.runtime.inference import SamplingParams
from nexrl_grpo import losses
from nexrl_torch.logprobs import position_ids_from_mask
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService

PAD = 0


def make_batch(prompts: list[list[int]], responses: list[list[int]]) -> dict[str, torch.Tensor]:
    """verl layout: left-padded prompts, right-padded responses."""
    p_len = max(map(len, prompts))
    r_len = max(map(len, responses))
    rows = [[PAD] * (p_len - len(p)) + p + r + [PAD] * (r_len - len(r)) for p, r in zip(prompts, responses)]
    masks = [[0] * (p_len - len(p)) + [1] * (len(p) + len(r)) + [0] * (r_len - len(r)) for p, r in zip(prompts, responses)]
    attention_mask = torch.tensor(masks)
    input_ids = torch.tensor(rows)
    return {
        "input_ids": input_ids,
        "attention_mask": attention_mask,
        "position_ids": position_ids_from_mask(attention_mask),
        "responses": input_ids[:, p_len:],
        "response_mask": attention_mask[:, p_len:].float(),
    }


def random_batch(seed: int, rows: int = 6, vocab: int = 150) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    lens = torch.randint(1, 6, (rows, 2), generator=g).tolist()
    prompts = [torch.randint(3, vocab, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(3, vocab, (r,), generator=g).tolist() for _, r in lens]
    batch = make_batch(prompts, responses)
    batch["advantages"] = torch.randn(rows, 1, generator=g) * batch["response_mask"]
    batch["old_log_probs"] = -3.0 + 0.1 * torch.randn(batch["responses"].shape, generator=g)
    return batch


def grpo_loss(mode: str = "seq-mean-token-mean"):
    def loss_fn(log_probs, mb):
        context = losses.LossContext(mb["batch_num_seqs"], mb["batch_num_tokens"], max_response_length=8)
        return losses.ppo_clip(log_probs, mb["old_log_probs"], mb["advantages"], mb["response_mask"], context,
                               loss_agg_mode=mode)

    return loss_fn


def train_step(service: LocalTorchTrainService, batch: dict) -> dict:
    # Consume torch RNG like a stochastic trainer would, so the restored RNG state matters.
    keep = (torch.rand(batch["response_mask"].shape) > 0.2).float()
    metrics = service.forward_backward({**batch, "response_mask": batch["response_mask"] * keep}, grpo_loss())
    return {**metrics, **service.optim_step()}


def test_checkpoint_round_trip_is_bit_exact(tiny_model_dir, tmp_path):
    config = {"model_path": tiny_model_dir, "lr": 1e-3, "seed": 3, "micro_batch_size": 4, "grad_clip": 0.5}
    batches = [random_batch(seed) for seed in range(4)]
    service = LocalTorchTrainService(config)
    for batch in batches[:2]:
        metrics = train_step(service, batch)
    assert set(metrics) >= {"loss", "pg_clipfrac", "ppo_kl", "grad_norm", "lr"} and metrics["lr"] == 1e-3

    ckpt = tmp_path / "global_step_2"
    service.save_checkpoint(ckpt, {"global_step": 2, "note": "x"})
    states = (random.getstate(), np.random.get_state(), torch.get_rng_state())
    draws = (random.random(), float(np.random.rand()), torch.rand(3))
    random.setstate(states[0]), np.random.set_state(states[1]), torch.set_rng_state(states[2])
    for batch in batches[2:]:
        train_step(service, batch)
    expected = service.export_weights(copy=True)

    fresh = LocalTorchTrainService(config)
    assert fresh.load_checkpoint(ckpt) == {"global_step": 2, "note": "x"}
    assert (random.random(), float(np.random.rand())) == draws[:2] and torch.equal(torch.rand(3), draws[2])
    fresh.load_checkpoint(ckpt)
    for batch in batches[2:]:
        train_step(fresh, batch)
    got = fresh.export_weights()
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(expected[name], got[name]), name


def test_checkpoint_folder_is_hf_loadable_and_pickle_free(tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    service = LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-2})
    train_step(service, random_batch(0))
    service.save_checkpoint(tmp_path / "ckpt", {})
    files = sorted(p.name for p in (tmp_path / "ckpt").iterdir())
    assert {"model.safetensors", "optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "extra_state.json"} <= set(files)
    for path in (tmp_path / "ckpt").iterdir():
        head = path.read_bytes()[:4]
        assert not head.startswith(b"\x80") and head != b"PK\x03\x04", f"{path.name} looks like a pickle / torch.save file"
        assert path.suffix not in {".bin", ".pt", ".pth", ".pkl"}
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "ckpt", local_files_only=True)
    for name, tensor in service.export_weights().items():
        assert torch.equal(loaded.state_dict()[name], tensor), name
    # Leftover temp folders would be mistaken for checkpoints.
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]


@pytest.mark.parametrize("mode", losses.LOSS_AGG_MODES)
def test_micro_batches_accumulate_the_full_batch_gradient(tiny_model_dir, mode):
    service = LocalTorchTrainService({"model_path": tiny_model_dir})
    batch = random_batch(11, rows=7)
    batch["response_mask"][2] = 0.0  # a row with no valid token must not shift the averages

    grads = {}
    for micro in (None, 3):
        service.micro_batch_size = micro
        metrics = service.forward_backward(batch, grpo_loss(mode))
        grads[micro] = ([p.grad.clone() for p in service.model.parameters()], metrics)
        service.optimizer.zero_grad(set_to_none=True)
    (full, full_metrics), (split, split_metrics) = grads[None], grads[3]
    for a, b in zip(full, split):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert split_metrics["loss"] == pytest.approx(full_metrics["loss"], abs=1e-6)
    assert split_metrics["pg_clipfrac"] == pytest.approx(full_metrics["pg_clipfrac"], abs=1e-6)
    assert split_metrics["ppo_kl"] == pytest.approx(full_metrics["ppo_kl"], abs=1e-6)
    with torch.no_grad():
        torch.testing.assert_close(service.forward(batch), torch.cat([service.forward({k: v[i : i + 1] for k, v in batch.items()}) for i in range(7)]))


def test_missing_batch_key_is_named(tiny_model_dir):
    service = LocalTorchTrainService({"model_path": tiny_model_dir})
    batch = random_batch(0)
    del batch["responses"]
    with pytest.raises(ValueError, match="responses"):
        service.forward(batch)


# Step 1's trainer log-probs against the engine's (the same weights): float32 on both sides agree to
# summation order; bf16 on both sides (autocast trainer, bf16 engine) to bf16's rounding of logits (8 bits
# of mantissa: ~0.04 on each side for the tiny model's logits of ~10).
ON_POLICY_TOLERANCE = {"float32": 1e-4, "bfloat16": 0.1}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_grpo_steps_move_the_reward(tiny_model_dir, dtype):
    """Rollouts from the engine, GRPO on the service, weights pushed back: P(even token) rises, in
    float32 and in bf16 (mixed-precision trainer, bf16 engine)."""
    service = LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 3e-2, "seed": 0, "dtype": dtype})
    model, tokenizer = load_causal_lm(tiny_model_dir, dtype=dtype)
    engine = HFInferenceEngine({"batch_wait_ms": 20}, model=model, tokenizer=tokenizer)
    prompt = [{"role": "user", "content": "count: one, two"}]
    prompt_ids = engine.encode_prompt(prompt)
    even = torch.arange(len(tokenizer)) % 2 == 0

    def p_even() -> float:
        with torch.no_grad():
            probs = service.model(torch.tensor([prompt_ids])).logits[0, -1].softmax(-1)
        return probs[even].sum().item()

    before = p_even()
    try:
        for step in range(6):
            params = [SamplingParams(max_tokens=1, temperature=1.0, seed=100 * step + i) for i in range(16)]
            with ThreadPoolExecutor(16) as pool:
                results = list(pool.map(lambda sp: engine.complete(prompt, sp), params))
            assert {r.model_version for r in results} == {step}
            batch = make_batch([r.prompt_token_ids for r in results], [r.response_token_ids for r in results])
            rewards = torch.tensor([1.0 if r.response_token_ids[0] % 2 == 0 else 0.0 for r in results])
            mask = batch["response_mask"].numpy()
            token_rewards = algorithms.scores_to_token_level(rewards.numpy(), mask)
            adv, _ = algorithms.grpo(algorithms.AdvantageInputs(token_rewards, mask, [0] * 16))
            batch["advantages"] = torch.from_numpy(adv)
            # On-policy: the engine's logprobs are the old logprobs.
            batch["old_log_probs"] = torch.tensor([r.response_logprobs for r in results])
            if step == 0:
                torch.testing.assert_close(service.forward(batch), batch["old_log_probs"],
                                           atol=ON_POLICY_TOLERANCE[dtype], rtol=0)
            service.forward_backward(batch, grpo_loss())
            service.optim_step()
            engine.load_weights(service.export_weights(), step + 1)
    finally:
        engine.close()
    after = p_even()
    assert after > before + 0.2, (before, after)
