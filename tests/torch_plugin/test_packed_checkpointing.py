"""Activation checkpointing under packing: the backward computes each checkpointed layer's forward
again after the packed forward has returned, and that recomputation must attend per group block as
the forward did. Tiny random models of several families (built from their configs, float32): with
checkpointing, packed log-probs and every gradient are those of the same step without it, the
unpacked forward agrees, and less is kept from the forward for the backward."""

from __future__ import annotations

from functools import partial

import pytest
import torch

from nexrl_torch.logprobs import (
    compute_response_logprobs,
    compute_response_logprobs_packed,
    packing_problem,
    position_ids_from_mask,
)
from nexrl_torch.train.service import LocalTorchTrainService
from tests.grpo_plugin.test_train_service import grpo_loss
from tests.support.tiny_lm import build_tokenizer

COMMON = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              max_position_embeddings=512, head_dim=16, initializer_range=0.2)
FAMILIES = {
    "llama": dict(),
    "qwen3": dict(),  # q/k norms
    "gemma3_text": dict(sliding_window=512, query_pre_attn_scalar=16, final_logit_softcapping=30.0,
                        layer_types=["sliding_attention", "full_attention", "sliding_attention"]),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, decoder_sparse_step=1,
                      mlp_only_layers=[]),
}
VOCAB = 150


def _model(family: str, checkpointing: bool = False) -> torch.nn.Module:
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.for_model(family, vocab_size=VOCAB, **COMMON, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").train()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def _batch() -> dict[str, torch.Tensor]:
    """Three GRPO groups sharing their prompts (left-padded, of different lengths) with right-padded
    responses; the first group is long enough that its block attends in the split layout (prompt
    causal, each response over the prompt and itself), the others over their whole square."""
    g = torch.Generator().manual_seed(1)
    prompt, response = 16, 40
    groups = [(16, [40, 37, 33, 40, 29, 38, 40, 35]), (9, [12, 5, 9]), (13, [20, 1, 17, 8])]
    rows = sum(len(lengths) for _, lengths in groups)
    ids = torch.randint(3, VOCAB, (rows, prompt + response), generator=g)
    mask = torch.zeros_like(ids)
    prompt_groups = []
    row = 0
    for group, (prompt_len, lengths) in enumerate(groups):
        shared = torch.randint(3, VOCAB, (prompt_len,), generator=g)
        for length in lengths:
            ids[row, prompt - prompt_len:prompt] = shared
            mask[row, prompt - prompt_len:prompt + length] = 1
            prompt_groups.append(group)
            row += 1
    response_mask = mask[:, prompt:].float()
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "responses": ids[:, prompt:], "response_mask": response_mask,
            "prompt_groups": torch.tensor(prompt_groups),
            "advantages": torch.randn(rows, 1, generator=g) * response_mask,
            "old_log_probs": -3.0 + 0.1 * torch.randn(response_mask.shape, generator=g)}


def _saved_bytes(model: torch.nn.Module, run):
    """Bytes autograd keeps from the forward for the backward while ``run()`` runs (each storage
    once; the parameters left out), and what ``run()`` returned. A checkpointed layer keeps its
    inputs (saved through these hooks too) and nothing of its inside."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    kept: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in params:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        out = run()
    return sum(kept.values()), out


def _step(model: torch.nn.Module, batch: dict[str, torch.Tensor], packed: bool, max_tokens_per_pack: int = 2048):
    """Log-probs and every parameter's gradient of one weighted sum of them."""
    response = batch["responses"].shape[1]
    weights = torch.linspace(-1.0, 1.0, response)[None] * batch["response_mask"]
    model.zero_grad(set_to_none=True)
    if packed:
        logprobs = compute_response_logprobs_packed(model, batch["input_ids"], batch["attention_mask"],
                                                    batch["position_ids"], response, batch["prompt_groups"],
                                                    max_tokens_per_pack=max_tokens_per_pack)
    else:
        logprobs = compute_response_logprobs(model, batch["input_ids"], batch["attention_mask"],
                                             batch["position_ids"], response)
    (logprobs * weights).sum().backward()
    return logprobs.detach() * batch["response_mask"], {n: p.grad.clone() for n, p in model.named_parameters()
                                                        if p.grad is not None}


@pytest.mark.parametrize("family", list(FAMILIES))
def test_checkpointed_packed_step_is_the_step_without_checkpointing(family):
    batch = _batch()
    plain, checkpointed = _model(family), _model(family, checkpointing=True)
    assert checkpointed.model.layers[0].gradient_checkpointing and not plain.model.layers[0].gradient_checkpointing
    response = batch["responses"].shape[1]
    assert packing_problem(checkpointed, batch["attention_mask"], response) is None

    for max_tokens in (2048, 120):  # one pack; several, the long group split with its prompt repeated
        plain_bytes, (logprobs, grads) = _saved_bytes(plain, partial(_step, plain, batch, True, max_tokens))
        kept_bytes, (ck_logprobs, ck_grads) = _saved_bytes(checkpointed,
                                                           partial(_step, checkpointed, batch, True, max_tokens))
        torch.testing.assert_close(ck_logprobs, logprobs, atol=1e-6, rtol=1e-6)
        assert set(ck_grads) == {n for n, p in plain.named_parameters() if p.requires_grad} == set(grads)
        for name, grad in grads.items():
            torch.testing.assert_close(ck_grads[name], grad, atol=1e-6, rtol=1e-5, msg=name)
        # each layer keeps its input only: a fraction of what its attention and MLP keep
        assert kept_bytes < 0.5 * plain_bytes, (kept_bytes, plain_bytes)

    # and both are the unpacked transformers forward (checkpointed too)
    unpacked, unpacked_grads = _step(checkpointed, batch, packed=False)
    torch.testing.assert_close(ck_logprobs, unpacked, atol=1e-5, rtol=1e-5)
    for name, grad in unpacked_grads.items():
        torch.testing.assert_close(ck_grads[name], grad, atol=1e-4, rtol=1e-4, msg=name)


def test_the_routing_is_gone_after_the_packed_forward():
    """What the checkpointed recomputation relies on being restored: outside a packed forward (and
    its backward) the model attends through sdpa with its own checkpoint function."""
    model = _model("llama", checkpointing=True)
    layer = model.model.layers[0]
    checkpoint = layer._gradient_checkpointing_func
    _step(model, _batch(), packed=True)
    assert model.config._attn_implementation == "sdpa"
    assert layer._gradient_checkpointing_func is checkpoint


def test_checkpointing_the_packed_forward_cannot_route_is_a_packing_problem():
    """A layer checkpointed by its own means (not transformers' per-layer checkpoint function, which
    the packed forward routes) would recompute outside the group attention: packing names it."""
    model = _model("llama", checkpointing=True)
    batch = _batch()
    del model.model.layers[1]._gradient_checkpointing_func
    problem = packing_problem(model, batch["attention_mask"], batch["responses"].shape[1])
    assert problem is not None and problem.startswith("activation checkpointing not through transformers'")


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_the_train_service_checkpoints_packed_steps(family):
    """``activation_checkpointing: true`` turns it on, the batch is still packed (``packing: true``
    raises otherwise), and forward_backward's loss and gradients are those without it."""
    tokenizer = build_tokenizer()
    batch = _batch()
    results = {}
    for checkpointing in (False, True):
        service = LocalTorchTrainService({"packing": "true", "activation_checkpointing": checkpointing, "seed": 0},
                                         model=_model(family), tokenizer=tokenizer)
        assert service.model.model.layers[0].gradient_checkpointing is checkpointing
        metrics = service.forward_backward(batch, grpo_loss())
        results[checkpointing] = metrics["loss"], {n: p.grad.clone() for n, p in service.model.named_parameters()}
    assert results[True][0] == pytest.approx(results[False][0], rel=1e-6)
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, atol=1e-6, rtol=1e-5, msg=name)


def test_activation_checkpointing_is_a_boolean_key():
    from nexrl_core.config.options import check_options, component_options

    assert check_options({"activation_checkpointing": "sometimes"}, component_options(LocalTorchTrainService),
                         "service.train_service") == \
        ["service.train_service.activation_checkpointing: expected a boolean, got a string ('sometimes')"]
