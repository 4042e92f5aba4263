"""bf16 on the tiny Llama: the engine's bf16 decoding, the train service's mixed precision, and
how far each is from float32 (tolerances stated with each test)."""

from __future__ import annotations

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.models import load_causal_lm
from nexrl_torch.rollout.decoding import FastLlama, HFSession
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import grpo_loss, random_batch
from tests.support.kernels import compiled_kernels
from tests.torch_plugin.test_decoding import PROMPTS, SCRIPT, TOKENS, run_script, tiny

# bf16 keeps 8 bits of mantissa: a logit of magnitude L is off by up to ~L/256 per rounding, and
# the roundings of 3 layers add up (0.020 measured on the tiny models). Stated as a fraction of the
# largest logit.
BF16_LOGIT_TOLERANCE = 0.04
# Greedy decoding in bf16 may flip a near-tie and then continue differently; most tokens agree.
GREEDY_AGREEMENT = 0.8


def _mean_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    return float(torch.cat([(g.float() - w.float()).abs().flatten() for g, w in zip(got, want)]).mean())


def _relative_error(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    got, want = torch.cat([g.float() for g in got]), torch.cat([w.float() for w in want])
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("way", ["torch-ops", "compiled-kernels"])
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_bf16_fast_path_logits_are_close_to_float32_and_batch_invariant(kind, way):
    model = tiny(kind)
    reference = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)  # float32, the model's own forward
    half = tiny(kind).to(torch.bfloat16)
    kernels = compiled_kernels() if way == "compiled-kernels" else None
    fast = FastLlama(half, rows_hint=4, kernels=kernels)
    got = run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)
    assert fast.enabled, "the self-check must accept bf16 decoding (else the engine falls back to the slow path)"
    assert fast.kernels is kernels
    assert fast.batch_invariant
    assert {g.dtype for g in got} == {torch.bfloat16}
    error = _relative_error(got, reference)
    assert 0 < error <= BF16_LOGIT_TOLERANCE, error
    # As close to the float32 model as transformers' own bf16 forward (RMSNorm in float32 in both;
    # the decode step's attention runs in float32 here, so the two round differently there). On
    # average: the largest error is one rounding event and moves by half either way.
    transformers_bf16 = run_script(HFSession(half), PROMPTS, SCRIPT, TOKENS)
    assert _mean_error(got, reference) <= 1.1 * _mean_error(transformers_bf16, reference)
    assert _relative_error(got, transformers_bf16) <= BF16_LOGIT_TOLERANCE


def test_bf16_engine_greedy_tokens_agree_with_float32(tiny_model_dir):
    prompts = ["the quick brown fox", "what is two plus three?", "count: one, two", "hello world!",
               "grpo trains language models", "the lazy dog", "nine, ten", "jumps over"]
    params = SamplingParams(max_tokens=12, temperature=0.0)
    tokens, logprobs = {}, {}
    for dtype in ("float32", "bfloat16"):
        model, tokenizer = load_causal_lm(tiny_model_dir, dtype=dtype)
        engine = HFInferenceEngine({}, model=model, tokenizer=tokenizer)
        try:
            assert next(engine.model.parameters()).dtype == getattr(torch, dtype)
            results = [engine.complete(p, params) for p in prompts]
        finally:
            engine.close()
        tokens[dtype] = [r.response_token_ids for r in results]
        logprobs[dtype] = [r.response_logprobs for r in results]
    pairs = [(a, b) for x, y in zip(tokens["float32"], tokens["bfloat16"]) for a, b in zip(x, y)]
    assert len(pairs) >= 6 * len(prompts)
    agreement = sum(a == b for a, b in pairs) / len(pairs)
    assert agreement >= GREEDY_AGREEMENT, agreement
    # Where the continuations still match, the reported logprobs are float32 numbers close to float32's.
    first = [(x[0], y[0]) for x, y in zip(logprobs["float32"], logprobs["bfloat16"])]
    assert max(abs(a - b) for a, b in first) < 0.1


def test_bf16_training_keeps_float32_master_weights_and_follows_the_float32_gradient(tiny_model_dir):
    batch = random_batch(5, rows=8)
    services = {dtype: LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-3, "seed": 0, "dtype": dtype})
                for dtype in ("float32", "bfloat16")}
    log_probs, grads = {}, {}
    for dtype, service in services.items():
        log_probs[dtype] = service.forward(batch)
        service.forward_backward(batch, grpo_loss())
        grads[dtype] = torch.cat([p.grad.flatten() for p in service.model.parameters()])
        assert {p.grad.dtype for p in service.model.parameters()} == {torch.float32}
        service.optim_step()
        assert {p.dtype for p in service.model.parameters()} == {torch.float32}
        state = service.optimizer.state_dict()["state"]
        assert {v.dtype for s in state.values() for k, v in s.items() if k != "step"} == {torch.float32}
        assert log_probs[dtype].dtype == torch.float32
    # The key is not ignored: bf16 autocast really ran, and its numbers are bf16-close to float32's.
    mask = batch["response_mask"].bool()
    difference = (log_probs["bfloat16"] - log_probs["float32"])[mask].abs().max()
    assert 0 < difference < 0.1
    cosine = torch.nn.functional.cosine_similarity(grads["bfloat16"], grads["float32"], dim=0)
    assert cosine > 0.99, float(cosine)


def test_bf16_training_attends_in_float32_on_the_cpu(tiny_model_dir):
    """CPU flash attention's bf16 backward takes about twice as long as float32's: under bf16
    autocast the packed forward gives attention float32 inputs (whether SDPA or the block's own
    matmuls run it), and the rest stays bf16."""
    from torch.utils._python_dispatch import TorchDispatchMode

    seen: dict[str, set[torch.dtype]] = {"attention": set(), "mm": set()}

    class Dtypes(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.__name__
            if "scaled_dot_product" in name or name.startswith(("bmm.", "baddbmm.")):  # SDPA, or a block's matmuls
                seen["attention"].add(args[0].dtype)
            elif name.startswith("mm."):
                seen["mm"].add(args[0].dtype)
            return func(*args, **(kwargs or {}))

    service = LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-3, "seed": 0, "dtype": "bfloat16",
                                      "device": "cpu"})
    with Dtypes():
        service.forward_backward(random_batch(5, rows=8), grpo_loss())
    assert seen["attention"] == {torch.float32}
    assert torch.bfloat16 in seen["mm"]  # the projections still ran in bf16


def test_float16_training_and_unknown_precisions_are_refused(tiny_model_dir):
    for dtype in ("float16", "fp8"):
        with pytest.raises(ValueError, match="dtype: .* is not one of float32, bfloat16"):
            LocalTorchTrainService({"model_path": tiny_model_dir, "dtype": dtype})


@pytest.mark.parametrize("native", [True, False])
def test_auto_precision_is_bf16_only_where_the_cpu_computes_it_natively(tiny_model_dir, monkeypatch, native):
    """``dtype: auto`` on both sides follows the CPU (emulated bf16 runs slower than float32); the
    choice is said in the log. The CPU's flags are the one thing a test cannot switch: patched."""
    from loguru import logger

    import nexrl_torch.models as modeling

    monkeypatch.setattr(modeling, "native_bf16", lambda: native)
    expected = "bfloat16" if native else "float32"
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        service = LocalTorchTrainService({"model_path": tiny_model_dir, "dtype": "auto", "device": "cpu"})
        engine = HFInferenceEngine({"model_path": tiny_model_dir, "dtype": "auto", "device": "cpu"})
        engine.close()
    finally:
        logger.remove(sink)
    assert service.dtype == expected
    assert {p.dtype for p in service.model.parameters()} == {torch.float32}  # master weights either way
    assert next(engine.model.parameters()).dtype == getattr(torch, expected)
    said = [line for line in lines if "dtype auto -> " in line]
    assert len(said) == 2 and all(f"auto -> {expected} (" in line for line in said), lines


def test_the_critic_trains_in_the_policys_resolved_precision(tiny_model_dir, monkeypatch):
    """``dtype: auto`` resolves once, on the policy (one line in the log); the critic (gae) takes the
    resolved value."""
    from loguru import logger
    from omegaconf import OmegaConf

    import nexrl_torch.models as modeling
    from nexrl_core.testing import build_module
    from nexrl_grpo.trainers import SelfHostedGrpoTrainer
    from tests.support.letters import grpo_plugin_manager

    monkeypatch.setattr(modeling, "native_bf16", lambda: True)
    trainer = build_module(SelfHostedGrpoTrainer, OmegaConf.create({
        "seed": 0, "trainer": {"total_train_steps": 1}, "trajectory_pool": {"batch_size": 4},
        "rollout_worker": {}, "algorithm": {"type": "gae"},
        "service": {"train_service": {"model_path": tiny_model_dir, "dtype": "auto", "num_threads": 1,
                                          "device": "cpu"},
                    "inference_service": {}}}), pm=grpo_plugin_manager())
    lines: list[str] = []
    sink = logger.add(lines.append, level="INFO", format="{message}")
    try:
        trainer.initialize_workers()
    finally:
        logger.remove(sink)
    assert [line for line in lines if "dtype auto -> " in line] == [
        "train service dtype auto -> bfloat16 (this CPU computes bf16 natively)\n"], lines
    assert trainer.train_service.dtype == "bfloat16"
    assert trainer.critic is not None and trainer.critic.dtype == "bfloat16"
