"""Packed forward/backward (no padding) against the padded computation: logprobs and gradients."""

from __future__ import annotations

import copy

import pytest
import torch

from nexrl_torch import logprobs as modeling
from nexrl_torch.logprobs import (
    compute_response_logprobs,
    compute_response_logprobs_packed,
    pack_count,
    packing_problem,
    position_ids_from_mask,
)
from nexrl_torch.train.service import LocalTorchTrainService

# (group, prompt tokens, response tokens): uneven prompts, uneven responses, an empty response,
# and a group whose rows are not next to each other in the batch.
ROWS = [
    (0, [5, 6, 7, 8, 9], [20, 21, 22]),
    (0, [5, 6, 7, 8, 9], [23]),
    (1, [10, 11], [24, 25, 26, 27, 28, 29]),
    (2, [12, 13, 14, 15, 16, 17, 18], []),
    (1, [10, 11], [30, 31]),
    (2, [12, 13, 14, 15, 16, 17, 18], [32, 33, 34, 35]),
    (0, [5, 6, 7, 8, 9], [36, 37, 38, 39, 40, 41, 42]),
]


def padded_batch(rows=ROWS):
    prompt_w = max(len(p) for _, p, _ in rows)
    resp_w = max(len(r) for _, _, r in rows)
    ids = torch.zeros((len(rows), prompt_w + resp_w), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, (_, p, r) in enumerate(rows):
        ids[i, prompt_w - len(p):prompt_w], mask[i, prompt_w - len(p):prompt_w] = torch.tensor(p), 1
        if r:
            ids[i, prompt_w:prompt_w + len(r)], mask[i, prompt_w:prompt_w + len(r)] = torch.tensor(r), 1
    groups = torch.tensor([g for g, _, _ in rows])
    return ids, mask, position_ids_from_mask(mask), resp_w, groups


def grads_of(model, logprobs, response_mask, weights):
    model.zero_grad(set_to_none=True)
    (logprobs * response_mask * weights).sum().backward()
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.fixture(params=["square", "split"])
def layout(request, monkeypatch):
    """Every group block attends in one layout: over its whole square, or split (prompt, then each
    response over its prompt and itself)."""
    monkeypatch.setattr(modeling, "_SPLIT_MIN_SQUARE", float("inf") if request.param == "square" else 0)
    monkeypatch.setattr(modeling, "_SPLIT_BELOW", float("inf"))
    return request.param


@pytest.mark.parametrize("grouped,max_tokens,temperature", [(True, 2048, 1.0), (True, 12, 0.7), (False, 30, 1.0)])
def test_packed_logprobs_and_gradients_equal_padded(tiny_model_and_tokenizer, grouped, max_tokens, temperature,
                                                    layout):
    model, _ = tiny_model_and_tokenizer
    model.train()
    ids, mask, pos, resp_w, groups = padded_batch()
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1))
    assert packing_problem(model, mask, resp_w) is None

    want = compute_response_logprobs(model, ids, mask, pos, resp_w, temperature)
    want_grads = grads_of(model, want, response_mask, weights)
    got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups if grouped else None,
                                           temperature, max_tokens)
    got_grads = grads_of(model, got, response_mask, weights)

    torch.testing.assert_close(got * response_mask, want * response_mask, atol=1e-5, rtol=1e-5)
    assert bool((got[response_mask == 0] == 0).all())
    assert set(got_grads) == set(want_grads)
    for name in want_grads:
        # Gradients sum over every token in another order: an embedding row near 0 moves by ~1e-5.
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=3e-5, rtol=1e-4, msg=name)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_packing_on_the_gpu_matches_padded(tiny_model_and_tokenizer, layout):
    """Both attention layouts on CUDA (SDPA picks other kernels there, and the split layout's mask
    is an expanded view), against the padded computation on the same card."""
    model = copy.deepcopy(tiny_model_and_tokenizer[0]).cuda()
    model.train()
    ids, mask, pos, resp_w, groups = (t.cuda() if torch.is_tensor(t) else t for t in padded_batch())
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1)).cuda()
    want = compute_response_logprobs(model, ids, mask, pos, resp_w)
    want_grads = grads_of(model, want, response_mask, weights)
    got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    got_grads = grads_of(model, got, response_mask, weights)
    torch.testing.assert_close(got * response_mask, want * response_mask, atol=1e-4, rtol=1e-4)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=1e-4, rtol=1e-3, msg=name)


def test_a_shared_prompt_position_is_scored_once_and_its_gradient_has_the_same_bits_every_call(
        tiny_model_and_tokenizer, layout):
    """A group's prompt is packed once; its last position predicts the first token of each of the
    group's rows. The LM head sees that position once, then it is selected per row: gathering it
    once per row made the backward add the rows' gradients with atomics (CPU, 2+ threads), in
    another order on each call, so two runs of one recipe trained different bits."""
    model, _ = tiny_model_and_tokenizer
    model.train()
    ids, mask, pos, resp_w, groups = padded_batch()
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(1))
    lm_head_rows: list[int] = []
    hook = model.lm_head.register_forward_pre_hook(lambda module, args: lm_head_rows.append(args[0].shape[-2]))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        runs = [grads_of(model, compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups),
                         response_mask, weights) for _ in range(4)]
    finally:
        hook.remove()
        torch.set_num_threads(threads)
    answered = {(g, i) for i, (g, _, r) in enumerate(ROWS) if r}
    shared = len(answered) - len({g for g, _ in answered})  # first tokens predicted by a position already kept
    assert lm_head_rows == [int(response_mask.sum()) - shared] * len(runs)
    for grads in runs[1:]:
        assert all(torch.equal(grads[name], runs[0][name]) for name in grads)


def test_attention_runs_per_group_block_and_the_model_keeps_its_attention(tiny_model_and_tokenizer, monkeypatch):
    """Tokens of one group never see another group's, so attention runs over each group's block of
    the packed sequence (its prompt once, then its rows' responses), not over the whole sequence."""
    model, _ = tiny_model_and_tokenizer
    model.train()
    ids, mask, pos, resp_w, groups = padded_batch()
    query_lengths: list[int] = []

    def recording(attend):
        def recorded(query, *args, **kwargs):
            query_lengths.append(query.shape[-2])
            return attend(query, *args, **kwargs)
        return recorded

    # torch's SDPA, and on the CPU the block attention's own matmuls
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention",
                        recording(torch.nn.functional.scaled_dot_product_attention))
    monkeypatch.setattr(modeling, "_square_attention", recording(modeling._square_attention))
    compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    # Groups in order of first appearance: the prompt once plus every response of the group.
    blocks = [len(p) + sum(len(r) for g2, _, r in ROWS if g2 == g)
              for g, p in dict((g, p) for g, p, _ in ROWS).items()]
    assert query_lengths == blocks * model.config.num_hidden_layers
    assert model.config._attn_implementation == "sdpa"  # switched for the packed forward only

    # The padded computation and a forward that fails leave the model's own attention in place.
    query_lengths.clear()
    compute_response_logprobs(model, ids, mask, pos, resp_w)
    assert query_lengths == [ids.shape[1]] * model.config.num_hidden_layers
    with pytest.raises(IndexError):
        compute_response_logprobs_packed(model, ids + model.config.vocab_size, mask, pos, resp_w, groups)
    assert model.config._attn_implementation == "sdpa"


def test_a_tied_embeddings_rows_are_added_into_the_heads_gradient_in_place(tiny_model_and_tokenizer, monkeypatch):
    """The embedding's sparse gradient goes into the head's dense one where they meet, not into a
    copy of it; the sum is the padded computation's (checked above for every parameter)."""
    model, _ = tiny_model_and_tokenizer
    assert model.get_input_embeddings().weight is model.get_output_embeddings().weight
    model.train()
    met = []
    backward = modeling._TiedWeight.backward

    def recording(ctx, grad_embedding, grad_head):
        summed = backward(ctx, grad_embedding, grad_head)
        met.append((grad_embedding.is_sparse, summed.data_ptr() == grad_head.data_ptr()))
        return summed

    monkeypatch.setattr(modeling._TiedWeight, "backward", staticmethod(recording))
    ids, mask, pos, resp_w, groups = padded_batch()
    model.zero_grad(set_to_none=True)
    compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups).sum().backward()
    assert met == [(True, True)]
    assert not model.get_input_embeddings().weight.grad.is_sparse
    assert "forward" not in vars(model.get_input_embeddings())  # the lookup is the module's own again


def test_long_responses_attend_over_their_prompt_and_themselves_not_the_whole_group(tiny_model_and_tokenizer,
                                                                                   monkeypatch):
    """With responses long next to their prompt, a group's attention is split: the prompt's causal
    attention, then every response at once, padded to the longest, over its prompt and itself. The
    work is rows x response x (prompt + response) instead of the block's square."""
    model, _ = tiny_model_and_tokenizer
    model.train()
    rows = [(0, [5, 6], list(range(20, 60))), (0, [5, 6], list(range(60, 96))), (0, [5, 6], list(range(96, 134))),
            (1, [7, 8, 9], list(range(164, 172))), (0, [5, 6], list(range(134, 164)))]
    ids, mask, pos, resp_w, groups = padded_batch(rows)
    # Blocks this small stay square as shipped (the split's extra calls cost more than they save).
    assert not modeling._GroupBlock(0, 2, [40, 36, 38, 30]).split
    monkeypatch.setattr(modeling, "_SPLIT_MIN_SQUARE", 0)
    # 2^2 + 4 * 40 * (2 + 40) = 6724 < 0.75 * 146^2; but 3^2 + 8 * 11 = 97 > 0.75 * 11^2.
    assert [modeling._GroupBlock(0, 2, [40, 36, 38, 30]).split, modeling._GroupBlock(146, 3, [8]).split] == [True, False]
    # Eight responses of up to 256 tokens split as shipped (about half the square's work).
    monkeypatch.undo()
    assert modeling._GroupBlock(0, 45, [256, 212, 81, 44, 107, 77, 229, 54]).split
    calls: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    sdpa = torch.nn.functional.scaled_dot_product_attention

    square = modeling._square_attention

    def recording(query, key, *args, **kwargs):
        calls.append((tuple(query.shape[::2]), tuple(key.shape[::2])))
        return sdpa(query, key, *args, **kwargs)

    def recording_square(query, key, *args):  # one block's [heads, T, d]: as one row
        calls.append(((1, query.shape[1]), (1, key.shape[1])))
        return square(query, key, *args)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling, "_SPLIT_MIN_SQUARE", 0)
        patch.setattr(torch.nn.functional, "scaled_dot_product_attention", recording)
        patch.setattr(modeling, "_square_attention", recording_square)
        got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    # (rows, query length) and (rows, key length): group 0's prompt, its 4 responses padded to 40 over
    # 2 + 40 keys, then group 1's block whole.
    assert calls == [((1, 2), (1, 2)), ((4, 40), (4, 42)), ((1, 11), (1, 11))] * model.config.num_hidden_layers

    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(2))
    got_grads = grads_of(model, got, response_mask, weights)
    want = compute_response_logprobs(model, ids, mask, pos, resp_w)
    want_grads = grads_of(model, want, response_mask, weights)
    torch.testing.assert_close(got * response_mask, want * response_mask, atol=1e-5, rtol=1e-5)
    for name in want_grads:
        torch.testing.assert_close(got_grads[name], want_grads[name], atol=3e-5, rtol=1e-4, msg=name)

    # Responses of one token each: the padded queries are single tokens (transformers' GQA takes
    # another path for those).
    monkeypatch.setattr(modeling, "_SPLIT_MIN_SQUARE", 0)
    ids, mask, pos, resp_w, groups = padded_batch([(0, [5, 6, 7], [20]), (0, [5, 6, 7], [21]), (0, [5, 6, 7], [22])])
    got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    torch.testing.assert_close(got, compute_response_logprobs(model, ids, mask, pos, resp_w), atol=1e-5, rtol=1e-5)


def test_a_group_longer_than_a_pack_is_split_with_its_prompt_repeated(tiny_model_and_tokenizer):
    """``max_tokens_per_pack`` bounds every model call (the memory knob the out-of-memory error names),
    whatever the group size: a longer group's rows go to several sequences, each with the prompt;
    only a prompt with one response longer than the bound makes a longer sequence."""
    model, _ = tiny_model_and_tokenizer
    model.train()
    rows = [(0, [5, 6, 7, 8, 9], list(range(20 + 6 * i, 26 + 6 * i))) for i in range(4)]
    rows.append((1, [10, 11], list(range(50, 70))))  # 2 + 20 tokens: over a bound of 17 even alone
    ids, mask, pos, resp_w, groups = padded_batch(rows)
    lengths: list[int] = []
    hook = model.register_forward_pre_hook(lambda module, args, kwargs: lengths.append(kwargs["input_ids"].shape[1]),
                                           with_kwargs=True)
    try:
        got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups, max_tokens_per_pack=17)
    finally:
        hook.remove()
    # Group 0 (5 + 4 x 6 = 29 tokens) as two sequences of 5 + 2 x 6; group 1 alone, over the bound.
    assert lengths == [17, 17, 22]
    assert pack_count(mask, resp_w, groups, max_tokens_per_pack=17) == len(lengths)
    want = compute_response_logprobs(model, ids, mask, pos, resp_w)
    response_mask = mask[:, -resp_w:].float()
    torch.testing.assert_close(got * response_mask, want * response_mask, atol=1e-5, rtol=1e-5)


def test_a_model_whose_attention_bypasses_the_interface_is_refused(tiny_model_and_tokenizer, monkeypatch):
    """The packed forward hands the model a placeholder mask (the group blocks carry the real one):
    a model that attends without transformers' attention interface would use it, so it is refused."""
    model, _ = tiny_model_and_tokenizer
    ids, mask, pos, resp_w, groups = padded_batch()
    monkeypatch.setattr(modeling, "_group_sdpa", lambda *args, **kwargs: pytest.fail("not reached"))
    layer_attention = type(model.model.layers[0].self_attn)
    monkeypatch.setattr(layer_attention, "forward", lambda self, hidden_states, **kwargs: (hidden_states, None))
    with pytest.raises(RuntimeError, match="packing: false"):
        compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    assert model.config._attn_implementation == "sdpa"
    monkeypatch.undo()
    # A layer that attends through plain sdpa with the placeholder fails on its shape.
    with pytest.raises(RuntimeError):
        model(input_ids=ids[:1], attention_mask=modeling._placeholder_mask(ids.device))


@pytest.mark.parametrize("packed", [False, True])
def test_each_row_is_scored_at_its_own_temperature(tiny_model_and_tokenizer, packed):
    """Rows of one prompt group sampled at different temperatures (the group's shared prompt
    position predicts each row's first token at that row's temperature)."""
    model, _ = tiny_model_and_tokenizer
    ids, mask, pos, resp_w, groups = padded_batch()
    temps = torch.tensor([0.7, 1.0, 1.3, 0.5, 1.0, 2.0, 0.9])
    response_mask = mask[:, -resp_w:].float()
    with torch.no_grad():
        if packed:
            got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups, temps, 12)
        else:
            got = compute_response_logprobs(model, ids, mask, pos, resp_w, temps)
        for i, t in enumerate(temps.tolist()):
            alone = compute_response_logprobs(model, ids[i:i + 1], mask[i:i + 1], pos[i:i + 1], resp_w, t)
            torch.testing.assert_close(got[i] * response_mask[i], alone[0] * response_mask[i], atol=1e-5, rtol=1e-5)
        at_one = compute_response_logprobs(model, ids, mask, pos, resp_w, 1.0)
    assert not torch.allclose(got[0] * response_mask[0], at_one[0] * response_mask[0], atol=1e-3)
    with pytest.raises(ValueError, match="temperature must be > 0"):
        compute_response_logprobs(model, ids, mask, pos, resp_w, torch.tensor([1.0, 0.0, 1, 1, 1, 1, 1]))


# Rows 0 and 1 (one group) answer with the same first token: a logit their shared prompt position
# predicts is a target twice.
SAME_FIRST_TOKEN = [ROWS[0], (0, ROWS[1][1], [20, 25]), *ROWS[2:]]


def _fused_and_full_logits(model, monkeypatch, rows, temperature, seed):
    """The packed forward's log-probs and gradients through the fused LM head, then through full
    logits (``temperature``: a number, or "per row")."""
    import nexrl_torch.logprobs as modeling

    model.train()
    ids, mask, pos, resp_w, groups = padded_batch(rows)
    temps = torch.tensor([0.7, 0.7, 1.3, 0.5, 1.0, 2.0, 1.0]) if temperature == "per row" else temperature
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(seed))
    fused = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups, temps)
    fused_grads = grads_of(model, fused, response_mask, weights)
    monkeypatch.setattr(modeling, "_fused_head", lambda model: None)
    full = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups, temps)
    return (fused, fused_grads), (full, grads_of(model, full, response_mask, weights))


@pytest.mark.parametrize("temperature,rows", [(1.0, ROWS), ("per row", ROWS), (1.0, SAME_FIRST_TOKEN),
                                              ("per row", SAME_FIRST_TOKEN)])
def test_the_lm_head_scores_targets_in_place_with_the_numbers_of_full_logits(tiny_model_and_tokenizer, monkeypatch,
                                                                              temperature, rows):
    """The packed forward scores its targets inside the LM head (no vocabulary-sized copies); the
    logprobs and every gradient equal the path through full logits, with rows of one prompt group
    at different temperatures too (their shared prompt position is scored once per temperature),
    and with one target logit picked by two rows."""
    import nexrl_torch.logprobs as modeling

    model, _ = tiny_model_and_tokenizer
    assert modeling._fused_head(model) is model.lm_head
    (fused, fused_grads), (full, full_grads) = _fused_and_full_logits(model, monkeypatch, rows, temperature, seed=2)

    assert torch.equal(fused, full)
    assert set(fused_grads) == set(full_grads)
    for name in full_grads:
        torch.testing.assert_close(fused_grads[name], full_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    assert "forward" not in vars(model.lm_head)  # the head is itself again after the call


def test_a_head_whose_forward_is_wrapped_keeps_its_wrapper(tiny_model_and_tokenizer, monkeypatch):
    """A forward set on the head instance (accelerate's offloading hooks do that) keeps running: the
    packed forward then scores through the logits."""
    import nexrl_torch.logprobs as modeling

    model, _ = tiny_model_and_tokenizer
    ids, mask, pos, resp_w, groups = padded_batch()
    calls = []
    plain = model.lm_head.forward
    monkeypatch.setattr(model.lm_head, "forward", lambda hidden: calls.append(hidden.shape) or plain(hidden))
    assert modeling._fused_head(model) is None
    with torch.no_grad():
        got = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups)
    monkeypatch.undo()
    assert len(calls) == 1 and modeling._fused_head(model) is model.lm_head
    with torch.no_grad():
        torch.testing.assert_close(got, compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups))


def test_the_lm_head_matmuls_run_over_vocabulary_slices(tiny_model_and_tokenizer, monkeypatch):
    """The fused head's vocabulary-wide matmuls run a slice of the vocabulary at a time (faster on the
    CPU): the same numbers as one matmul over all of it, and the same bits on every call."""
    import nexrl_torch.logprobs as modeling

    model, _ = tiny_model_and_tokenizer
    model.train()
    ids, mask, pos, resp_w, groups = padded_batch()
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(3))
    vocab = model.config.vocab_size

    def run(chunk):
        monkeypatch.setattr(modeling, "_VOCAB_CHUNK", chunk)
        logprobs = compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups, 0.8)
        return logprobs, grads_of(model, logprobs, response_mask, weights)

    assert len(modeling._vocab_chunks(vocab)) == 1
    whole, whole_grads = run(vocab)
    monkeypatch.setattr(modeling, "_VOCAB_CHUNK", 7)
    assert [c.stop - c.start for c in modeling._vocab_chunks(vocab)] == [7] * (vocab // 7) + [vocab % 7] * (vocab % 7 > 0)
    (sliced, sliced_grads), (again, again_grads) = run(7), run(7)
    torch.testing.assert_close(sliced, whole, atol=1e-6, rtol=1e-6)
    for name in whole_grads:
        torch.testing.assert_close(sliced_grads[name], whole_grads[name], atol=1e-5, rtol=1e-5, msg=name)
    assert torch.equal(again, sliced) and all(torch.equal(again_grads[n], sliced_grads[n]) for n in sliced_grads)


@pytest.mark.parametrize("tied", [True, False])
def test_the_embedding_gradient_is_dense_and_equal_whether_tied_to_the_head_or_not(build_tiny_model, tied):
    """A tied embedding gives a sparse gradient inside the packed forward (autograd adds its rows into
    the head's dense one); an untied one stays dense. Either way the parameter ends with a dense
    gradient equal to the padded computation's, and AdamW (which refuses sparse gradients) steps."""
    from tests.support.tiny_lm import build_tokenizer

    model = build_tiny_model(build_tokenizer(), seed=4)
    if not tied:
        model.lm_head.weight = torch.nn.Parameter(model.lm_head.weight.detach().clone())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    model.train()
    ids, mask, pos, resp_w, groups = padded_batch()
    response_mask = mask[:, -resp_w:].float()
    weights = torch.randn(response_mask.shape, generator=torch.Generator().manual_seed(5))
    want = grads_of(model, compute_response_logprobs(model, ids, mask, pos, resp_w), response_mask, weights)
    got = grads_of(model, compute_response_logprobs_packed(model, ids, mask, pos, resp_w, groups), response_mask,
                   weights)
    embedding = "model.embed_tokens.weight"
    assert got[embedding].layout == torch.strided and not model.model.embed_tokens.sparse
    torch.testing.assert_close(got[embedding], want[embedding], atol=1e-5, rtol=1e-4)
    torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True).step()


def test_packing_problems_are_named(tiny_model_and_tokenizer):
    model, _ = tiny_model_and_tokenizer
    ids, mask, pos, resp_w, _ = padded_batch()
    holey = mask.clone()
    holey[2, -resp_w] = 0  # row 2's response now starts with a hole
    assert "not a prefix" in packing_problem(model, holey, resp_w)
    no_prompt_end = mask.clone()
    no_prompt_end[0, -resp_w - 1] = 0
    assert "left-padded" in packing_problem(model, no_prompt_end, resp_w)
    model.config._attn_implementation = "eager"
    try:
        assert "'eager'" in packing_problem(model, mask, resp_w)
    finally:
        model.config._attn_implementation = "sdpa"
    named = "activation" if hasattr(model, "activation_checkpointing_enable") else "gradient"  # transformers 5 / 4
    getattr(model, f"{named}_checkpointing_enable")()
    try:
        assert packing_problem(model, mask, resp_w) is None  # the recomputation attends per group too
    finally:
        getattr(model, f"{named}_checkpointing_disable")()
    assert packing_problem(model, mask, resp_w) is None


def test_train_service_packs_or_falls_back(tiny_model_and_tokenizer):
    model, tokenizer = tiny_model_and_tokenizer
    ids, mask, pos, resp_w, groups = padded_batch()
    batch = {"input_ids": ids, "attention_mask": mask, "position_ids": pos, "responses": ids[:, -resp_w:],
             "response_mask": mask[:, -resp_w:], "prompt_groups": groups}
    results = {}
    for packing in ("true", "false", "auto"):
        service = LocalTorchTrainService({"packing": packing, "max_tokens_per_pack": 16}, model=model, tokenizer=tokenizer)
        results[packing] = service.forward(batch) * batch["response_mask"]
    torch.testing.assert_close(results["true"], results["false"], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(results["auto"], results["true"])
    unpacked = LocalTorchTrainService({"packing": False}, model=model, tokenizer=tokenizer)  # a YAML boolean
    assert unpacked.packing == "false"

    model.config._attn_implementation = "eager"
    try:
        eager = LocalTorchTrainService({"packing": "auto"}, model=model, tokenizer=tokenizer).forward(batch)
        torch.testing.assert_close(eager * batch["response_mask"], results["false"], atol=1e-5, rtol=1e-5)
        with pytest.raises(ValueError, match="packing: true, but this batch cannot be packed: attention implementation 'eager'"):
            LocalTorchTrainService({"packing": "true"}, model=model, tokenizer=tokenizer).forward(batch)
    finally:
        model.config._attn_implementation = "sdpa"
    with pytest.raises(ValueError, match="packing: 'yes please' is not one of auto, true, false"):
        LocalTorchTrainService({"packing": "yes please"}, model=model, tokenizer=tokenizer)


@pytest.mark.parametrize("key,message", [
    ("service.train_service.packing", "service.train_service.packing: 'maybe' is not one of auto, true, false"),
    ("service.inference_service.fast_path",
     "service.inference_service.fast_path: 'maybe' is not one of auto, true, false"),
])
def test_bad_speed_flag_in_a_recipe_is_one_clean_error(tiny_model_dir, tmp_path, capfd, key, message):
    import yaml

    from nexrl_core.cli import main

    recipe = {
        "run_dir": str(tmp_path / "run"),
        "logger": {"backend": []},
        "data": {"type": "inline", "rows": [{"prompt": "hello"}]},
        "rollout_worker": {"num_workers": 1, "evaluator": {"type": "exact_match"}},
        "trajectory_pool": {"batch_size": 2, "group_size": 2},
        "trainer": {"type": "self_hosted_grpo", "total_train_steps": 1},
        "weight": {"backend": "in_process"},
        "service": {"train_service": {"model_path": tiny_model_dir},
                    "inference_service": {"backend": "hf", "model_path": tiny_model_dir}},
    }
    section, leaf = key.rsplit(".", 1)
    node = recipe
    for part in section.split("."):
        node = node[part]
    node[leaf] = "maybe"
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(recipe))
    code = main(["run", str(path)])
    out, err = capfd.readouterr()
    assert code != 0
    assert message in err
    assert "Traceback" not in err and "Traceback" not in out



@pytest.mark.parametrize("temperature,rows", [(1.0, ROWS), ("per row", SAME_FIRST_TOKEN)])
def test_above_its_budget_the_head_scores_row_slices_with_the_numbers_of_full_logits(
        tiny_model_and_tokenizer, monkeypatch, temperature, rows):
    """A budget of 3 rows of logits: the fused head goes through the rows 3 at a time and its backward
    computes each slice's logits again; log-probs and every gradient equal the path through full
    logits (a target picked by two rows and per-row temperatures included)."""
    import nexrl_torch.logprobs as modeling

    model, _ = tiny_model_and_tokenizer
    monkeypatch.setattr(modeling, "_SAVED_LOGITS_BUDGET", 3 * 4 * model.config.vocab_size)
    (sliced, sliced_grads), (full, full_grads) = _fused_and_full_logits(model, monkeypatch, rows, temperature, seed=4)
    torch.testing.assert_close(sliced, full, atol=1e-6, rtol=1e-6)
    assert set(sliced_grads) == set(full_grads)
    for name in full_grads:
        torch.testing.assert_close(sliced_grads[name], full_grads[name], atol=1e-5, rtol=1e-5, msg=name)
