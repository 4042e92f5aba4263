"""The families people train, as tiny random-initialised models built from their configs (fewer and
smaller layers): Llama, Qwen2, Qwen3 (q/k norms), Mistral, Gemma 3 text (its norms, soft-capping,
sliding layers) and Qwen3-MoE. For each: the trainer's packed log-probs equal the unpacked
transformers forward (or the batch is trained unpacked, when packing cannot serve it: Gemma 3's
sliding windows shorter than a row), the in-process engine's log-probs of its own samples equal the
trainer's, and LoRA adapters train on it."""

from __future__ import annotations

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.logprobs import (
    compute_response_logprobs,
    compute_response_logprobs_packed,
    packing_problem,
    position_ids_from_mask,
    sliding_window,
)
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import random_batch, train_step
from tests.support.tiny_lm import build_tokenizer

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=256, head_dim=16, initializer_range=0.2)
FAMILIES = {
    "llama": dict(rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
    "qwen2": dict(),
    "qwen3": dict(),
    "mistral": dict(sliding_window=None),
    "gemma3_text": dict(sliding_window=8, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention"]),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForCausalLM

    tokenizer = build_tokenizer()
    folders = {}
    for family, extra in FAMILIES.items():
        torch.manual_seed(0)
        config = AutoConfig.for_model(family, vocab_size=len(tokenizer), **COMMON, **extra)
        folder = tmp_path_factory.mktemp(family)
        AutoModelForCausalLM.from_config(config).save_pretrained(folder)
        tokenizer.save_pretrained(folder)
        folders[family] = str(folder)
    return folders


def _batch(vocab: int):
    g = torch.Generator().manual_seed(1)
    prompt, response = 12, 10
    ids = torch.randint(3, vocab, (4, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    mask[1, :5] = 0
    mask[2, -4:] = 0
    return ids, mask, response


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_trainers_log_probs_are_the_transformers_forward(family, family_dirs):
    service = LocalTorchTrainService({"model_path": family_dirs[family], "num_threads": 1})
    model = service.model.eval()
    assert model.config.model_type == family
    ids, mask, response = _batch(model.config.vocab_size)
    pos = position_ids_from_mask(mask)
    kept = mask[:, -response:].bool()
    with torch.no_grad():
        unpacked = compute_response_logprobs(model, ids, mask, pos, response)
        problem = packing_problem(model, mask, response)
        if family == "gemma3_text":  # rows of 22 tokens over windows of 8: packing would attend past the window
            assert problem == "sliding-window attention (window 8) over rows of up to 22 tokens"
        else:
            assert problem is None and sliding_window(model) is None
            packed = compute_response_logprobs_packed(model, ids, mask, pos, response, None, 1.0, 2048, 0)
            assert (packed - unpacked)[kept].abs().max() < 1e-5
        # what the service computes for a batch (packing: auto) is the same either way
        batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -response:],
                 "response_mask": mask[:, -response:].float()}
        assert (service.forward(batch) - unpacked)[kept].abs().max() < 1e-5


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_engine_scores_its_samples_as_the_trainer_does(family, family_dirs):
    engine = HFInferenceEngine({"model_path": family_dirs[family], "num_threads": 1})
    service = LocalTorchTrainService({"model_path": family_dirs[family], "num_threads": 1})
    try:
        results = [engine.complete(prompt, SamplingParams(max_tokens=8, temperature=1.0, seed=seed))
                   for seed, prompt in enumerate(["hello world", "the quick brown", "count: one two"])]
    finally:
        engine.close()
    scored = service.score([(r.prompt_token_ids, r.response_token_ids, 1.0) for r in results])
    for result, trainer in zip(results, scored):
        assert len(result.response_token_ids) > 0
        gap = max(abs(a - b) for a, b in zip(result.response_logprobs, trainer))
        assert gap < 1e-4, (family, gap)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_lora_adapters_train_on_each_family(family, family_dirs):
    base = LocalTorchTrainService({"model_path": family_dirs[family]}).export_weights(copy=True)
    service = LocalTorchTrainService({"model_path": family_dirs[family], "lr": 1e-2, "seed": 3,
                                      "lora": {"rank": 4, "alpha": 8}})
    vocab = service.model.config.vocab_size
    for seed in range(2):
        assert train_step(service, random_batch(seed, vocab=min(vocab, 150)))["grad_norm"] > 0
    merged = service.export_weights()
    assert merged.keys() == base.keys()  # the engine gets the names it loads
    assert any(not torch.equal(merged[k], base[k]) for k in base)
    # a model without adapters holding the merged weights computes what the adapted model does
    from transformers import AutoModelForCausalLM

    plain = AutoModelForCausalLM.from_pretrained(family_dirs[family], local_files_only=True).float().eval()
    plain.load_state_dict(merged)
    ids = torch.tensor([[5, 9, 17, 33, 2, 41, 7, 12]])
    service.model.eval()
    with torch.no_grad():
        assert torch.allclose(plain(input_ids=ids).logits, service.model(input_ids=ids).logits, atol=1e-4)
