"""Gemma 3 text and Qwen3-MoE on the engine's batch-invariant fast decoding path: tiny random models
with the real configs' kinds of settings (Gemma 3: sliding and full layers with their own rotary
bases and a linear-scaled global one, a window shorter than the sequences, query_pre_attn_scalar,
(1 + w) norms with non-trivial weights, final soft-capping; Qwen3-MoE: a softmax router over 8
experts, top 2, with and without norm_topk_prob, dense layers by mlp_only_layers and
decoder_sparse_step). The fast path's logits equal the transformers forward in float32; a row's
logits are the same bits whatever it is batched with; the engine samples what the transformers
forward samples."""

from __future__ import annotations

import json

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.rollout.decoding import (
    FastLlama,
    HFSession,
    StaticLlama,
    StaticSession,
    config_fast_path_problem,
    fast_path_problem,
    kernel_problem,
    make_session_factory,
)
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.tiny_lm import build_tokenizer
from tests.torch_plugin.test_decoding import PROMPTS, SCRIPT, TOKENS, run_script

COMMON = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, bos_token_id=None,
              eos_token_id=1)
WINDOW = 4  # shorter than every sequence below past its first steps
# Gemma-3-4B's kinds of settings at a tiny shape: local layers (base 10k) and a global one (base 1M,
# linear rope scaling 8), query_pre_attn_scalar unlike head_dim, soft-capped logits.
GEMMA3 = dict(sliding_window=WINDOW, query_pre_attn_scalar=20, final_logit_softcapping=5.0,
              layer_types=["sliding_attention", "full_attention", "sliding_attention"],
              rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                               "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}})
# Qwen3-30B-A3B's (128 experts, top 8, normalised, every layer sparse) at 8 experts, top 2.
QWEN3_MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, norm_topk_prob=True,
                 decoder_sparse_step=1, mlp_only_layers=[1])
VARIANTS = {
    "gemma3_text": ("gemma3_text", GEMMA3),
    "qwen3_moe": ("qwen3_moe", QWEN3_MOE),
    # unnormalised top-k weights; every other layer dense by decoder_sparse_step
    "qwen3_moe-unnormalised": ("qwen3_moe", {**QWEN3_MOE, "norm_topk_prob": False, "decoder_sparse_step": 2,
                                             "mlp_only_layers": []}),
}


def build(variant: str, vocab: int = 97, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    kind, extra = VARIANTS[variant]
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=vocab, **COMMON, **extra)).eval()
    with torch.no_grad():  # norms as trained ones are: Gemma's start at w = 0 (a scale of 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3) if kind == "gemma3_text" else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("path", ["fast", "static"])
def test_the_fast_path_computes_the_transformers_forward(variant, path):
    """Prefill, a GRPO group's expansion, lazy drops, compaction, reordering (the StaticLlama layout
    runs here eagerly, its CPU twin): float32 logits within 2e-5 of the model's own forward."""
    model = build(variant)
    assert fast_path_problem(model) is None
    if variant.startswith("qwen3_moe"):  # the layouts the config asks for: sparse and dense layers
        sparse = [hasattr(layer.mlp, "experts") for layer in model.model.layers]
        assert sparse == ([True, False, True] if variant == "qwen3_moe" else [False, True, False])
    fast = FastLlama(model, rows_hint=4) if path == "fast" else StaticLlama(model, rows_hint=4, kv_tokens=4096)
    session = fast.session()
    assert fast.enabled and (path == "fast" or isinstance(session, StaticSession))  # the self-check passed
    got = run_script(session, PROMPTS, SCRIPT, TOKENS)
    want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


def _decode(fast: FastLlama, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    """Logits of ``prompts`` prefilled together, then ``steps`` steps of token 7 + step for every row."""
    tokens = [[7 + step] * len(prompts) for step in range(steps)]
    return run_script(fast.session(), prompts, [None] * steps, tokens)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_a_rows_logits_do_not_depend_on_its_batch(variant):
    """Bit for bit: one prompt decoded alone, then beside a longer and a shorter neighbour, in
    batches of 5 and 12 random prompts at different places (MoE: the experts then see 1 to 20
    tokens, the row's own among them), and through a script that duplicates, drops and reorders."""
    model = build(variant)
    fast = FastLlama(model, rows_hint=4)
    target, steps = [12, 13, 14, 15, 16, 17, 18], 8  # longer than the window, and the steps go on past it
    alone = _decode(fast, [target], steps)
    assert fast.batch_invariant  # what the self-check found on this machine
    g = torch.Generator().manual_seed(5)

    def others(n):
        return [torch.randint(2, 97, (int(torch.randint(1, 11, (1,), generator=g)),), generator=g).tolist()
                for _ in range(n)]

    for batch, where in [([PROMPTS[0], target, PROMPTS[1]], 1), (others(4) + [target], 4),
                         (others(5) + [target] + others(6), 5), ([target] + others(11), 0)]:
        together = _decode(fast, batch, steps)
        for step, (b, a) in enumerate(zip(together, alone)):
            assert torch.equal(b[where], a[0]), (len(batch), where, step)
    script = [[0, 0, 1, 1, 2, 2], None, [1, 2, 3, 5], None, [2, 0], None]
    tokens = [[9 + i] * (len(sel) if sel else n) for i, (sel, n) in enumerate(zip(script, [6, 6, 4, 4, 2, 2]))]
    batched = run_script(fast.session(), PROMPTS, script, tokens)
    alone = run_script(fast.session(), [PROMPTS[1]], [None] * len(script), [t[:1] for t in tokens])
    for step, (b, a, row) in enumerate(zip(batched, alone, [1, 3, 3, 2, 2, 0, 0])):
        assert torch.equal(b[row], a[0]), f"script output {step}"


def test_the_sliding_window_is_what_gemma_computes():
    """The prompts and steps run past the window (4): the fast path with its layers' windows
    dropped (a path that ignored them) is far from the transformers forward, in the prefill and
    in the decode steps, where the path as it is agrees to 2e-5."""
    model = build("gemma3_text")
    fast = FastLlama(model, rows_hint=4)
    fast.session()  # packs the layers
    assert [layer.window for layer in fast.layers] == [WINDOW, None, WINDOW]
    want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
    for layer in fast.layers:
        layer.window = None
    ignored = run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)
    assert float((ignored[0] - want[0]).abs().max()) > 1e-2  # the prefill (a 7-token prompt)
    assert float((ignored[-1] - want[-1]).abs().max()) > 1e-2  # a step 8 columns further
    # the rotary bases per layer type matter too: the global layer's, given to every layer, is wrong
    fast = FastLlama(model, rows_hint=4)
    fast.session()
    for layer in fast.layers:
        layer.rope = "full_attention"
    assert float((run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)[-1] - want[-1]).abs().max()) > 1e-2


def test_mistral_and_qwen2_sliding_windows_are_on_the_fast_path():
    """The same window code serves Mistral's (every layer) and Qwen2's (layers past max_window_layers)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    for kind, extra in [("mistral", dict(sliding_window=WINDOW)),
                        ("qwen2", dict(use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1))]:
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, vocab_size=97, **COMMON, **extra)).eval()
        assert fast_path_problem(model) is None
        fast = FastLlama(model, rows_hint=4)
        got = run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)
        assert fast.enabled and any(layer.window == WINDOW for layer in fast.layers)
        for g, w in zip(got, run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)):
            torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


REQUEST_PROMPTS = [f"count: one two three, what is {i} plus {i + 3}? the quick brown fox" for i in range(16)]


@pytest.mark.parametrize("variant", ["gemma3_text", "qwen3_moe"])
def test_the_engine_samples_what_the_transformers_forward_samples(variant, tokenizer):
    """16 seeded requests batched on the fast path against each decoded alone through the
    transformers forward: the same tokens, log-probs within 1e-5; and a request decoded alone on
    the fast path gets exactly the tokens and log-probs it got among the 16."""
    model = build(variant, vocab=len(tokenizer))
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=s) for s in range(len(REQUEST_PROMPTS))]
    engines = {path: HFInferenceEngine({"fast_path": path == "fast", "chat_template": False,
                                        "max_batch_size": 16 if path == "fast" else 1, "num_threads": 1},
                                       model=model, tokenizer=tokenizer) for path in ("fast", "transformers")}
    try:
        fast = engines["fast"].complete_many(list(zip(REQUEST_PROMPTS, params)))
        reference = [engines["transformers"].complete(p, s) for p, s in zip(REQUEST_PROMPTS, params)]
        alone = engines["fast"].complete(REQUEST_PROMPTS[5], params[5])
    finally:
        for engine in engines.values():
            engine.close()
    assert sum(len(r.response_token_ids) for r in fast) > 8 * len(fast)  # past the window
    for got, want in zip(fast, reference):
        assert got.response_token_ids == want.response_token_ids
        assert got.response_logprobs == pytest.approx(want.response_logprobs, abs=1e-5)
    assert alone.response_token_ids == fast[5].response_token_ids
    assert alone.response_logprobs == fast[5].response_logprobs


def test_the_families_are_named_on_the_fast_path_before_loading(tmp_path):
    """`nexrl validate` reads config.json: Gemma 3 and Qwen3-MoE are served fast, as Mistral with a
    sliding window now is; a model_type off the path, or Gemma's bidirectional variant, is named."""
    def problem(config):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        return config_fast_path_problem(str(folder))

    for variant in VARIANTS:
        assert problem(build(variant).config.to_dict()) is None, variant
    assert problem({"model_type": "mistral", "sliding_window": 4096}) is None
    assert problem({"model_type": "gpt2"}) == ("model_type 'gpt2' is not on the fast decoding path (llama, qwen2, "
                                              "qwen3, mistral, gemma3_text, qwen3_moe)")
    assert "bidirectional" in problem({"model_type": "gemma3_text", "use_bidirectional_attention": True})


def test_the_compiled_kernels_leave_these_families_to_torch_ops():
    """The kernels compute Llama-shaped layers attending over every key: Gemma 3, Qwen3-MoE and any
    sliding window decode through torch ops, and `cpu_kernels: true` says why."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from nexrl_torch.rollout import decoding

    torch.manual_seed(0)
    mistral = AutoModelForCausalLM.from_config(AutoConfig.for_model("mistral", vocab_size=97, **COMMON,
                                                                    sliding_window=WINDOW)).eval()
    for model in (build("gemma3_text"), build("qwen3_moe"), mistral):
        problem = kernel_problem(model)
        if decoding.nexrl_torch_kernels is not None:
            assert ("model_type" in problem) if model is not mistral else ("sliding-window" in problem)
        decoder = make_session_factory(model, "auto", 4, cpu_kernels="auto")
        assert isinstance(decoder, FastLlama) and decoder.kernels is None
        with pytest.raises(ValueError, match="cpu_kernels: true, but"):
            make_session_factory(model, "auto", 4, cpu_kernels="true")


@pytest.mark.parametrize("variant", ["gemma3_text", "qwen3_moe"])
def test_static_refresh_keeps_addresses_and_serves_new_weights(variant):
    """Weights updated in place reach the packed matrices and Gemma's (1 + w) norm scales at the
    same addresses: what a captured CUDA graph keeps reading (float64: the GPU's unpacked layout)."""
    model = build(variant).double()
    model.config._experts_implementation = "eager"  # transformers' default (grouped_mm) takes no float64
    static = StaticLlama(model, kv_tokens=4096)
    before = run_script(static.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])

    def addresses():
        norms = [norm[0] for layer in static.layers for norm in (layer.norm_in, layer.norm_post, layer.q_norm)]
        return [t.data_ptr() for t in [*norms, static.final_norm[0]] + [layer.qkv.weight for layer in static.layers]]

    kept = addresses()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = run_script(static.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])
    assert addresses() == kept
    assert not torch.allclose(before[-1], after[-1])
    for g, w in zip(after, run_script(HFSession(model), PROMPTS, SCRIPT[:2], TOKENS[:2])):
        torch.testing.assert_close(g, w, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("variant", ["gemma3_text", "qwen3_moe"])
def test_bf16_models_pass_the_self_check(variant):
    """In bfloat16 (Gemma's norms scale in float32 before the cast, Llama's after) the fast path
    stays on: its self-check against the transformers forward passes."""
    fast = FastLlama(build(variant).to(torch.bfloat16), rows_hint=4)
    with torch.inference_mode():
        fast.session()
    assert fast.enabled
