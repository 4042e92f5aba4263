"""LoRA in the local train service (``service.train_service.lora``, peft): only the adapters train,
the engine is sent merged weights whose forward is the adapted model's, checkpoints hold the
adapter in PEFT's format beside a from_pretrained folder of the merged model, and a resume is
bit-exact."""

from __future__ import annotations

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.logprobs import compute_response_logprobs
from nexrl_torch.rollout.engine import HFInferenceEngine
from nexrl_torch.train.lora import ADAPTER_FOLDER
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import random_batch, train_step
from tests.support.weights import same_weights

LORA = {"rank": 4, "alpha": 8.0, "dropout": 0.0, "target_modules": "all-linear"}


def lora_service(model_dir, **extra):
    return LocalTorchTrainService({"model_path": model_dir, "lr": 1e-2, "seed": 3, "lora": dict(LORA), **extra})


def test_only_the_adapters_train_and_the_merged_weights_move(tiny_model_dir):
    service = lora_service(tiny_model_dir)
    base = LocalTorchTrainService({"model_path": tiny_model_dir}).export_weights(copy=True)
    trainable = [n for n, p in service.model.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    assert service.optimizer.param_groups[0]["params"] == [p for p in service.model.parameters() if p.requires_grad]
    before = service.export_weights(copy=True)
    assert same_weights(before, base)  # plain names, and B starts at zero: the merged model is the base

    for seed in range(3):
        metrics = train_step(service, random_batch(seed))
    assert metrics["grad_norm"] > 0
    after = service.export_weights()
    moved = {k for k in base if not torch.equal(after[k], base[k])}
    assert "model.layers.0.self_attn.q_proj.weight" in moved and "model.layers.1.mlp.down_proj.weight" in moved
    # Not adapted: embeddings, norms (and the tied LM head) stay the base's.
    assert not {k for k in moved if "norm" in k or "embed" in k or "lm_head" in k}
    frozen = {n: p for n, p in service.model.named_parameters() if ".base_layer." in n}
    assert frozen and all(torch.equal(p, base[n.replace(".base_layer", "")]) for n, p in frozen.items())


def test_the_engine_serves_the_adapted_model(tiny_model_dir):
    """The merged weights loaded into the in-process engine give the trainer's log-probs for the
    engine's own samples (what rollout correction and the on-policy ratio rely on)."""
    service = lora_service(tiny_model_dir)
    for seed in range(3):
        train_step(service, random_batch(seed))
    engine = HFInferenceEngine({"model_path": tiny_model_dir, "num_threads": 1})
    try:
        engine.load_weights(service.export_weights(), version=1)
        result = engine.complete("hello world", SamplingParams(max_tokens=8, temperature=1.0, seed=5))
        response = list(result.response_token_ids)
        ids = torch.tensor([list(result.prompt_token_ids) + response])
        mask = torch.ones_like(ids)
        with torch.no_grad():
            trainer = compute_response_logprobs(service.model, ids, mask, torch.arange(ids.shape[1])[None],
                                                len(response), 1.0)[0]
        engine_logprobs = torch.tensor(result.response_logprobs)
        # the adapted forward (base + B A x) against the merged one: float32 rounding only
        assert torch.allclose(trainer, engine_logprobs, atol=1e-4), (trainer - engine_logprobs).abs().max()
        # and not the base model's: the adapters changed what the engine serves
        base = LocalTorchTrainService({"model_path": tiny_model_dir})
        with torch.no_grad():
            untrained = compute_response_logprobs(base.model, ids, mask, torch.arange(ids.shape[1])[None],
                                                  len(response), 1.0)[0]
        assert (untrained - engine_logprobs).abs().max() > 1e-2
    finally:
        engine.close()


def test_a_checkpoint_holds_the_adapter_in_peft_format_and_resumes_bit_exact(tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = [random_batch(seed) for seed in range(4)]
    service = lora_service(tiny_model_dir, micro_batch_size=4)
    for batch in batches[:2]:  # the adapters move: equal weights below are not untrained ones
        assert train_step(service, batch)["grad_norm"] > 0
    ckpt = tmp_path / "global_step_2"
    service.save_checkpoint(ckpt, {"global_step": 2})
    state = torch.get_rng_state()
    for batch in batches[2:]:
        train_step(service, batch)
    expected = service.export_weights(copy=True)

    # PEFT loads the adapter onto the base; from_pretrained loads the merged model: both are the trainer's model.
    merged_then = AutoModelForCausalLM.from_pretrained(ckpt, local_files_only=True)
    adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True),
                                        str(ckpt / ADAPTER_FOLDER))
    ids = torch.tensor([[5, 9, 17, 33, 2, 41]])
    with torch.no_grad():
        assert torch.allclose(adapted(input_ids=ids).logits, merged_then(input_ids=ids).logits, atol=1e-5)

    fresh = lora_service(tiny_model_dir, micro_batch_size=4)
    assert fresh.load_checkpoint(ckpt) == {"global_step": 2}
    torch.set_rng_state(state)
    for batch in batches[2:]:
        train_step(fresh, batch)
    assert same_weights(expected, fresh.export_weights())


def test_a_checkpoint_and_a_recipe_that_disagree_on_lora_are_refused(tiny_model_dir, tmp_path):
    full = LocalTorchTrainService({"model_path": tiny_model_dir})
    full.save_checkpoint(tmp_path / "full", {})
    with pytest.raises(ValueError, match="holds no LoRA adapter"):
        lora_service(tiny_model_dir).load_checkpoint(tmp_path / "full")
    lora_service(tiny_model_dir).save_checkpoint(tmp_path / "lora", {})
    with pytest.raises(ValueError, match="holds a LoRA adapter; resume with the service.train_service.lora"):
        LocalTorchTrainService({"model_path": tiny_model_dir}).load_checkpoint(tmp_path / "lora")


def test_bad_lora_settings_name_the_key(tiny_model_dir):
    with pytest.raises(ValueError, match="lora.target_modules"):
        LocalTorchTrainService({"model_path": tiny_model_dir, "lora": {**LORA, "target_modules": ["no_such_proj"]}})


def test_a_bfloat16_base_halves_the_frozen_weights_and_the_float32_adapters_train(tiny_model_dir, tmp_path):
    """``lora.base_dtype: bfloat16`` (with the service's bf16 autocast): the frozen base weighs half
    of the float32 one, the adapters and what AdamW holds stay float32, the step trains them, the
    engine is sent the merged model in bf16, and a resume from a checkpoint is bit-exact."""
    def service(**extra):
        return LocalTorchTrainService({"model_path": tiny_model_dir, "lr": 1e-2, "seed": 3, "dtype": "bfloat16",
                                       "micro_batch_size": 4, "lora": {**LORA, **extra}})

    def frozen_bytes(svc):
        return sum(p.numel() * p.element_size() for p in svc.model.parameters() if not p.requires_grad)

    half, full = service(base_dtype="bfloat16"), service()
    assert frozen_bytes(half) * 2 == frozen_bytes(full)
    assert {p.dtype for p in half.model.parameters() if not p.requires_grad} == {torch.bfloat16}
    trainable = [p for p in half.model.parameters() if p.requires_grad]
    assert trainable and {p.dtype for p in trainable} == {torch.float32}
    base = full.export_weights(copy=True)

    batches = [random_batch(seed) for seed in range(4)]
    for batch in batches[:2]:
        assert train_step(half, batch)["grad_norm"] > 0
    merged = half.export_weights()
    assert merged["model.layers.0.self_attn.q_proj.weight"].dtype == torch.bfloat16
    assert not torch.equal(merged["model.layers.0.self_attn.q_proj.weight"].float(),
                           base["model.layers.0.self_attn.q_proj.weight"].to(torch.bfloat16).float())
    assert torch.equal(merged["model.norm.weight"], base["model.norm.weight"].to(torch.bfloat16))  # not adapted

    half.save_checkpoint(tmp_path / "ckpt", {"global_step": 2})
    state = torch.get_rng_state()
    for batch in batches[2:]:
        train_step(half, batch)
    resumed = service(base_dtype="bfloat16")
    resumed.load_checkpoint(tmp_path / "ckpt")
    torch.set_rng_state(state)
    for batch in batches[2:]:
        train_step(resumed, batch)
    assert same_weights(half.export_weights(), resumed.export_weights())


def test_a_bfloat16_base_needs_the_bf16_autocast(tiny_model_dir):
    with pytest.raises(ValueError, match=r"lora.base_dtype: bfloat16 needs dtype: bfloat16"):
        LocalTorchTrainService({"model_path": tiny_model_dir, "lora": {**LORA, "base_dtype": "bfloat16"}})


def test_validate_and_run_refuse_a_bfloat16_base_without_the_bf16_autocast(tiny_model_dir, tmp_path, capsys):
    import yaml

    from nexrl_core.cli import main
    from tests.support.letters import tiny_grpo_recipe

    recipe = tiny_grpo_recipe(tmp_path / "run", tiny_model_dir, group=2, steps=1,
                              service={"train_service": {"lora": {"base_dtype": "bfloat16"}}})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    for command in ("validate", "run"):
        assert main([command, str(path)]) == 2
        err = capsys.readouterr().err
        assert "service.train_service.lora.base_dtype: does nothing without service.train_service.dtype: bfloat16" \
            in err, err
    assert not (tmp_path / "run").exists()
