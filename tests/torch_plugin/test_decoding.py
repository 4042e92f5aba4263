"""The fast decoding path against the model's own forward, and the engine's sampler."""

from __future__ import annotations

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_core.runtime.run_log import LOG_FILE, setup_logging
from nexrl_torch.rollout.decoding import (
    FastLlama,
    FastLlamaSession,
    HFSession,
    decode_attention,
    fast_path_problem,
    make_session_factory,
)
from nexrl_torch.rollout.engine import HFInferenceEngine, _counter_draw, _generator_draw, _sample
from tests.support.kernels import compiled_kernels


@pytest.fixture(params=["torch-ops", "compiled-kernels"])
def kernels(request):
    """The fast path's decode steps both ways: torch ops, and the compiled CPU kernels."""
    return None if request.param == "torch-ops" else compiled_kernels()


def tiny(kind: str, vocab: int = 97, seed: int = 0, **extra):
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    common = dict(vocab_size=vocab, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                  initializer_range=0.2, pad_token_id=0, bos_token_id=None, eos_token_id=1)
    torch.manual_seed(seed)
    if kind == "llama":
        return LlamaForCausalLM(LlamaConfig(**{**common, **extra})).eval()
    if kind == "qwen2":  # q/k/v biases, o_proj without
        model = Qwen2ForCausalLM(Qwen2Config(**{**common, **extra})).eval()
        with torch.no_grad():
            for layer in model.model.layers:
                for lin in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    lin.bias.normal_(0, 0.5)
        return model
    if kind in ("qwen3", "mistral"):  # qwen3: per-head q/k norms (given non-trivial weights here)
        from transformers import AutoConfig, AutoModelForCausalLM

        head = {"head_dim": 12} if kind == "qwen3" else {"sliding_window": None}
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(kind, **common, **head, **extra)).eval()
        if kind == "qwen3":
            with torch.no_grad():
                for layer in model.model.layers:
                    layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                    layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
        return model
    raise ValueError(kind)


def left_padded(rows: list[list[int]]):
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, width - len(r):] = torch.tensor(r)
        mask[i, width - len(r):] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run_script(session, prompts, script, steps_tokens):
    """Prefill ``prompts``, then alternate select(rows) and one step; returns every logits tensor."""
    with torch.inference_mode():
        return _run_script(session, prompts, script, steps_tokens)


def _run_script(session, prompts, script, steps_tokens):
    ids, mask, pos = left_padded(prompts)
    out = [session.prefill(ids, mask, pos)]
    next_pos = pos[:, -1] + 1
    for rows, tokens in zip(script, steps_tokens):
        if rows is not None:
            idx = torch.tensor(rows)
            session.select(idx)
            next_pos = next_pos[idx]
        out.append(session.step(torch.tensor(tokens), next_pos))
        next_pos = next_pos + 1
    return out


# select(): expand 3 distinct prompts to 6 rows, drop one (kept lazily), drop more (compaction),
# reorder, and a step with no change.
SCRIPT = [[0, 0, 1, 1, 2, 2], None, [0, 1, 2, 3, 5], None, [4, 0, 2], None, [2, 0], None]
TOKENS = [[5, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15, 16], [17, 18, 19, 20, 21], [22, 23, 24, 25, 26],
          [27, 28, 29], [30, 31, 32], [33, 34], [35, 36]]
PROMPTS = [[3, 4, 5, 6, 7, 8, 9], [10, 11], [12, 13, 14, 15]]


def _kernels_for(model, kernels):
    """The compiled kernels where they can run the model (not Qwen3's q/k norms: torch ops then)."""
    from nexrl_torch.rollout.decoding import kernel_problem

    return kernels if kernels is None or kernel_problem(model) is None else None


@pytest.mark.parametrize("kind,extra", [("llama", {}), ("llama", {"tie_word_embeddings": False}),
                                        ("llama", {"attention_bias": True, "mlp_bias": True}), ("qwen2", {}),
                                        ("qwen3", {}), ("mistral", {})])
def test_fast_session_matches_model_forward(kind, extra, kernels):
    model = tiny(kind, **extra)
    assert fast_path_problem(model) is None
    kernels = _kernels_for(model, kernels)
    fast = FastLlama(model, rows_hint=4, kernels=kernels)
    got = run_script(fast.session(), PROMPTS, SCRIPT, TOKENS)
    want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
    assert fast.enabled and fast.kernels is kernels
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "mistral"])
def test_a_rows_logits_do_not_depend_on_its_batch(kind, kernels):
    """Bit for bit: PROMPTS[1] decoded alone, and after a longer and a shorter neighbour, duplicated,
    with rows dropped lazily, then compacted and reordered (what makes seeded rollouts reproducible
    whichever requests the engine batched them with)."""
    model = tiny(kind)
    fast = FastLlama(model, rows_hint=4, kernels=_kernels_for(model, kernels))
    script = [[0, 0, 1, 1, 2, 2], None, [1, 2, 3, 5], None, [2, 0], None]
    tokens = [[9 + i] * (len(sel) if sel else n) for i, (sel, n) in enumerate(zip(script, [6, 6, 4, 4, 2, 2]))]
    batched = run_script(fast.session(), PROMPTS, script, tokens)
    alone = run_script(fast.session(), [PROMPTS[1]], [None] * len(script), [t[:1] for t in tokens])
    assert fast.batch_invariant  # what the self-check found on this machine
    where = [1, 3, 3, 2, 2, 0, 0]  # PROMPTS[1]'s second copy: its row in each output
    for step, (b, a, row) in enumerate(zip(batched, alone, where)):
        assert torch.equal(b[row], a[0]), f"output {step}"


@pytest.mark.parametrize("context,dtype", [(31, torch.float32), (88, torch.float32), (88, torch.bfloat16)])
def test_decode_attention_gives_a_row_the_same_bits_beside_any_rows_with_two_threads(context, dtype):
    """SmolLM2's decode attention shapes (3 KV heads of 3 queries, head size 64), two threads: a row's
    output is the same beside 1 to 31 other rows. torch's CPU SDPA failed this (it divides its work
    by the batch's size), so seeded rollouts changed with the engine's batching from run to run."""
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        generator = torch.Generator().manual_seed(context)
        row = [torch.randn(1, 3, n, 64, generator=generator).to(dtype) for n in (3, context, context)]
        alone = decode_attention(*row, 0.125)
        for rows in (2, 3, 4, 8, 16, 32):
            batch = [torch.randn(rows, 3, n, 64, generator=generator).to(dtype) for n in (3, context, context)]
            for where in {0, rows // 2, rows - 1}:
                for part, own in zip(batch, row):
                    part[where] = own[0]
                assert torch.equal(decode_attention(*batch, 0.125)[where], alone[0]), (rows, where)
        # As accurate as SDPA: bf16 keys and queries still give float32 scores.
        exact = torch.nn.functional.scaled_dot_product_attention(*(x.double() for x in batch), scale=0.125)
        sdpa = torch.nn.functional.scaled_dot_product_attention(*batch, scale=0.125)
        ours_error = (decode_attention(*batch, 0.125).double() - exact).abs().mean()
        assert ours_error <= 1.5 * (sdpa.double() - exact).abs().mean() + 1e-7
    finally:
        torch.set_num_threads(threads)


def test_cache_grows_past_its_first_capacity(kernels):
    model = tiny("llama")
    fast, hf = FastLlama(model, kernels=kernels).session(), HFSession(model)
    steps = 70  # the buffer starts at prompt width + 64 columns
    tokens = [[(7 * i + j) % 90 + 2 for j in range(2)] for i in range(steps)]
    got = run_script(fast, [[3, 4, 5], [6]], [None] * steps, tokens)
    want = run_script(hf, [[3, 4, 5], [6]], [None] * steps, tokens)
    assert fast.keys.shape[3] > 3 + 64
    torch.testing.assert_close(torch.stack(got), torch.stack(want), atol=2e-5, rtol=1e-5)


def test_weights_changed_in_place_are_repacked(kernels):
    """An optimizer step on a shared model (in-place updates) must reach the next session."""
    model = tiny("llama")
    fast = FastLlama(model, kernels=kernels)
    before = run_script(fast.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    after = run_script(fast.session(), PROMPTS, SCRIPT[:2], TOKENS[:2])
    reference = run_script(HFSession(model), PROMPTS, SCRIPT[:2], TOKENS[:2])
    assert not torch.allclose(before[-1], after[-1], atol=1e-3)
    torch.testing.assert_close(after[-1], reference[-1], atol=2e-5, rtol=1e-5)


class _OtherNorm(torch.nn.Module):
    """Looks like an RMSNorm (weight, variance_epsilon) but computes something else."""

    def __init__(self, norm):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, x):
        return self.weight * x / (x.abs().mean(-1, keepdim=True) + 1)


def test_self_check_falls_back_when_the_model_differs(tmp_path, reset_loguru):
    setup_logging(str(tmp_path), "WARNING")  # what `nexrl run` does: the warning must reach run.log
    model = tiny("llama")
    model.model.norm = _OtherNorm(model.model.norm)
    fast = FastLlama(model)
    with torch.inference_mode():
        session = fast.session()
    assert isinstance(session, HFSession) and not fast.enabled
    log = (tmp_path / LOG_FILE).read_text()
    assert "WARNING" in log and "disagrees with the model's own forward" in log


def test_unsupported_models_and_modes():
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(vocab_size=50, n_embd=16, n_layer=1, n_head=2, n_positions=32))
    assert "model_type 'gpt2'" in fast_path_problem(gpt2)
    assert isinstance(make_session_factory(gpt2, "auto", 4)(), HFSession)
    with pytest.raises(ValueError, match="fast_path: true.*model_type 'gpt2'"):
        make_session_factory(gpt2, "true", 4)
    with pytest.raises(ValueError, match="fast_path: 'sometimes' is not one of auto, true, false"):
        make_session_factory(gpt2, "sometimes", 4)
    assert isinstance(make_session_factory(tiny("llama"), "false", 4)(), HFSession)
    assert isinstance(make_session_factory(tiny("llama"), False, 4)(), HFSession)  # a YAML boolean
    assert isinstance(make_session_factory(tiny("llama"), True, 4)(), FastLlamaSession)


def test_engine_outputs_agree_between_paths(tiny_model_and_tokenizer):
    """Same requests through the fast path and the model's forward: the same tokens, logprobs to 1e-5."""
    model, tokenizer = tiny_model_and_tokenizer
    prompts = ["the quick brown fox", [{"role": "user", "content": "what is two plus three?"}], "count: one, two"]
    params = [SamplingParams(max_tokens=12, temperature=t, seed=s, top_p=p)
              for t, s, p in [(0.0, None, 1.0), (1.0, 3, 1.0), (0.8, 4, 0.9)]]
    params.append(SamplingParams(max_tokens=12, temperature=1.2, seed=5, top_k=5))
    results = {}
    for mode in ("true", "false"):
        engine = HFInferenceEngine({"fast_path": mode, "max_batch_size": 1}, model=model, tokenizer=tokenizer)
        try:
            results[mode] = [engine.complete(pr, pa) for pr in prompts for pa in params]
        finally:
            engine.close()
    for fast, ref in zip(results["true"], results["false"]):
        assert fast.response_token_ids == ref.response_token_ids
        assert fast.response_logprobs == pytest.approx(ref.response_logprobs, abs=1e-5)


@pytest.mark.parametrize("source", ["generator", "counter"])
def test_sampler_follows_the_distribution_and_never_picks_excluded_tokens(source):
    """Both sources of uniforms: a generator per row (CPU) and the seed-and-token-index hash (GPU)."""
    torch.manual_seed(0)
    probs = torch.tensor([0.5, 0.2, 0.15, 0.1, 0.05, 0.0])
    logits = torch.log(probs).expand(4, -1).clone()
    generators = [torch.Generator().manual_seed(100 + i) for i in range(4)]
    seeds = torch.tensor([100, 101, 2**62 + 5, 3])

    def draw(step, gens=generators, row_seeds=seeds):
        return _generator_draw(gens) if source == "generator" else _counter_draw(row_seeds, step)
    temps = torch.ones(4)
    greedy = torch.zeros(4, dtype=torch.bool)
    top_p = torch.tensor([1.0, 1.0, 0.8, 0.75])
    top_k = torch.tensor([0, 2, 0, 3])
    # row 0: everything; row 1: top-2; row 2: 0.5 + 0.2 < 0.8 <= 0.85, three tokens stay;
    # row 3: top-3 renormalised (0.59, 0.24, 0.18), then 0.59 < 0.75 <= 0.82: two tokens stay
    # (top_p on the raw probabilities would have kept three).
    draws = 4000
    counts = torch.zeros(4, 6)
    for step in range(draws):
        tokens, logprobs = _sample(logits, temps, greedy, top_p, top_k, draw(step))
        counts[torch.arange(4), tokens] += 1
        torch.testing.assert_close(logprobs, torch.log(probs)[tokens])  # full-vocabulary logprobs
    freq = counts / draws
    assert counts[:, 5].sum() == 0
    assert counts[1, 2:].sum() == 0 and counts[3, 2:].sum() == 0 and counts[2, 3:].sum() == 0
    torch.testing.assert_close(freq[0], probs, atol=0.025, rtol=0)
    top2 = probs[:2] / probs[:2].sum()
    torch.testing.assert_close(freq[1, :2], top2, atol=0.03, rtol=0)
    torch.testing.assert_close(freq[3, :2], top2, atol=0.03, rtol=0)
    truncated = probs[:3] / probs[:3].sum()
    torch.testing.assert_close(freq[2, :3], truncated, atol=0.03, rtol=0)
    # A row's stream is its own: re-seeding one generator replays that row whatever the others do.
    g1 = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(8)]
    g2 = [torch.Generator().manual_seed(7), torch.Generator().manual_seed(9)]
    s1, s2 = torch.tensor([7, 8]), torch.tensor([7, 9])
    two = logits[:2]
    seq1 = [_sample(two, temps[:2], greedy[:2], top_p[:2], top_k[:2], draw(i, g1, s1))[0][0].item() for i in range(50)]
    seq2 = [_sample(two, temps[:2], greedy[:2], top_p[:2], top_k[:2], draw(i, g2, s2))[0][0].item() for i in range(50)]
    assert seq1 == seq2
