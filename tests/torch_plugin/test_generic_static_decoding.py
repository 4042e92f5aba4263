"""The engine's generic static-cache path (:class:`StaticHF`) for models off the hand-written fast
path that transformers runs over a ``StaticCache``: tiny random models built from the real configs
of Phi-3 (fused q/k/v and gate/up), OLMo 2 (norms after each block, q/k norms over all heads),
Gemma 2 (sliding and full layers, a window shorter than the sequences, soft-capped logits), StarCoder2
(LayerNorms with biases, GELU MLP, a sliding window) and Granite (embedding, residual, attention and
logit multipliers). Its logits equal the transformers forward (float32) through left padding,
expansion, lazy drops, compaction and reordering, padded layouts included (what a GPU's compiled
steps use); the engine samples what the transformers forward samples, greedy and sampled; the
trainer scores those samples so that a first on-policy step has ratio 1; and the path that served is
the one named, in the log and by `nexrl validate`. On the CPU the engine takes this path only with
`static_cache: true` (auto: on a CUDA device only), which these tests set."""

from __future__ import annotations

import json

import pytest
import torch

from nexrl_core.runtime.inference import SamplingParams
from nexrl_torch.rollout.decoding import (
    HFDecoder,
    HFSession,
    StaticHF,
    StaticHFSession,
    compile_problem,
    fast_path_problem,
    make_session_factory,
    static_path_problem,
)
from nexrl_torch.rollout.engine import HFInferenceEngine
from tests.support.tiny_lm import build_tokenizer

# Its autouse one-thread fixture (conftest's `import *` leaves out underscored names): tiny models gain
# nothing from a second thread, and OpenMP barriers stall while the other core is busy.
from tests.torch_plugin.test_decoding import PROMPTS, SCRIPT, TOKENS, run_script

COMMON = dict(hidden_size=48, intermediate_size=80, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              head_dim=12, max_position_embeddings=256, initializer_range=0.2, pad_token_id=0, bos_token_id=None,
              eos_token_id=1)
WINDOW = 4  # shorter than the prompts and the steps below
FAMILIES = {
    "phi3": dict(),
    "olmo2": dict(),
    # Gemma-2's kinds of settings: sliding and full layers alternating, soft-capped logits
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=20, final_logit_softcapping=5.0),
    "starcoder2": dict(sliding_window=WINDOW, use_bias=True),
    "granite": dict(embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=4.0),
}


@pytest.fixture(scope="module")
def built():
    """One model per (family, vocabulary) for the whole module, built on first use (tests must not modify it)."""
    models: dict = {}

    def get(family: str, vocab: int = 97):
        if (family, vocab) not in models:
            models[family, vocab] = build(family, vocab)
        return models[family, vocab]
    return get


def build(family: str, vocab: int = 97, seed: int = 0):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    config = AutoConfig.for_model(family, vocab_size=vocab, **COMMON, **FAMILIES[family])
    model = AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms as trained ones are, not all ones (Gemma's scale by 1 + w)
        for name, p in model.named_parameters():
            if "norm" in name:
                p.normal_(0, 0.3) if family == "gemma2" else p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padded", [False, True])
def test_the_static_path_computes_the_transformers_forward(family, padded, built):
    """The engine's decoder for these models with static_cache: true is the static path (not the fast
    path, not the growing cache); through the test script (3 left-padded prompts expanded to 6 rows,
    one dropped lazily, compaction, reordering) its float32 logits are within 2e-5 of the model's own
    forward. Padded: rows to a power of two and columns to a multiple of 64, the layouts a GPU's
    compiled steps use."""
    model = built(family)
    assert fast_path_problem(model) is not None and static_path_problem(model) is None
    decoder = make_session_factory(model, "auto", 4, static_cache="true") if not padded else \
        StaticHF(model, pad_shapes=True, kv_tokens=4096)
    assert isinstance(decoder, StaticHF) and not decoder.compiled  # eager on the CPU
    session = decoder()
    assert decoder.enabled and isinstance(session, StaticHFSession)  # the self-check passed
    got = run_script(session, PROMPTS, SCRIPT, TOKENS)
    assert session.rows == (2 if padded else 3)  # compacted, then 2 rows left: padded to 2, else kept lazily in 3
    want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
    assert [g.shape for g in got] == [w.shape for w in want]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)


def test_sliding_windows_are_honoured(built):
    """Gemma 2's and StarCoder2's windows (4) matter over these sequences: the same models with the
    window wider than every sequence are far from the ones served, which agree to 2e-5."""
    for family in ("gemma2", "starcoder2"):
        model, unwindowed = built(family), build(family)
        unwindowed.config.sliding_window = 1024
        for layer in unwindowed.model.layers:
            if getattr(layer.self_attn, "sliding_window", None):
                layer.self_attn.sliding_window = 1024
        want = run_script(HFSession(model), PROMPTS, SCRIPT, TOKENS)
        got = run_script(StaticHF(model)(), PROMPTS, SCRIPT, TOKENS)
        wide = run_script(StaticHF(unwindowed)(), PROMPTS, SCRIPT, TOKENS)
        torch.testing.assert_close(got[-1], want[-1], atol=2e-5, rtol=1e-5)
        assert float((wide[-1] - want[-1]).abs().max()) > 1e-3, family


def test_padded_layouts_are_reused_across_batches_within_the_budget(built):
    """Padded layouts keep one cache per shape across batches (the addresses a compiled step reads):
    a second batch of the same shape gets the same tensors, reset; a batch past ``kv_tokens`` is an
    error naming the budget; release() frees them."""
    model = built("phi3")
    decoder = StaticHF(model, pad_shapes=True, kv_tokens=512, release=True)
    first = decoder()
    run_script(first, PROMPTS, [None], [[5, 6, 7]])
    keys = first.cache.layers[0].keys.data_ptr()
    assert (first.rows, first.capacity) == (4, 128)  # 3 rows; 7 prompt columns + 64 by default
    second = decoder()
    got = run_script(second, PROMPTS, [None], [[5, 6, 7]])
    assert second.cache.layers[0].keys.data_ptr() == keys
    want = run_script(HFSession(model), PROMPTS, [None], [[5, 6, 7]])
    torch.testing.assert_close(got[-1], want[-1], atol=2e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="needs 1024 tokens of KV cache; the budget holds 512"):
        decoder().prefill(*_left_padded([[3] * 9] * 9), capacity=60)
    decoder.release()
    assert decoder.caches == {}
    # what the engine budgets a batch: its padded layout, or exactly rows x columns when not padded
    assert (decoder.footprint(3, 71), StaticHF(model).footprint(3, 71)) == (4 * 128, 3 * 71)


def _left_padded(prompts):
    from tests.torch_plugin.test_decoding import left_padded

    return left_padded(prompts)


def test_the_static_batch_says_when_it_is_full(built):
    session = StaticHF(built("olmo2"))()
    with torch.inference_mode():
        ids, mask, pos = _left_padded([[3, 4, 5]])
        session.prefill(ids, mask, pos, capacity=4)
        session.step(torch.tensor([6]), pos[:, -1] + 1)
        with pytest.raises(ValueError, match="static batch full: 4 columns"):
            session.step(torch.tensor([7]), pos[:, -1] + 2)


def test_which_path_serves_and_why(reset_loguru, built):
    """On the CPU `static_cache: auto` keeps the growing cache (the static path decoded no faster
    there) and the log says so; `true` takes the static path, eagerly; `false` never. GPT-Neo is not
    marked compilable by transformers (_can_compile_fullgraph): the growing cache serves it, the log
    names both paths' reasons, and `static_cache: true` is an error naming them. `fast_path: false`
    keeps today's reference path for any model (`static_cache: true` beside it is refused); the
    sliding-window families decode eagerly even where steps would be compiled, and
    `cuda_graphs: true` is refused on the CPU."""
    from loguru import logger
    from transformers import AutoConfig, AutoModelForCausalLM

    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="INFO")
    try:
        torch.manual_seed(0)
        neo = AutoModelForCausalLM.from_config(AutoConfig.for_model(
            "gpt_neo", vocab_size=97, hidden_size=32, num_layers=2, num_heads=4, attention_types=[[["global"], 2]],
            max_position_embeddings=64)).eval()
        assert "_can_compile_fullgraph" in static_path_problem(neo)
        assert isinstance(make_session_factory(neo, "auto", 4), HFDecoder)
        assert isinstance(make_session_factory(built("phi3"), "false", 4), HFDecoder)
        olmo2 = built("olmo2")
        assert isinstance(make_session_factory(olmo2, "auto", 4), HFDecoder)  # static_cache: auto, on the CPU
        cpu_default = "".join(lines)
        assert isinstance(make_session_factory(olmo2, "auto", 4, static_cache=True), StaticHF)  # a YAML boolean
        forced = "".join(lines)[len(cpu_default):]
        lines.clear()
        assert isinstance(make_session_factory(olmo2, None, 4, static_cache="false"), HFDecoder)
    finally:
        logger.remove(sink)
    assert "growing cache (DynamicCache), slower: not on the fast path (model_type 'gpt_neo'" in cpu_default
    assert "nor on the static-cache path (transformers does not mark GPTNeoForCausalLM as compilable" in cpu_default
    assert "not on the fast path (model_type 'olmo2'" in cpu_default
    assert "nor on the static-cache path (static_cache: auto takes it on a CUDA device only; eager on the CPU it " \
           "decoded no faster than the growing cache)" in cpu_default
    assert "static KV cache (the generic path; decode steps eager: on the CPU) for model_type 'olmo2'" in forced
    assert "nor on the static-cache path (static_cache: false)" in "".join(lines)
    for said in (cpu_default, forced):
        assert "not batch-invariant" in said and "bit-reproducible only with max_batch_size: 1" in said
    assert compile_problem(built("gemma2")).startswith("sliding-window cache layers")
    assert compile_problem(built("phi3")) is None
    with pytest.raises(ValueError, match="static_cache: true, but the static-cache path cannot run this model: "
                                         "transformers does not mark GPTNeoForCausalLM"):
        make_session_factory(neo, "auto", 4, static_cache="true")
    with pytest.raises(ValueError, match="static_cache: true needs fast_path: auto"):
        make_session_factory(olmo2, "false", 4, static_cache="true")
    with pytest.raises(ValueError, match="static_cache: 'sometimes' is not one of auto, true, false"):
        make_session_factory(olmo2, "auto", 4, static_cache="sometimes")
    with pytest.raises(ValueError, match="fast_path: true, but the fast decoding path cannot run this model"):
        make_session_factory(built("phi3"), "true", 4)
    with pytest.raises(ValueError, match="cuda_graphs: true needs"):
        make_session_factory(built("phi3"), "auto", 4, graphs="true")


def test_a_disagreeing_model_falls_back_to_the_growing_cache(reset_loguru, built):
    """The self-check compares the static path with the model's own forward: a static cache that
    drops what it is given (a broken model variant) turns the path off, with a warning."""
    from loguru import logger

    decoder = StaticHF(built("phi3"))
    broken = decoder.cache

    def cache_that_forgets(rows, capacity, keep=None):
        cache = broken(rows, capacity, keep)
        for layer in cache.layers:
            update = layer.update
            layer.update = lambda k, v, *a, _u=update, **kw: _u(k * 0, v, *a, **kw)
        return cache

    decoder.cache = cache_that_forgets
    lines: list[str] = []
    sink = logger.add(lambda m: lines.append(str(m)), level="WARNING")
    try:
        session = decoder()
    finally:
        logger.remove(sink)
    assert not decoder.enabled and isinstance(session, HFSession)
    assert "static-cache decoding path disagrees with the model's own forward" in "".join(lines)


@pytest.fixture(scope="module")
def tokenizer():
    return build_tokenizer()


REQUEST_PROMPTS = [f"count: {'one two three ' * (i % 4)}what is {i} plus {i + 3}?" for i in range(8)]


@pytest.mark.parametrize("family", ["phi3", "gemma2", "starcoder2"])
def test_the_engine_samples_what_the_transformers_forward_samples(family, tokenizer, built):
    """8 requests of different prompt lengths (left-padded) and different max_tokens (rows finish,
    and are dropped, mid-batch), greedy and sampled in one batch on the static path
    (static_cache: true), against each decoded alone through the transformers forward: the same
    tokens, log-probs within 1e-5; every batch went through the static path's sessions, none through
    the growing cache."""
    model = built(family, len(tokenizer))
    params = [SamplingParams(max_tokens=3 + i % 4 * 2, temperature=float(i % 2), seed=i)
              for i in range(len(REQUEST_PROMPTS))]
    engines = {path: HFInferenceEngine({"fast_path": "auto" if path == "static" else False, "chat_template": False,
                                        "static_cache": path == "static", "num_threads": 1,
                                        "max_batch_size": len(params) if path == "static" else 1,
                                        "batch_wait_ms": 50 if path == "static" else 0},
                                       model=model, tokenizer=tokenizer) for path in ("static", "transformers")}
    decoder = engines["static"].decoder
    assert isinstance(decoder, StaticHF)
    try:
        static = engines["static"].complete_many(list(zip(REQUEST_PROMPTS, params)))
        reference = [engines["transformers"].complete(p, s) for p, s in zip(REQUEST_PROMPTS, params)]
    finally:
        for engine in engines.values():
            engine.close()
    assert decoder.enabled and decoder.sessions_served >= engines["static"].num_batches > 0
    lengths = {len(r.response_token_ids) for r in static}
    assert len(lengths) > 2  # rows finished at different steps
    for got, want in zip(static, reference):
        assert got.response_token_ids == want.response_token_ids
        assert got.response_logprobs == pytest.approx(want.response_logprobs, abs=1e-5)


@pytest.mark.parametrize("family", ["olmo2", "granite"])
def test_a_first_step_on_the_engines_samples_is_on_policy(family, tokenizer, tmp_path, built):
    """The trainer on the static path's samples, with the engine's log-probs as the old ones: every
    token's ratio within 1e-5 of 1, and the step reads ppo_kl 0 (to 1e-6) and no clipping."""
    from nexrl_torch.train.service import LocalTorchTrainService
    from tests.grpo_plugin.test_train_service import grpo_loss, make_batch

    model = built(family, len(tokenizer))
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    engine = HFInferenceEngine({"model_path": str(tmp_path), "chat_template": False, "num_threads": 1,
                                "batch_wait_ms": 50, "static_cache": "true"})
    service = LocalTorchTrainService({"model_path": str(tmp_path), "num_threads": 1})
    try:
        assert isinstance(engine.decoder, StaticHF)
        results = engine.complete_many([(p, SamplingParams(max_tokens=6, temperature=1.0, seed=i))
                                        for i, p in enumerate(REQUEST_PROMPTS[:6])])
    finally:
        engine.close()
    assert engine.decoder.enabled
    scored = service.score([(r.prompt_token_ids, r.response_token_ids, 1.0) for r in results])
    ratios = [torch.exp(torch.tensor(t) - torch.tensor(r.response_logprobs)) for t, r in zip(scored, results)]
    assert max(float((ratio - 1).abs().max()) for ratio in ratios) < 1e-5
    batch = make_batch([r.prompt_token_ids for r in results], [r.response_token_ids for r in results])
    old = torch.zeros(batch["responses"].shape)
    for row, r in enumerate(results):
        old[row, :len(r.response_logprobs)] = torch.tensor(r.response_logprobs)
    advantages = torch.tensor([1.0, -1.0] * 3)[:, None] * batch["response_mask"]
    metrics = service.forward_backward({**batch, "old_log_probs": old, "advantages": advantages}, grpo_loss())
    assert abs(metrics["ppo_kl"]) < 1e-6 and metrics["pg_clipfrac"] == 0.0, metrics


def test_validate_names_the_path_before_loading(tmp_path, built):
    """`nexrl validate` (the hf backend's recipe_notes) reads config.json and the section's
    static_cache and device: a family the static path serves is named as served by it where the engine
    will take it (static_cache: true, or auto on a CUDA device), not batch-invariant; on the CPU by
    default, and with static_cache: false, as served by the growing cache with that reason; one off
    both paths says both reasons; the fast-path families get no note, nor does fast_path: false."""
    from nexrl_torch.rollout.weights import HFInferenceBackend

    def note(config, **section):
        folder = tmp_path / str(len(list(tmp_path.iterdir())))
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        notes = HFInferenceBackend.recipe_notes({"model_path": str(folder), **section})
        assert len(notes) <= 1 and all(n.startswith("service.inference_service: ") for n in notes), notes
        return notes[0].removeprefix("service.inference_service: ") if notes else None

    growing = ("the engine decodes through the transformers forward, slower, and runs with several rollout workers "
               "are not bit-reproducible (unless max_batch_size: 1)")
    for family in FAMILIES:
        config = built(family).config.to_dict()
        for section in ({"static_cache": True}, {"device": "cuda"}, {"device": "cuda:1", "static_cache": "auto"}):
            said = note(config, **section)
            assert said.startswith(f"model_type {family!r} is not on the fast decoding path"), said
            assert "static KV cache (the generic path" in said and "not batch-invariant" in said, said
        cpu = note(config, device="cpu")
        assert cpu.startswith(f"model_type {family!r} is not on the fast decoding path"), cpu
        assert "nor on the static-cache path (static_cache: auto takes it on a CUDA device only" in cpu, cpu
        assert cpu.endswith(growing), cpu
        assert note(config) == note(config, device="cuda" if torch.cuda.is_available() else "cpu")
        off = note(config, device="cuda", static_cache="false")
        assert "nor on the static-cache path (static_cache: false)" in off and off.endswith(growing), off
        assert note(config, fast_path=False) is None
    neo_config = {"model_type": "gpt_neo", "num_layers": 2, "attention_types": [[["global"], 2]]}
    neo = note(neo_config, device="cuda")
    assert "nor on the static-cache path (transformers does not mark GPTNeoForCausalLM" in neo
    assert neo.endswith(growing), neo
    assert note(neo_config, static_cache=True).endswith("static_cache: true will fail when the engine loads")
    assert note({"model_type": "qwen3"}) is None
    bidirectional = note({"model_type": "gemma3_text", "use_bidirectional_attention": True}, device="cuda")
    assert bidirectional.startswith("bidirectional attention (use_bidirectional_attention) is not on the fast "
                                    "decoding path: the engine decodes through the transformers forward")
