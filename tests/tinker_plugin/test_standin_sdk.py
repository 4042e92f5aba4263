"""The unmodified ``tinker`` SDK against the stand-in: wire protocol, losses, Adam, sampling, state."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
import torch
from tinker import types

from nexrl_tinker.standin import Fault
from tests.tinker_plugin.helpers import API_KEY, MODEL, sft_datum

TEXT = "the quick brown fox jumps over the lazy dog"


def _train(training, datum, steps: int, lr: float = 1e-2) -> list[float]:
    losses = []
    for _ in range(steps):
        backward = training.forward_backward([datum], "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(backward.result().metrics["loss:sum"])
        step.result()
    return losses


def _greedy(sampler, prompt: list[int], n: int = 8) -> list[int]:
    params = types.SamplingParams(max_tokens=n, temperature=0.0, stop=[])
    return list(sampler.sample(types.ModelInput.from_ints(prompt), 1, params).result().sequences[0].tokens)


def test_cross_entropy_rounds_lower_the_loss_and_change_samples(standin, service_client, tokenizer):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    datum = sft_datum(tokenizer, TEXT)
    prompt = tokenizer(TEXT).input_ids[:3]
    before = _greedy(training.save_weights_and_get_sampling_client().result(), prompt)

    losses = _train(training, datum, 4)
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

    out = training.forward([datum], "cross_entropy").result()
    logprobs = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    elementwise = out.loss_fn_outputs[0]["elementwise_loss"].to_numpy()
    weights = datum.loss_fn_inputs["weights"].to_numpy()
    assert logprobs.shape == (datum.model_input.length,) and (logprobs <= 0).all()
    np.testing.assert_allclose(elementwise, -logprobs * weights, rtol=1e-6)
    assert out.metrics["loss:sum"] == pytest.approx(float(elementwise.sum()), rel=1e-5)

    after = _greedy(training.save_weights_and_get_sampling_client().result(), prompt)
    target = tokenizer(TEXT).input_ids[3:3 + len(after)]
    assert after != before
    assert sum(a == t for a, t in zip(after, target)) > sum(b == t for b, t in zip(before, target))
    assert standin.count("try_again") > 0  # the SDK's polling path ran


def _datum_with(datum, **inputs):
    return types.Datum(model_input=datum.model_input, loss_fn_inputs={**datum.loss_fn_inputs, **inputs})


@pytest.mark.parametrize("loss_fn, config", [("importance_sampling", None), ("ppo", None),
                                             ("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.05})])
def test_policy_losses_match_the_documented_formulas(service_client, tokenizer, loss_fn, config):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=1).result()
    base = sft_datum(tokenizer, TEXT)
    # The learner's logprobs under the current weights (a forward pass changes nothing).
    current = training.forward([base], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    rng = np.random.default_rng(0)
    n = base.model_input.length
    sampling = (current + rng.uniform(-0.6, 0.6, n)).astype(np.float32)  # ratios on both sides of the clip
    advantages = rng.normal(0, 1, n).astype(np.float32)
    datum = _datum_with(base, logprobs=sampling, advantages=advantages)
    datum = types.Datum(model_input=datum.model_input,
                        loss_fn_inputs={k: v for k, v in datum.loss_fn_inputs.items() if k != "weights"})

    out = training.forward_backward([datum], loss_fn, config).result()
    returned = out.loss_fn_outputs[0]["logprobs"].to_numpy()
    np.testing.assert_allclose(returned, current, rtol=1e-5, atol=1e-6)
    ratio = np.exp(returned.astype(np.float64) - sampling)
    if loss_fn == "importance_sampling":
        expected = -(ratio * advantages).sum()
    else:
        low, high = (config or {}).get("clip_low_threshold", 0.8), (config or {}).get("clip_high_threshold", 1.2)
        assert ((ratio < low) | (ratio > high)).any()  # the clip matters for this datum
        expected = -np.minimum(ratio * advantages, np.clip(ratio, low, high) * advantages).sum()
    assert out.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4)
    # The gradient is real: a step moves the logprobs.
    training.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    moved = training.forward([base], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    assert np.abs(moved - current).max() > 1e-3


def test_a_call_split_into_parallel_chunks_runs_in_seq_order(make_standin, tokenizer):
    """With one datum per request the SDK sends a call's chunks concurrently, the first one last;
    the server still runs them (and the optimizer step after them) in seq_id order."""
    standin = make_standin(fwdbwd_chunk_len=1)
    datums = [sft_datum(tokenizer, text) for text in (TEXT, "count: one, two, three", "hello world! grpo trains")]
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
        whole = training.forward(datums, "cross_entropy").result()
        assert standin.count("POST /api/v1/forward_backward") == 3
        backward = training.forward_backward(datums, "cross_entropy")
        step = training.optim_step(types.AdamParams(learning_rate=1e-2))
        split = backward.result()
        step.result()
        after = training.forward(datums, "cross_entropy").result()
    finally:
        client.close("success").result(timeout=30)
    assert len(split.loss_fn_outputs) == 3
    assert split.metrics["loss:sum"] == pytest.approx(whole.metrics["loss:sum"], rel=1e-5)  # before the step
    for a, b in zip(split.loss_fn_outputs, whole.loss_fn_outputs):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"].to_numpy(), rtol=1e-5)
    assert after.metrics["loss:sum"] < whole.metrics["loss:sum"]


def test_lora_rank_and_targets(standin, service_client):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=3, seed=0, train_mlp=False).result()
    info = training.get_info()
    assert info.is_lora and info.lora_rank == 3 and info.model_data.model_name == MODEL
    run = standin._runs[training.model_id]
    assert run.params and all(p.shape[0] == 3 for n, p in run.params.items() if n.endswith("lora_A"))
    assert any("self_attn" in n for n in run.params) and any(n.startswith("lm_head") for n in run.params)
    assert not any(".mlp." in n for n in run.params)
    assert all(not p.detach().any() for n, p in run.params.items() if n.endswith("lora_B"))


def test_save_state_then_load_with_optimizer_continues_exactly(standin, service_client, tokenizer):
    datum = sft_datum(tokenizer, TEXT)
    probe = sft_datum(tokenizer, "hello world! grpo trains language models")
    first = service_client.create_lora_training_client(base_model=MODEL, rank=4, seed=0).result()
    _train(first, datum, 2)
    path = first.save_state("ck").result().path
    assert path == f"tinker://{first.model_id}/weights/ck"
    [loss_3] = _train(first, datum, 1)
    after_3 = first.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    other = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        resumed = other.create_training_client_from_state_with_optimizer(path).result()
        assert resumed.model_id != first.model_id
        [loss_3b] = _train(resumed, datum, 1)
        after_3b = resumed.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
        weights_only = other.create_training_client_from_state(path).result()
        _train(weights_only, datum, 1)
        fresh_adam = weights_only.forward([probe], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()
    finally:
        other.close("success").result(timeout=30)
    assert loss_3b == loss_3
    np.testing.assert_array_equal(after_3b, after_3)
    assert np.abs(fresh_adam - after_3).max() > 1e-4  # without the Adam moments the step differs
    files = sorted(p.name for p in (standin.state_dir / first.model_id / "weights" / "ck").iterdir())
    assert files == ["optimizer.safetensors", "state.json", "weights.safetensors"]


def test_sampling_params_and_logprobs(service_client, tokenizer):
    training = service_client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
    sampler = training.save_weights_and_get_sampling_client().result()
    prompt = types.ModelInput.from_ints(tokenizer("count: one, two").input_ids)

    def sample(n=3, **params):
        return sampler.sample(prompt, n, types.SamplingParams(**params)).result().sequences

    a = sample(max_tokens=6, temperature=1.0, seed=5, stop=[])
    b = sample(max_tokens=6, temperature=1.0, seed=5, stop=[])
    c = sample(max_tokens=6, temperature=1.0, seed=6, stop=[])
    assert [s.tokens for s in a] == [s.tokens for s in b] != [s.tokens for s in c]
    assert all(len(s.tokens) == 6 and s.stop_reason == "length" for s in a)
    assert all(len(s.logprobs) == 6 and max(s.logprobs) <= 0 for s in a)

    # A stop token ends the sequence and is returned with it.
    greedy = sample(1, max_tokens=6, temperature=0.0, stop=[])[0].tokens
    stop_at = greedy[2]
    stopped = sample(1, max_tokens=6, temperature=0.0, stop=[stop_at])[0]
    assert stopped.tokens == greedy[:greedy.index(stop_at) + 1] and stopped.stop_reason == "stop"

    # Greedy logprobs are those of the model's next-token distribution; compute_logprobs scores the prompt.
    ids = prompt.to_ints() + greedy
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(ids)).result()
    assert scored[0] is None and len(scored) == len(ids)
    greedy_lps = sample(1, max_tokens=6, temperature=0.0, stop=[])[0].logprobs
    np.testing.assert_allclose(scored[-6:], greedy_lps, rtol=1e-4, atol=1e-5)
    # Top-p 1e-6 keeps only the most likely token: sampling at any temperature is then greedy.
    assert sample(1, max_tokens=6, temperature=1.0, top_p=1e-6, seed=1, stop=[])[0].tokens == greedy


def test_transient_http_errors_are_retried_by_the_sdk(make_standin, tokenizer):
    faults = [Fault("forward_backward", 1, 429), Fault("optim_step", 1, 500), Fault("retrieve_future", 2, 503),
              Fault("asample", 1, 429)]
    standin = make_standin(faults=faults)
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
        losses = _train(training, sft_datum(tokenizer, TEXT), 2)
        sampler = training.save_weights_and_get_sampling_client().result()
        assert _greedy(sampler, tokenizer(TEXT).input_ids[:3], 3)
    finally:
        client.close("success").result(timeout=30)
    assert losses[1] < losses[0]
    assert [f.hits for f in faults] == [1, 1, 1, 1]
    assert standin.count("POST /api/v1/forward_backward") == 3  # two steps + one retried submission


def test_failed_requests_and_bad_keys(make_standin, tokenizer):
    standin = make_standin(api_key=API_KEY)
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=2).result()
        bad = types.Datum(model_input=types.ModelInput.from_ints([1, 2]),
                          loss_fn_inputs={"target_tokens": np.asarray([2, 10_000], dtype=np.int64)})
        with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary") as info:
            training.forward_backward([bad], "cross_entropy").result()
        assert str(info.value.category) == "user"
        with pytest.raises(Exception, match="unknown base model 'nope'"):
            client.create_lora_training_client(base_model="nope", rank=2).result()
    finally:
        client.close("success").result(timeout=30)
    with pytest.raises(tinker.AuthenticationError):
        tinker.ServiceClient(base_url=standin.url, api_key="tml-wrong").create_lora_training_client(
            base_model=MODEL).result()


def test_full_weights_run_without_lora(standin, tokenizer):
    """LoRA comes with every SDK training client; a run created without ``lora_config`` trains all weights."""
    from nexrl_tinker.standin import TrainingRun

    run = TrainingRun("raw:train:0", standin.models[MODEL], None)
    names = standin.models[MODEL].full_parameter_names()
    assert set(run.params) == set(names) and not any("lora" in n for n in names)
    datum = sft_datum(tokenizer, TEXT)
    from nexrl_tinker.standin.engine import Example

    example = Example(datum.model_input.to_ints(), {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items()})
    losses = []
    for _ in range(3):
        _, metrics = run.forward_backward([example], "cross_entropy", {}, backward=True)
        run.optim_step(types.AdamParams(learning_rate=1e-3))
        losses.append(metrics["loss:sum"])
    assert losses[-1] < losses[0]
    base_weight = dict(standin.models[MODEL].model.named_parameters())[names[0]]
    assert not torch.equal(run.params[names[0]], base_weight)  # the shared base model is untouched


def test_client_side_custom_loss_runs_on_the_stand_in(service_client, tokenizer):
    """forward_backward_custom: the SDK's forward, its local loss, then a weighted cross-entropy backward."""
    training = service_client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
    datum = sft_datum(tokenizer, TEXT)
    current = training.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].to_numpy()

    def squared(data, logprobs):
        loss = sum((lp ** 2).sum() for lp in logprobs)
        return loss, {"squared": float(loss.detach())}

    out = training.forward_backward_custom([datum], squared).result()
    assert out.metrics["loss:sum"] == pytest.approx(float((current.astype(np.float64) ** 2).sum()), rel=1e-4)
    # The surrogate cross-entropy's weights were -dL/dlogprobs = -2 * logprobs: its loss is sum(2 * lp^2).
    assert out.metrics["surrogate_loss:sum"] == pytest.approx(2 * out.metrics["loss:sum"], rel=1e-4)


def test_concurrent_sample_requests_are_decoded_as_one_batch(make_standin, tokenizer):
    """Requests in flight together (different prompts and lengths, a repeated prompt, a bad one) are
    decoded in one batch; each gets the tokens it gets alone with the same seed, and log-probs that
    are the model's for exactly those tokens; the bad request fails alone."""
    standin = make_standin(sample_batch_wait_s=1.0)  # every request sent below joins the first batch
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        training = client.create_lora_training_client(base_model=MODEL, rank=2, seed=0).result()
        _train(training, sft_datum(tokenizer, TEXT), 1)  # LoRA weights that are not zero
        sampler = training.save_weights_and_get_sampling_client().result()
        prompts = [tokenizer(t).input_ids for t in ("the quick", "count: one, two, three", "the quick", "hello")]
        params = [types.SamplingParams(max_tokens=m, temperature=t, seed=s, stop=[])
                  for m, t, s in ((6, 1.0, 1), (4, 1.0, 2), (6, 1.0, 3), (5, 0.0, None))]

        def send():
            return [sampler.sample(types.ModelInput.from_ints(p), 2, sp) for p, sp in zip(prompts, params)]

        bad = sampler.sample(types.ModelInput.from_ints([1, 10_000]), 1, params[0])
        together = [f.result() for f in send()]
        with pytest.raises(tinker.RequestFailedError, match="outside the vocabulary"):
            bad.result()
        assert standin.count("sample_batches") == 1
        standin.sample_batch_wait_s = 0.005  # the default: each request below goes alone (no 1 s wait for others)
        alone = []
        for p, sp in zip(prompts, params):
            alone.append(sampler.sample(types.ModelInput.from_ints(p), 2, sp).result())
        assert standin.count("sample_batches") == 1 + len(prompts)
        for prompt, sp, got, ref in zip(prompts, params, together, alone):
            assert [s.tokens for s in got.sequences] == [s.tokens for s in ref.sequences]
            for seq, ref_seq in zip(got.sequences, ref.sequences):
                assert len(seq.tokens) == sp.max_tokens and seq.stop_reason == "length"
                np.testing.assert_allclose(seq.logprobs, ref_seq.logprobs, rtol=1e-4, atol=1e-5)
                scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt + seq.tokens)).result()
                np.testing.assert_allclose(scored[-len(seq.tokens):], seq.logprobs, rtol=1e-4, atol=1e-5)
        # The two samples of a seeded request differ (each row draws its own tokens).
        assert together[0].sequences[0].tokens != together[0].sequences[1].tokens
    finally:
        client.close("success").result(timeout=30)


def test_a_sampling_batch_holds_at_most_sample_batch_rows_samples(make_standin, tokenizer):
    standin = make_standin(sample_batch_rows=4, sample_batch_wait_s=1.0)
    client = tinker.ServiceClient(base_url=standin.url, api_key=API_KEY)
    try:
        sampler = client.create_sampling_client(base_model=MODEL).result()
        params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=0, stop=[])
        futures = [sampler.sample(types.ModelInput.from_ints(tokenizer(t).input_ids), 2, params)
                   for t in ("the quick", "what is", "hello world")]
        assert [len(f.result().sequences) for f in futures] == [2, 2, 2]
    finally:
        client.close("success").result(timeout=30)
    assert standin.count("sample_batches") == 2  # 2 + 2 samples, then the last request's 2
