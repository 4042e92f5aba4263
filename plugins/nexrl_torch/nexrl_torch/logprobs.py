"""Model loading and the log-probability convention shared by rollout and training.

Sequence layout (verl's): ``input_ids = [left-padded prompt (P) | right-padded response (R)]``.
The logprob of response token ``t`` is read from the logits at position ``P - 1 + t``, divided
by the temperature its row was sampled at before a softmax over the full vocabulary (temperature
1 for greedy rows, see ``SamplingParams.logprob_temperature``). ``temperature`` is a float or a
per-row ``[B]`` tensor; every trajectory carries its own (``trajectory["sampling"]``). The
in-process engine reports logprobs with the same convention, so rollout and trainer logprobs
differ only by numerics.
"""

from __future__ import annotations

import contextlib
import contextvars
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from transformers import PreTrainedConfig


def compute_response_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    temperature: float | torch.Tensor = 1.0,
) -> torch.Tensor:
    """Logprobs ``[B, response_length]`` of the last ``response_length`` tokens of ``input_ids``,
    at ``temperature`` (a float, or one per row ``[B]``).

    Only the logits that predict response tokens are computed (``logits_to_keep``), and the
    log-softmax is taken as ``logit[token] - logsumexp(logits)`` so no second ``[B, R, V]``
    tensor is materialised. Gradients flow when called outside ``no_grad``.
    """
    if response_length <= 0:
        return input_ids.new_zeros((input_ids.shape[0], 0), dtype=torch.float32)
    _check_temperature(temperature)
    out = model(
        input_ids=input_ids,
        attention_mask=attention_mask,
        position_ids=position_ids,
        use_cache=False,
        logits_to_keep=response_length + 1,
    )
    # Positions P-1 .. P+R-2 predict the R response tokens; the very last logit predicts nothing.
    return token_logprobs(out.logits[:, :-1, :], input_ids[:, -response_length:], temperature)


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor, temperature: float | torch.Tensor = 1.0) -> torch.Tensor:
    """``log_softmax(logits / temperature)[target]`` as ``logit[target] - logsumexp(logits)``, so no
    second vocabulary-sized tensor is materialised. A tensor ``temperature`` holds one value per
    leading index of ``logits`` (per row ``[B]`` of ``[B, R, V]`` logits, per position ``[N]`` of
    ``[N, V]``)."""
    logits = logits.float()
    if isinstance(temperature, torch.Tensor):
        if not bool((temperature == 1).all()):
            t = temperature.to(device=logits.device, dtype=logits.dtype)
            logits = logits / t.reshape(t.shape + (1,) * (logits.dim() - t.dim()))
    elif temperature != 1.0:
        logits = logits / temperature
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _check_temperature(temperature: float | torch.Tensor) -> None:
    if isinstance(temperature, torch.Tensor):
        if not temperature.numel():
            return
        low = float(temperature.min())
    else:
        low = float(temperature)
    if not low > 0:
        raise ValueError(f"temperature must be > 0 for logprobs (greedy rows are scored at 1), got {low}")


def packing_problem(model: torch.nn.Module, attention_mask: torch.Tensor, response_length: int) -> str | None:
    """Why :func:`compute_response_logprobs_packed` cannot take this batch (None when it can)."""
    implementation = getattr(getattr(model, "config", None), "_attn_implementation", None)
    if implementation != "sdpa":
        return f"attention implementation {implementation!r} (packing needs 'sdpa', which honours 4-D masks)"
    if any(getattr(module, "gradient_checkpointing", False) and "_gradient_checkpointing_func" not in vars(module)
           for module in getattr(model, "module", model).modules()):  # DDP wraps the model
        return "activation checkpointing not through transformers' checkpoint function (its recomputation would " \
               "not attend per group)"
    prompt_len = attention_mask.shape[1] - response_length
    if prompt_len < 1 or not bool(attention_mask[:, prompt_len - 1].all()):
        return "a row has no prompt token right before its response (prompts must be left-padded)"
    response = attention_mask[:, prompt_len:].bool()
    lengths = response.sum(-1, keepdim=True)
    if not torch.equal(response, torch.arange(response_length, device=response.device) < lengths):
        return "a response mask is not a prefix (responses must be right-padded)"
    window = sliding_window(model)
    longest = int(attention_mask.sum(-1).max()) if attention_mask.numel() else 0
    if window is not None and longest > window:
        # the group attention attends over a row's whole prompt and response: no window
        return f"sliding-window attention (window {window}) over rows of up to {longest} tokens"
    return None


def sliding_window(model: torch.nn.Module) -> int | None:
    """The attention window of a model some of whose layers attend over a sliding window (Gemma 3's
    sliding layers, Mistral with ``sliding_window``, Qwen with ``use_sliding_window``), else None."""
    config = getattr(getattr(model, "module", model), "config", None)
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return int(window) if any("sliding" in str(kind) for kind in layer_types) else None
    if getattr(config, "use_sliding_window", True) is False:
        return None
    return int(window)


# A packed sequence's tokens attend only within their own GRPO group (prompt and its responses), and a
# response token sees its prompt and its own response only. Attention runs per group block, in one of
# two layouts (:class:`_GroupBlock`): over the block's whole square (a dense mask; few calls, the cheaper
# one for short responses) or as the prompt's causal attention plus each response over its prompt and
# itself, padded to the group's longest response (work ~ rows x response x (prompt + response) instead
# of (prompt + all responses)^2: 7x less for 8 responses of 256 tokens).
_GROUP_ATTENTION = "nexrl_group_sdpa"
# When the split layout is taken: for blocks of at least this many query-key pairs, when its work is at
# most this fraction of the square's. It makes more, smaller calls, which cost more than their arithmetic
# in short blocks. SmolLM2 on 2 CPU cores, forward and backward: the quickstart's 4 x 4 x 48 groups
# (square ~17k) 5% slower split; 4 x 8 x 128 (225k, 0.62) 3% faster; 2 x 8 x 256 (1.2M, 0.51) 12% faster.
_SPLIT_MIN_SQUARE = 1 << 16
_SPLIT_BELOW = 0.75


class _GroupBlock:
    """One group's ``[start, start + prompt + sum(responses))`` span of a packed sequence: its prompt,
    then its responses back to back. Masks and indices are built once per device and reused by every
    layer of the forward."""

    def __init__(self, start: int, prompt: int, responses: list[int]):
        self.start, self.prompt, self.responses = start, prompt, responses
        self.end = start + prompt + sum(responses)
        width = max(responses, default=0)
        square = (self.end - start) ** 2
        self.split = bool(responses) and square >= _SPLIT_MIN_SQUARE \
            and prompt * prompt + len(responses) * width * (prompt + width) <= _SPLIT_BELOW * square
        self._tensors: dict[torch.device, tuple[torch.Tensor, ...]] = {}

    def tensors(self, device: torch.device) -> tuple[torch.Tensor, ...]:
        if device not in self._tensors:
            self._tensors[device] = tuple(t.to(device) for t in (self._split_tensors() if self.split else
                                                                 self._square_tensors()))
        return self._tensors[device]

    def attend(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
               kwargs: dict[str, Any]) -> torch.Tensor:
        """This block's attention output, ``[tokens, heads, head_dim]``, from the packed sequence's
        ``[1, heads, T, head_dim]`` queries, keys and values through transformers' sdpa attention."""
        from transformers.integrations.sdpa_attention import sdpa_attention_forward as sdpa

        a, p, b = self.start, self.start + self.prompt, self.end
        if not self.split:
            mask, additive = self.tensors(query.device)
            if query.device.type == "cpu" and not kwargs.get("dropout") and kwargs.get("softcap") is None \
                    and not kwargs.get("sliding_window"):
                scaling = kwargs.get("scaling")
                return _square_attention(query[0, :, a:b], key[0, :, a:b], value[0, :, a:b], additive,
                                         module.scaling if scaling is None else scaling)
            return sdpa(module, query[:, :, a:b], key[:, :, a:b], value[:, :, a:b], mask, **kwargs)[0][0]
        gather, mask, real = self.tensors(query.device)
        rows = len(self.responses)

        def padded(x: torch.Tensor) -> torch.Tensor:  # [1, heads, T, d] -> [rows, heads, width, d]
            out = x[0, :, a:b].index_select(1, gather)
            return out.view(x.shape[1], rows, -1, x.shape[3]).transpose(0, 1)

        def with_prompt(x: torch.Tensor) -> torch.Tensor:
            return torch.cat([x[:, :, a:p].expand(rows, -1, -1, -1), padded(x)], dim=2)

        prompt = sdpa(module, query[:, :, a:p], key[:, :, a:p], value[:, :, a:p], None, **kwargs)[0][0]  # causal
        out = sdpa(module, padded(query), with_prompt(key), with_prompt(value), mask, **kwargs)[0]
        return torch.cat([prompt, out.reshape(-1, *out.shape[2:]).index_select(0, real)])

    def _square_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """``[1, 1, T, T]``: a token sees the earlier tokens of its own segment and its group's prompt;
        and the same as ``[T, T]`` float32 additions (0 or -inf)."""
        segment = torch.tensor([-1] * self.prompt + [i for i, n in enumerate(self.responses) for _ in range(n)])
        index = torch.arange(len(segment))
        sees = (index[None, :] <= index[:, None]) & ((segment[:, None] == segment[None, :]) | (segment[None, :] < 0))
        return sees[None, None], torch.zeros(sees.shape).masked_fill_(~sees, float("-inf"))

    def _split_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Block positions of each response padded to the longest (``[rows * width]``; padding repeats
        the row's last token, whose output is dropped), the mask over ``prompt + width`` keys
        (``[rows, 1, width, prompt + width]``), and where the real outputs sit in the padded ones."""
        width = max(self.responses)
        lengths = torch.tensor(self.responses)
        offsets = self.prompt + torch.cumsum(lengths, 0) - lengths
        step = torch.arange(width)
        gather = (offsets[:, None] + torch.minimum(step[None, :], lengths[:, None] - 1)).reshape(-1)
        column = torch.arange(self.prompt + width)
        mask = (column[None, :] < self.prompt) | (column[None, :] - self.prompt <= step[:, None])
        mask = mask[None, None].expand(len(lengths), 1, width, self.prompt + width)
        real = (torch.arange(len(lengths))[:, None] * width + step[None, :])[step[None, :] < lengths[:, None]]
        return gather, mask, real


def _square_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, additive_mask: torch.Tensor,
                      scaling: float) -> torch.Tensor:
    """``softmax(q kᵀ * scaling + mask) v`` of one block on the CPU, as two batched matmuls with the
    query heads of each KV head stacked (no copies of the keys and values): ``query`` ``[heads, T, d]``,
    ``key``/``value`` ``[kv_heads, T, d]``; ``[T, heads, d]`` out. torch's CPU flash attention computes
    the masked part of a block too, in tiles sized for long sequences: at the quickstart's blocks
    (90-190 tokens) its forward and backward took about 0.25 s of a 3.5 s update, these matmuls
    about 0.1 s less."""
    heads, tokens, dim = query.shape
    kv_heads = key.shape[0]
    group = heads // kv_heads
    stacked = query.reshape(kv_heads, group * tokens, dim)
    scores = torch.baddbmm(additive_mask.repeat(group, 1).expand(kv_heads, -1, -1), stacked, key.transpose(1, 2),
                           alpha=scaling)
    return torch.bmm(torch.softmax(scores, dim=-1), value).view(heads, tokens, dim).transpose(0, 1)


class _PackedForward:
    """The group blocks of the packed forward under way, and how many attention layers used them."""

    def __init__(self, blocks: list[_GroupBlock]):
        self.blocks = blocks
        self.layers_attended = 0


_packed_forward: contextvars.ContextVar[_PackedForward | None] = contextvars.ContextVar("_packed_forward",
                                                                                        default=None)


def _group_sdpa(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                attention_mask: torch.Tensor | None, **kwargs: Any) -> tuple[torch.Tensor, None]:
    if query.device.type == "cpu" and torch.is_autocast_enabled("cpu"):
        # torch's CPU flash attention runs its backward about twice as long in bf16 as in float32
        # (SmolLM2, 120 group blocks: 262 against 135 ms); float32 errs no more. The output goes on
        # in the autocast dtype, as the bf16 kernel's would.
        with torch.autocast("cpu", enabled=False):
            out, _ = _group_sdpa(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
        return out.to(torch.get_autocast_dtype("cpu")), None
    packed = _packed_forward.get()
    if packed is None:
        raise RuntimeError("nexrl's group attention was called outside a packed forward")
    packed.layers_attended += 1
    parts = [block.attend(module, query, key, value, kwargs) for block in packed.blocks]
    return torch.cat(parts)[None], None  # [batch, tokens, heads, head_dim], as sdpa returns it


def _placeholder_mask(device: torch.device) -> torch.Tensor:
    """What the model gets for a mask in a packed forward (the group blocks carry the real one): empty,
    so an attention layer that bypasses :func:`_group_sdpa` fails on its shape instead of using it."""
    return torch.ones(1, 1, 0, 0, dtype=torch.bool, device=device)


@contextlib.contextmanager
def _routed(config: PreTrainedConfig, packed: _PackedForward):
    """The model's attention goes to :func:`_group_sdpa` over ``packed``'s blocks while inside."""
    previous = config._attn_implementation
    token = _packed_forward.set(packed)
    config._attn_implementation = _GROUP_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous
        _packed_forward.reset(token)


@contextlib.contextmanager
def _recompute_routed(model: torch.nn.Module, config: PreTrainedConfig, packed: _PackedForward):
    """While inside, a layer under activation checkpointing hands its checkpoint function a forward
    that enters :func:`_routed` itself: the backward runs that forward again after the packed
    forward has returned (and on another thread on a GPU), where the routing would be gone."""
    patched = []
    for module in model.modules():
        checkpoint = vars(module).get("_gradient_checkpointing_func")  # transformers sets it per module
        if checkpoint is None or not getattr(module, "gradient_checkpointing", False):
            continue

        def routed_checkpoint(function: Any, *args: Any, _checkpoint: Any = checkpoint, **kwargs: Any) -> Any:
            def routed_function(*inner_args: Any, **inner_kwargs: Any) -> Any:
                with _routed(config, packed):
                    return function(*inner_args, **inner_kwargs)
            return _checkpoint(routed_function, *args, **kwargs)

        module._gradient_checkpointing_func = routed_checkpoint
        patched.append((module, checkpoint))
    try:
        yield
    finally:
        for module, checkpoint in patched:
            module._gradient_checkpointing_func = checkpoint


@contextlib.contextmanager
def _attention_per_group(model: torch.nn.Module, blocks: list[_GroupBlock]):
    """The model's attention runs per group block of the packed sequence while inside, and so does the
    recomputation of checkpointed layers in the backward (:func:`_recompute_routed`). The model gets
    no mask of its own (:func:`_placeholder_mask`), and a forward in which no attention layer came
    through here raises."""
    from transformers import AttentionInterface

    AttentionInterface.register(_GROUP_ATTENTION, _group_sdpa)  # a dict entry: idempotent
    base = getattr(model, "module", model)  # DDP wraps the model
    packed = _PackedForward(blocks)
    with _routed(base.config, packed), _recompute_routed(base, base.config, packed):
        yield
        if not packed.layers_attended:
            raise RuntimeError(f"{type(model).__name__}'s attention does not go through transformers' attention "
                               f"interface; packed training cannot run it (set service.train_service.packing: false)")


def compute_response_logprobs_packed(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    position_ids: torch.Tensor,
    response_length: int,
    prompt_groups: torch.Tensor | None = None,
    temperature: float | torch.Tensor = 1.0,
    max_tokens_per_pack: int = 2048,
    packs: int = 0,
) -> torch.Tensor:
    """:func:`compute_response_logprobs` without computing a single padding token.

    Rows are packed into sequences of at most ``max_tokens_per_pack`` tokens (a group that is
    longer is split, its prompt repeated: :func:`_pack_bins`): each distinct prompt
    (``prompt_groups``; none: every row its own) once, followed by its rows' real response tokens. A token sees its own prompt and the
    earlier tokens of its own segment (attention runs per group, :class:`_GroupBlock`); positions
    are the batch's ``position_ids``; the LM head runs
    only at the positions that predict a response token, each once per temperature (a prompt's
    last position predicts the first token of each of its rows), and for the models of
    ``_PLAIN_HEAD_MODEL_TYPES`` it scores the targets itself (:class:`_TargetLogprobs`).
    Same numbers as the padded computation up to float summation order, gradients included, and
    the same bits on every call (no position with a gradient is gathered twice: on CPU the backward
    of a repeated index adds with atomics, in another order each run).
    Entries past a row's response length are 0. Needs left-padded prompts, right-padded
    responses and an ``sdpa`` model (:func:`packing_problem`). ``packs``: at least that many model
    calls, the missing ones on one token with zero weight (a data-parallel rank with fewer packs
    joins every call's collectives).
    """
    rows = input_ids.shape[0]
    if response_length <= 0:
        return input_ids.new_zeros((rows, 0), dtype=torch.float32)
    _check_temperature(temperature)
    device = input_ids.device
    prompt_len = input_ids.shape[1] - response_length
    mask = attention_mask.bool().cpu()
    ids, positions = input_ids.cpu(), position_ids.cpu()
    members, bins, response_lengths = _pack_bins(mask, response_length, prompt_groups, max_tokens_per_pack)

    parts, dest_rows, dest_cols = [], [], []
    for bin_groups in bins:
        tokens, pos, targets, kept_rows = [], [], [], []
        keep: dict[int, int] = {}  # packed position -> its row in the LM head's output
        pick: list[int] = []  # per target: the LM head row that predicts it
        blocks: list[_GroupBlock] = []
        length = 0
        for group in bin_groups:
            group_start = length
            first = members[group][0]
            prompt_tokens = ids[first, :prompt_len][mask[first, :prompt_len]]
            n_prompt = len(prompt_tokens)
            prompt_last = length + n_prompt - 1
            length += n_prompt
            tokens.append(prompt_tokens)
            pos.append(positions[first, :prompt_len][mask[first, :prompt_len]])
            lengths = []
            for row in members[group]:
                n = response_lengths[row]
                if n == 0:
                    continue
                start, length = length, length + n
                tokens.append(ids[row, prompt_len:prompt_len + n])
                pos.append(positions[row, prompt_len:prompt_len + n])
                lengths.append(n)
                # The prompt's last token predicts response token 0; response token t predicts t+1.
                for position in [prompt_last, *range(start, start + n - 1)]:
                    pick.append(keep.setdefault(position, len(keep)))
                targets.append(ids[row, prompt_len:prompt_len + n])
                kept_rows += [row] * n
                dest_rows += [row] * n
                dest_cols += list(range(n))
            blocks.append(_GroupBlock(group_start, n_prompt, lengths))
        if not keep:
            continue
        # One temperature per target: that of its row.
        temps = temperature[torch.tensor(kept_rows, device=temperature.device)] \
            if isinstance(temperature, torch.Tensor) else temperature
        target_ids = torch.cat(targets).to(device)
        fused = _fused_head(model)
        head = None if fused is None else _TiedHead(fused)
        scoring = contextlib.nullcontext() if head is None else _head_scores(head, pick, target_ids, temps)
        with _attention_per_group(model, blocks), scoring, _sparse_tied_embedding(model, head):
            out = model(
                input_ids=torch.cat(tokens)[None].to(device),
                attention_mask=_placeholder_mask(device),
                position_ids=torch.cat(pos)[None].to(device),
                use_cache=False,
                logits_to_keep=torch.tensor(list(keep), device=device),
            )
        if head is not None:  # the head returned the targets' logprobs
            parts.append(out.logits)
            continue
        # index_select's backward (index_add) sums a prompt row's gradients in target order.
        logits = out.logits[0].index_select(0, torch.tensor(pick, device=device))
        parts.append(token_logprobs(logits, target_ids, temps))
    result = torch.zeros((rows, response_length), dtype=torch.float32, device=device)
    if parts:
        values = torch.cat(parts)
        result = result.index_put((torch.tensor(dest_rows, device=device), torch.tensor(dest_cols, device=device)), values)
    for _ in range(len(parts), packs):
        # A call on one token whose output weighs 0: the forward and backward still reach every layer.
        with _attention_per_group(model, [_GroupBlock(0, 1, [])]):
            out = model(input_ids=ids[:1, -1:].to(device), attention_mask=_placeholder_mask(device),
                        position_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False,
                        logits_to_keep=1)
        result = result + out.logits.float().sum() * 0.0
    return result


# Models whose causal-LM forward is ``logits = lm_head(hidden)`` with nothing after it (no soft-capping,
# no logit scale): the packed forward can score their targets inside the LM head (_TargetLogprobs).
_PLAIN_HEAD_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")


def _fused_head(model: torch.nn.Module) -> torch.nn.Linear | None:
    """The LM head the packed forward scores through :class:`_TargetLogprobs` (None: through logits)."""
    base = getattr(model, "module", model)  # DDP wraps the model
    head = getattr(base, "lm_head", None)
    config = getattr(base, "config", None)
    if getattr(config, "model_type", None) not in _PLAIN_HEAD_MODEL_TYPES or head is None \
            or type(head) is not torch.nn.Linear:
        return None
    # A forward set on the instance (accelerate's offloading hooks) must keep running.
    return head if head.bias is None and "forward" not in vars(head) else None


class _TargetLogprobs(torch.autograd.Function):
    """``log_softmax(hidden @ weight.T / temperature)[target]`` for each target, from the hidden
    states of the positions that predict them. Same numbers as the LM head followed by
    :func:`token_logprobs`, without the vocabulary-sized copies in between: the backward turns the
    saved float32 logits into the softmax in place and adds each target's one-hot there (the LM
    head's output gradient), where autograd would allocate, zero and gather several ``[N, V]``
    tensors. On SmolLM2 that is 7% of a GRPO step's forward and backward (fp32 and bf16).

    Logits larger than :data:`_SAVED_LOGITS_BUDGET` are never kept: the rows go through in slices,
    only each row's log-sum-exp is saved, and the backward computes each slice's logits again."""

    @staticmethod
    def forward(ctx: Any, hidden: torch.Tensor, weight: torch.Tensor, pick: torch.Tensor, targets: torch.Tensor,
                temperature: torch.Tensor | None) -> torch.Tensor:
        slices = _row_slices(hidden.shape[0], weight.shape[0])
        if len(slices) == 1:
            logits, kept_lse = _logits_and_logsumexp(hidden, weight, temperature)
            assert kept_lse is not None  # asked for
            ctx.save_for_backward(hidden, weight, pick, targets, temperature, logits, kept_lse)
            return logits[pick, targets] - kept_lse[pick]
        lse = hidden.new_empty(hidden.shape[0], dtype=torch.float32)
        result = hidden.new_empty(pick.shape[0], dtype=torch.float32)
        for rows in slices:
            logits, slice_lse = _logits_and_logsumexp(hidden[rows], weight, _part(temperature, rows))
            lse[rows] = slice_lse
            here = _in_slice(pick, rows)
            result[here] = logits[pick[here] - rows.start, targets[here]] - lse[pick[here]]
        ctx.save_for_backward(hidden, weight, pick, targets, temperature, None, lse)
        return result

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, pick, targets, temperature, saved_logits, lse = ctx.saved_tensors
        per_row = grad.new_zeros(hidden.shape[0]).index_add_(0, pick, grad)  # d/d lse: every target of the row
        if saved_logits is not None:
            grad_logits = _head_output_grad(saved_logits, lse, per_row, pick, targets, grad, temperature, weight.dtype)
            grad_hidden = torch.matmul(grad_logits, weight) if ctx.needs_input_grad[0] else None
            grad_weight = None
            if ctx.needs_input_grad[1]:
                grad_weight = torch.empty_like(weight)
                for chunk in _vocab_chunks(weight.shape[0]):
                    torch.mm(grad_logits[:, chunk].t(), hidden, out=grad_weight[chunk])
            return grad_hidden, grad_weight, None, None, None
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        # float32 sums over the slices: a bf16 accumulator would round once per slice
        grad_weight_sum = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        for rows in _row_slices(hidden.shape[0], weight.shape[0]):
            logits, _ = _logits_and_logsumexp(hidden[rows], weight, _part(temperature, rows), logsumexp=False)
            here = _in_slice(pick, rows)
            grad_logits = _head_output_grad(logits, lse[rows], per_row[rows], pick[here] - rows.start, targets[here],
                                            grad[here], _part(temperature, rows), weight.dtype)
            if grad_hidden is not None:
                torch.matmul(grad_logits, weight, out=grad_hidden[rows])
            if grad_weight_sum is not None:
                grad_weight_sum.addmm_(grad_logits.t().float(), hidden[rows].float())
        grad_weight = None if grad_weight_sum is None else grad_weight_sum.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def _head_output_grad(logits: torch.Tensor, lse: torch.Tensor, per_row: torch.Tensor, pick: torch.Tensor,
                      targets: torch.Tensor, grad: torch.Tensor, temperature: torch.Tensor | None,
                      dtype: torch.dtype) -> torch.Tensor:
    """The LM head's output gradient, made in place of ``logits`` (float32 ``[rows, V]``): each row's
    softmax times minus its targets' summed gradient, plus each target's own gradient."""
    vocab = logits.shape[1]
    logits = logits.sub_(lse[:, None]).exp_().mul_(-per_row[:, None])
    logits.view(-1).index_add_(0, pick * vocab + targets, grad)
    if temperature is not None:
        logits.div_(temperature[:, None])
    return logits.to(dtype)


# The most float32 logits the fused LM head keeps for its backward (bytes). Above it the rows go
# through in slices and the backward computes them again (one more head matmul) rather than keep
# [tokens, vocab]: 4,096 tokens at Qwen3's 151,936 words would be 2.5 GB. SmolLM2's quickstart
# steps stay under it and keep the faster path.
_SAVED_LOGITS_BUDGET = 256 * 2**20


def _row_slices(rows: int, vocab: int) -> list[slice]:
    per_slice = max(1, _SAVED_LOGITS_BUDGET // (4 * vocab))
    return [slice(start, min(start + per_slice, rows)) for start in range(0, max(rows, 1), per_slice)]


def _part(temperature: torch.Tensor | None, rows: slice) -> torch.Tensor | None:
    return None if temperature is None else temperature[rows]


def _in_slice(pick: torch.Tensor, rows: slice) -> torch.Tensor:
    """Indices of the targets whose row is in ``rows``."""
    return ((pick >= rows.start) & (pick < rows.stop)).nonzero().squeeze(-1)


class _TiedHead:
    """Where the LM head of a packed forward finds its weight: the model's, or the head's view of a
    weight tied with the input embedding (:func:`_sparse_tied_embedding`)."""

    def __init__(self, head: torch.nn.Linear):
        self.head = head
        self.tied_view: torch.Tensor | None = None

    @property
    def weight(self) -> torch.Tensor:
        return self.head.weight if self.tied_view is None else self.tied_view


class _TiedWeight(torch.autograd.Function):
    """A weight shared by the input embedding and the LM head, handed to each as its own view so that
    their gradients meet here: the embedding's sparse rows are added into the head's dense gradient
    in place. Left to autograd, a dense and a sparse gradient of one tensor are added into a copy of
    the dense one (SmolLM2: 113 MB, 35 ms of a 3.3 s forward and backward on the CPU)."""

    @staticmethod
    def forward(ctx: Any, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return weight.view_as(weight), weight.view_as(weight)

    @staticmethod
    def backward(ctx: Any, grad_embedding: torch.Tensor | None, grad_head: torch.Tensor | None) -> torch.Tensor | None:
        if grad_embedding is None or grad_head is None:
            return grad_head if grad_embedding is None else grad_embedding
        if grad_embedding.is_sparse and not grad_head.is_sparse:
            # grad_head is the head's own fresh gradient (nothing else holds it): added into in place
            return grad_head.index_add_(0, grad_embedding._indices()[0], grad_embedding._values())
        return grad_head + grad_embedding


@contextlib.contextmanager
def _sparse_tied_embedding(model: torch.nn.Module, head: _TiedHead | None = None):
    """While inside, an input embedding that shares its weight with the LM head gives a sparse
    gradient: its rows are added into the head's dense gradient, where a dense embedding gradient
    costs a zeroed ``[V, H]`` tensor and a second ``[V, H]`` addition (3% of SmolLM2's forward and
    backward). On the CPU, with the packed forward's own ``head``, the two meet in
    :class:`_TiedWeight` (an addition in place); elsewhere autograd adds them. An untied embedding
    keeps its dense gradient, which optimizers need."""
    base = getattr(model, "module", model)  # DDP wraps the model
    embed, output = base.get_input_embeddings(), base.get_output_embeddings()
    tied = type(embed) is torch.nn.Embedding and output is not None and embed.weight is output.weight
    if not tied or embed.sparse:
        yield
        return
    if head is not None and embed.weight.device.type == "cpu" and embed.max_norm is None:
        def lookup(ids: torch.Tensor) -> torch.Tensor:
            own, head.tied_view = _TiedWeight.apply(embed.weight)
            return torch.nn.functional.embedding(ids, own, embed.padding_idx, None, embed.norm_type,
                                                 embed.scale_grad_by_freq, sparse=True)

        embed.forward = lookup  # an instance attribute shadows the class's forward
        try:
            yield
        finally:
            del embed.forward
            head.tied_view = None
        return
    embed.sparse = True
    try:
        yield
    finally:
        embed.sparse = False


# The LM head's vocabulary-wide matmuls run over slices of this many tokens: MKL runs them 12-27%
# faster on the CPU than one matmul over SmolLM2's 49k columns, whose output does not stay in cache
# (both precisions; at those shapes the bits are even the same).
_VOCAB_CHUNK = 8192


def _vocab_chunks(vocab: int) -> list[slice]:
    return [slice(start, min(start + _VOCAB_CHUNK, vocab)) for start in range(0, vocab, _VOCAB_CHUNK)]


def _logits_and_logsumexp(hidden: torch.Tensor, weight: torch.Tensor, temperature: torch.Tensor | None,
                          logsumexp: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
    """float32 ``hidden @ weight.T / temperature`` (``[N, V]``) and its log-sum-exp per row, a slice of
    the vocabulary at a time: each slice's log-sum-exp is taken while the slice is still in cache (18 ms
    of SmolLM2's 40 ms for 400 rows), then the slices' are combined. Without ``logsumexp``: None."""
    logits = hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
    parts = []
    for chunk in _vocab_chunks(weight.shape[0]):
        piece = logits[:, chunk]
        if hidden.dtype == torch.float32:
            torch.mm(hidden, weight[chunk].t(), out=piece)
        else:
            piece.copy_(torch.mm(hidden, weight[chunk].t()))
        if temperature is not None:
            piece.div_(temperature[:, None])
        if logsumexp:
            parts.append(torch.logsumexp(piece, dim=-1))
    return logits, torch.logsumexp(torch.stack(parts, dim=-1), dim=-1) if logsumexp else None


@contextlib.contextmanager
def _head_scores(head: _TiedHead, pick: list[int], targets: torch.Tensor, temperature: float | torch.Tensor):
    """While inside, ``head`` returns the logprobs of ``targets`` (one per ``pick``, the kept position
    predicting it) in place of logits. It runs inside the model's forward, where a sharded model's
    weights are gathered, and its output is the model's, which sharding and DDP hooks follow."""
    device = targets.device
    # One LM-head row per (kept position, temperature): a position is scored once per temperature.
    temps = temperature.tolist() if isinstance(temperature, torch.Tensor) else [temperature] * len(pick)
    rows: dict[tuple[int, float], int] = {}
    target_row = [rows.setdefault((position, t), len(rows)) for position, t in zip(pick, temps)]
    positions = [position for position, _ in rows]
    row_temps = [t for _, t in rows]
    select = None if positions == list(range(len(positions))) else torch.tensor(positions, device=device)
    row_temperature = None if all(t == 1.0 for t in row_temps) else \
        torch.tensor(row_temps, dtype=torch.float32, device=device)

    def score(hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden[0] if select is None else hidden[0].index_select(0, select)
        return _TargetLogprobs.apply(hidden, head.weight, torch.tensor(target_row, device=device), targets,
                                     row_temperature)

    head.head.forward = score  # an instance attribute shadows the class's forward
    try:
        yield
    finally:
        del head.head.forward


def _pack_bins(mask: torch.Tensor, response_length: int, prompt_groups: torch.Tensor | None,
               max_tokens_per_pack: int) -> tuple[dict[int, list[int]], list[list[int]], list[int]]:
    """Rows by segment, the segments of each packed sequence (greedy bins, in batch order) and each
    row's response length. A segment is a group's prompt with some of its rows: the whole group, or,
    for a group longer than ``max_tokens_per_pack``, as many of its rows as fit beside the prompt (a
    row that does not fit beside it even alone gets a segment of its own). So a pack holds at most
    ``max_tokens_per_pack`` tokens unless one prompt and one response exceed it: the knob bounds the
    activations of a call whatever the group size."""
    prompt_len = mask.shape[1] - response_length
    groups = torch.arange(mask.shape[0]) if prompt_groups is None else prompt_groups.cpu()
    _, inverse = torch.unique(groups, return_inverse=True)
    response_lengths = mask[:, prompt_len:].sum(-1).tolist()
    by_group: dict[int, list[int]] = {}
    for row, group in enumerate(inverse.tolist()):
        by_group.setdefault(group, []).append(row)
    members: dict[int, list[int]] = {}
    sizes: list[int] = []
    for group_rows in by_group.values():
        prompt = int(mask[group_rows[0], :prompt_len].sum())
        rows: list[int] = []
        size = prompt
        for row in group_rows:
            if rows and size + response_lengths[row] > max_tokens_per_pack:
                members[len(members)], rows = rows, []
                sizes.append(size)
                size = prompt
            rows.append(row)
            size += response_lengths[row]
        members[len(members)] = rows
        sizes.append(size)
    bins: list[list[int]] = []
    used = 0
    for segment, size in enumerate(sizes):
        if not bins or used + size > max_tokens_per_pack:
            bins.append([])
            used = 0
        bins[-1].append(segment)
        used += size
    return members, bins, response_lengths


def pack_count(attention_mask: torch.Tensor, response_length: int, prompt_groups: torch.Tensor | None = None,
               max_tokens_per_pack: int = 2048) -> int:
    """Model calls :func:`compute_response_logprobs_packed` makes on these rows (a pack with no
    response token makes none): what ranks compare to make the same number of calls."""
    if response_length <= 0:
        return 0
    members, bins, lengths = _pack_bins(attention_mask.bool().cpu(), response_length, prompt_groups,
                                        max_tokens_per_pack)
    return sum(1 for groups in bins if any(lengths[r] for g in groups for r in members[g]))


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that skip left padding: 0 at the first real token of each row."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def scoring_batch(requests: list[tuple[list[int], list[int], float]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """``(prompt ids, response ids, temperature)`` rows as a batch in the trainer's layout (prompts
    left-padded, responses right-padded): what ``score`` on either side of the backend computes."""
    max_p = max(len(p) for p, _, _ in requests)
    max_r = max(max(len(r) for _, r, _ in requests), 1)
    ids = torch.full((len(requests), max_p + max_r), pad_token_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, (p, r, _) in enumerate(requests):
        ids[row, max_p - len(p):max_p + len(r)] = torch.tensor(list(p) + list(r), dtype=torch.long)
        mask[row, max_p - len(p):max_p + len(r)] = 1
    return {"input_ids": ids, "attention_mask": mask, "position_ids": position_ids_from_mask(mask),
            "responses": ids[:, max_p:], "response_mask": mask[:, max_p:].float(),
            "temperature": torch.tensor([float(t) for _, _, t in requests], dtype=torch.float32)}
