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


def _largest_saved_activation(model, run) -> tuple[int, object]:
    """Bytes of the largest tensor autograd keeps for the backward while ``run()`` runs (parameters
    and views of them left out: what a forward holds on to until its backward), and what it returned."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    largest = 0

    def pack(tensor):
        nonlocal largest
        if tensor.untyped_storage().data_ptr() not in params:
            largest = max(largest, tensor.numel() * tensor.element_size())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return largest, out


def test_a_qwen3_vocabulary_never_keeps_token_by_vocabulary_logits(tmp_path, monkeypatch):
    """Qwen3's 151,936-word head over 512 scored positions: float32 logits [512, V] would be 311 MB
    kept from the forward to the backward. The packed forward keeps none above its budget (256 MiB):
    the rows go through in slices and the backward computes them again; log-probs and gradients
    are those of the path that keeps them."""
    from transformers import AutoConfig, AutoModelForCausalLM

    import nexrl_torch.logprobs as modeling

    torch.manual_seed(0)
    config = AutoConfig.for_model("qwen3", vocab_size=151936, **{**COMMON, "num_hidden_layers": 1})
    model = AutoModelForCausalLM.from_config(config).train()
    g = torch.Generator().manual_seed(3)
    rows, prompt, response = 8, 16, 64
    ids = torch.randint(3, 151936, (rows, prompt + response), generator=g)
    mask = torch.ones_like(ids)
    pos = position_ids_from_mask(mask)
    weights = torch.randn(rows, response, generator=g)
    logits_bytes = rows * response * 151936 * 4
    assert logits_bytes > modeling._SAVED_LOGITS_BUDGET and len(modeling._row_slices(rows * response, 151936)) == 2

    def run():
        model.zero_grad(set_to_none=True)
        logprobs = compute_response_logprobs_packed(model, ids, mask, pos, response, temperature=0.9)
        (logprobs * weights).sum().backward()
        return logprobs.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    sliced_largest, (sliced, sliced_grads) = _largest_saved_activation(model, run)
    assert sliced_largest < modeling._SAVED_LOGITS_BUDGET, sliced_largest
    monkeypatch.setattr(modeling, "_SAVED_LOGITS_BUDGET", 2 * logits_bytes)
    kept_largest, (kept, kept_grads) = _largest_saved_activation(model, run)
    assert kept_largest >= logits_bytes  # the check sees the logits when they are kept
    torch.testing.assert_close(sliced, kept, atol=1e-5, rtol=1e-5)
    assert set(sliced_grads) == set(kept_grads)
    for name, grad in kept_grads.items():
        torch.testing.assert_close(sliced_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("family", ["qwen3", "mistral", "gemma3_text", "qwen3_moe", "gemma3_text-bidirectional"])
def test_validate_says_which_models_the_fast_path_cannot_serve(family, family_dirs, cli, tmp_path):
    """Never silently slow: a model the engine's fast decoding path cannot serve is a note from
    `nexrl validate` (and `nexrl run`), before any weight is loaded; one it serves gets none."""
    import json
    import shutil

    import yaml

    from tests.support.torch_fixtures import tiny_services

    folder = family_dirs[family.split("-")[0]]
    if family.endswith("-bidirectional"):  # Gemma's encoder-style variant: off the fast path
        folder = shutil.copytree(folder, tmp_path / "model")
        config = json.loads((folder / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, "use_bidirectional_attention": True}))
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump({
        "run_dir": str(tmp_path / "run"), "data": {"type": "inline", "rows": [{"prompt": "hi", "answer": "x"}]},
        "rollout_worker": {"num_workers": 1, "evaluator": {"type": "exact_match"}},
        "trajectory_pool": {"batch_size": 2, "group_size": 2}, "weight": {"backend": "in_process"},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 1},
        "service": tiny_services(str(folder))}))
    code, out, errors, err = cli("validate", str(recipe))
    assert code == 0, err
    notes = [line for line in err.splitlines() if "fast decoding path" in line]
    if not family.endswith("-bidirectional"):
        assert notes == []
    else:
        assert notes == ["note: service.inference_service: bidirectional attention (use_bidirectional_attention) is "
                         "not on the fast decoding path: the engine decodes through the transformers forward, "
                         "slower, and runs with several rollout workers are not bit-reproducible (unless "
                         "max_batch_size: 1)"]
