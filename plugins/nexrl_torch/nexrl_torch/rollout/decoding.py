"""Decoding sessions for the in-process engine: a KV cache plus prefill / step / select.

Three implementations of one interface:

- :class:`HFSession` drives any transformers causal LM through its own forward and
  ``DynamicCache`` (growing every step).
- :class:`StaticHFSession` (the generic static path, :class:`StaticHF`) drives the models off the
  fast path that transformers runs over a preallocated ``StaticCache`` (the class's own
  ``_can_compile_fullgraph`` flag and the cache layers built for its config decide); on a GPU its
  decode steps go through ``torch.compile`` with CUDA graphs. Not batch-invariant. By default
  (``static_cache: auto``) on a CUDA device only: eager on the CPU it decoded 0.92-1.02x as fast
  as :class:`HFSession` (``benchmarks/results/family_decode_static.json``).
- :class:`FastLlamaSession` runs Llama-family models (``llama``, ``qwen2``, ``qwen3`` with its
  per-head q/k norms, ``mistral``), Gemma 3 text (``gemma3_text``: (1 + w) norms, a norm after
  each block's output, scaled embeddings, sliding-window layers with their own rotary base,
  soft-capped logits) and Qwen3-MoE (``qwen3_moe``: top-k experts per token, see
  :class:`_Experts`) with its own loop over the model's weights: q/k/v and gate/up fused into one
  matmul each, a preallocated KV buffer written in place, and — on CPU — weights prepacked: for the
  compiled kernels' few-row matmul in float32, else for oneDNN. On this kind of machine MKL's fp32
  GEMM runs at a third of oneDNN's speed for the few-row matmuls of decoding (16 x 576 x 49152:
  22 ms vs 7.7 ms), and the compiled matmul all of a SmolLM2 decode step's linears at 16 rows in
  28-33 ms against oneDNN's 35-39; a decode step through the HF forward spends about as long in
  Python and mask building as in matmuls. Same fp32 maths, different summation order: logits
  agree with the HF forward to ~1e-5.

**Batch invariance.** A row's logits in :class:`FastLlamaSession` do not depend on the other rows
of its batch, bit for bit, so a seeded request samples the same tokens with the same logprobs
whichever requests it was batched with (what makes runs with many rollout workers reproducible).
Measured on CPU with oneDNN, one or two threads: a prepacked matmul gives each row the same bits
for any row count M >= 2 (M = 1 takes another kernel for some shapes, so a lone row is doubled).
A row's attention result changes with the masked key columns around its own (left padding, a
longer neighbour), so attention runs once per group of rows that share their first key column,
over exactly their own keys, with no mask (a sliding-window layer's decode step over the last
``window`` of them; its prefill, when the window is shorter than the run, with a band mask).
Decode steps attend through :func:`decode_attention` (two matmuls): with two threads torch's CPU
``scaled_dot_product_attention`` gave a row other bits beside a different number of rows; the
prefill's causal SDPA did not (SmolLM2, 220 cases). (MKL's ``F.linear`` picks kernels by M: 1,
2-15, 16+; the transformers forward is not batch-invariant.) The experts of a sparse block each
run one prepacked matmul over the tokens routed to them, so a token's bits do not depend on how
many others share its experts either.
With the compiled CPU kernels (:mod:`nexrl_torch_kernels`, the default where they build) a
decode step's work between its matmuls is one C++ call per stage, each row computed by one thread
in its own fixed order, and a float32 matmul gives each output one multiply-add chain over its
inputs in order, for any number of rows (one row needs no doubling). :class:`FastLlama` checks
batch invariance once on first use and says so when it does not hold on the machine at hand.

:class:`FastLlama` holds the packed weights. It repacks itself when any parameter of the model
was modified in place since it last packed (tensor version counters), so an optimizer step on a
shared model or an engine ``load_weights`` can never leave it serving stale weights. It checks
itself against the HF forward once on first use and turns itself off (with a warning) if the
logits disagree, so an unexpected model variant falls back to the HF path instead of
generating from wrong numbers.
"""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from loguru import logger

from ..models import auto_flag

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

    from nexrl_torch_kernels import DecodeKernels

# The compiled kernels are an optional distribution (nexrl-torch-kernels): without it, torch ops.
try:
    import nexrl_torch_kernels
except ImportError:
    nexrl_torch_kernels = None  # type: ignore[assignment]
KERNELS_MISSING = "not installed (pip install nexrl-torch-kernels)"
KERNEL_PROBLEMS_SAID: set[str] = set()

FAST_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral", "gemma3_text", "qwen3_moe")
# What the compiled kernels compute: Llama-shaped layers (no extra norms, no experts, no window).
KERNEL_MODEL_TYPES = ("llama", "qwen2", "qwen3", "mistral")
# RMS norms that scale by (1 + weight), in float32 before the cast back (Gemma 3).
UNIT_OFFSET_NORM_TYPES = ("gemma3_text",)
# Per-head RMS norms of the queries and keys before the rotary embedding (Qwen3, Gemma 3): the
# torch-op paths apply them; the compiled kernels do not (they rotate inside their attention call).
HEAD_NORMS = ("q_norm", "k_norm")
SELF_CHECK_TOLERANCE = 1e-3  # max |logit difference| against the HF forward, relative to the logits' scale
# In bf16 two correct implementations differ by a few units in the last place of the logits (0.6 of
# 30 measured on SmolLM2); a wrong one by the logits' scale.
LOW_PRECISION_ULPS = 8
# The compiled kernels are checked on batches of these sizes (the first row of the 1-row batch is the
# bigger batches' row 1, left-padded): 33 rows cross every blocking of theirs (the matmul's chunks of
# 16 rows, the norm's tasks of 32, SiLU's of 8), 17 is one row past a chunk, 1 is a row alone.
KERNEL_CHECK_BATCHES = (33, 17, 1)
# ... and in float32 within this many units of float32 rounding (eps) of the logits' scale: a correct
# decode differs from the HF forward by up to ~50 (SmolLM2-135M, 33 rows: 6.2e-6 through the kernels,
# 4.6e-6 through the torch ops), a SiLU off by 0.03% by 2,300 or more (2.8e-4 to 9.1e-4 of the scale
# on SmolLM2 and the tests' tiny models), where 1e-3 let it pass.
KERNEL_CHECK_ULPS = 512


class HFSession:
    """One batch's decoding state through the model's own forward and ``DynamicCache``."""

    def __init__(self, model: torch.nn.Module):
        from transformers import DynamicCache

        self.model = model
        self.cache = DynamicCache(config=model.config)
        self.attention_mask = torch.empty(0, 0, dtype=torch.long)  # the prefill's, from then on

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        self.attention_mask = attention_mask
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         past_key_values=self.cache, use_cache=True, logits_to_keep=1)
        return out.logits[:, -1, :]

    def select(self, rows: torch.Tensor) -> None:
        self.cache.batch_select_indices(rows)
        self.attention_mask = self.attention_mask[rows]

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((len(tokens), 1))], dim=1)
        out = self.model(input_ids=tokens.unsqueeze(-1), attention_mask=self.attention_mask,
                         position_ids=positions.unsqueeze(-1), past_key_values=self.cache, use_cache=True)
        return out.logits[:, -1, :]


def _model_config(model_path: str | None, gguf_file: str | None = None) -> dict | None:
    """The model's config.json, read before any weight is loaded (None: a GGUF, the bundled SmolLM2, or
    no config readable here)."""
    import json
    import os

    from ..models import SMOLLM2, hub_snapshot, is_hub_id

    if not model_path or gguf_file or model_path == SMOLLM2:
        return None  # a GGUF is converted from a Llama-family file; nothing to read before that
    folder = str(model_path)
    if not os.path.isfile(os.path.join(folder, "config.json")) and is_hub_id(folder):
        folder = hub_snapshot(folder, download=False) or ""
    try:
        with open(os.path.join(folder, "config.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def config_fast_path_problem(model_path: str | None, gguf_file: str | None = None) -> str | None:
    """What :func:`fast_path_problem` will say, read from the model's config.json before any weight
    is loaded (None: the fast path should serve it, or the config cannot be read here)."""
    config = _model_config(model_path, gguf_file)
    if config is None:
        return None
    model_type = config.get("model_type")
    if model_type not in FAST_MODEL_TYPES:
        return f"model_type {model_type!r} is not on the fast decoding path ({', '.join(FAST_MODEL_TYPES)})"
    if config.get("use_bidirectional_attention"):
        return "bidirectional attention (use_bidirectional_attention) is not on the fast decoding path"
    return None


def config_static_path_problem(config: dict) -> str | None:
    """What :func:`static_path_problem` will say about a model with this config.json (its class's
    flags and the cache transformers builds for it; no weight loaded)."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = config.get("model_type")
    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type)
    model_class = getattr(transformers, name, None) if isinstance(name, str) else None
    if model_class is None:
        return f"transformers {transformers.__version__} has no causal LM class for model_type {model_type!r}"
    try:
        parsed = AutoConfig.for_model(model_type, **{k: v for k, v in config.items() if k != "model_type"})
    except (ValueError, TypeError, KeyError) as exc:
        return f"its config does not load ({exc})"
    return _static_cache_problem(model_class, parsed)


def config_decoding_note(model_path: str | None, gguf_file: str | None = None, *, static_cache: Any = None,
                         device: Any = None) -> str | None:
    """What ``nexrl validate`` and ``nexrl run`` say, before any weight is loaded, about the path that
    will decode the model when the hand-written fast path cannot (None when it can, or no config):
    the choice :func:`make_session_factory` makes for ``static_cache`` on ``device`` (recipe values)."""
    problem = config_fast_path_problem(model_path, gguf_file)
    config = _model_config(model_path, gguf_file)
    if problem is None or config is None:
        return None
    static = config_static_path_problem(config)
    try:
        choice = auto_flag(static_cache, "static_cache")
    except ValueError:  # the key's own check reports it
        choice = "auto"
    if static is None and choice != "false" and (choice == "true" or _cuda_device(device)):
        return (f"{problem}: the engine decodes through transformers' forward over a static KV cache (the generic "
                f"path; decode steps compiled with CUDA graphs on a GPU where the model allows it), "
                f"{GENERIC_NOT_INVARIANT}")
    if static is not None and choice == "true":
        return f"{problem}, nor on the static-cache path ({static}): static_cache: true will fail when the engine loads"
    if static is None:
        static = STATIC_CACHE_OFF if choice == "false" else STATIC_CACHE_CPU
    why = problem if static in problem else f"{problem}, nor on the static-cache path ({static})"
    return (f"{why}: the engine decodes through the transformers forward, slower, and runs with several rollout "
            f"workers are not bit-reproducible (unless max_batch_size: 1)")


def _cuda_device(device: Any) -> bool:
    """Whether a recipe's ``device`` resolves to a CUDA device here (as the engine will resolve it)."""
    text = "auto" if device is None else str(device).strip().lower()
    return torch.cuda.is_available() if text == "auto" else text.startswith("cuda")


def fast_path_problem(model: torch.nn.Module, loaded: bool = True) -> str | None:
    """Why :class:`FastLlama` cannot run ``model`` (None when it can); not ``loaded``: a model built on
    the meta device to be planned (``nexrl plan``), its layout alone judged."""
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    if model_type not in FAST_MODEL_TYPES:
        return f"model_type {model_type!r} (fast path: {', '.join(FAST_MODEL_TYPES)})"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "norm", "rotary_emb")
    if inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        return "unexpected module layout"
    for layer in inner.layers:
        attn, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if attn is None or mlp is None or not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
            return "unexpected attention layout"
        if not all(hasattr(mlp, n) for n in ("gate_proj", "up_proj", "down_proj", "act_fn")):
            problem = _experts_problem(mlp)
            if problem is not None:
                return f"unexpected MLP layout: {problem}"
        extra = {n for n, _ in attn.named_children()} - {"q_proj", "k_proj", "v_proj", "o_proj", *HEAD_NORMS}
        if extra:
            return f"attention has extra modules {sorted(extra)}"
        norms = [n for n in HEAD_NORMS if hasattr(attn, n)]
        if norms and (len(norms) != 2 or any(getattr(getattr(attn, n), "weight", None) is None or
                                             getattr(attn, n).weight.numel() != attn.head_dim for n in norms)):
            return "q/k norms that are not per-head RMS norms"
        window = _sliding_window(model, attn)
        if window is not None and (not isinstance(window, int) or window < 1):
            return f"sliding window {window!r}"
    if getattr(config, "pretraining_tp", 1) not in (None, 1):
        return "pretraining_tp > 1"
    if loaded and any(p.is_meta for p in model.parameters()):
        return "meta tensors"
    return None


def _experts_problem(mlp: torch.nn.Module) -> str | None:
    """Why ``mlp`` is not a sparse block this path runs (Qwen3-MoE's: a softmax router over the
    experts, the top k of them per token, each a gated MLP stored as ``[experts, ...]`` tensors)."""
    experts, router = getattr(mlp, "experts", None), getattr(mlp, "gate", None)
    if experts is None or router is None:
        return "neither a gated MLP nor a sparse block of experts"
    if not all(hasattr(experts, n) for n in ("gate_up_proj", "down_proj", "act_fn")) or \
            not all(hasattr(router, n) for n in ("weight", "top_k", "norm_topk_prob")):
        return "experts without gate_up_proj/down_proj or a router without top_k"
    if getattr(experts, "has_bias", False) or getattr(experts, "is_transposed", False) or \
            not getattr(experts, "is_concatenated", True) or not getattr(experts, "has_gate", True):
        return "experts stored transposed, interleaved, without a gate or with biases"
    if set(n for n, _ in mlp.named_children()) - {"experts", "gate"}:
        return "a sparse block with shared experts"
    return None


def _sliding_window(model: torch.nn.Module, attn: torch.nn.Module) -> int | None:
    """The keys a query of this attention layer sees (itself and the ones before it), None for all.
    Layers that say it themselves (Gemma 3, Qwen2/3 ``layer_types``), else the config's (Mistral)."""
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    return getattr(model.config, "sliding_window", None)


class _Linear:
    """``x @ weight.T + bias`` for the weights of linears that share their input (their outputs side by
    side: fused q/k/v, gate/up). On the CPU the weight is prepacked: for the compiled kernels' few-row
    matmul (float32, when given ``kernels``), else for oneDNN with ``rows_hint`` rows."""

    def __init__(self, weights: list[torch.Tensor], bias: torch.Tensor | None, rows_hint: int,
                 kernels: DecodeKernels | None = None):
        self.rows_hint = rows_hint
        self.bias = None if bias is None else bias.detach().contiguous()
        self.out_features = sum(w.shape[0] for w in weights)
        first = weights[0]
        self.kernels = kernels if first.device.type == "cpu" and first.dtype == torch.float32 else None
        self.packed = self.kernels is None and first.device.type == "cpu" and _onednn_available() and \
            first.dtype in (torch.float32, torch.bfloat16)
        if self.kernels is not None:
            self.weight = self.kernels.pack_linear(weights)
        else:
            weight = _cat(weights)
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, rows_hint) if self.packed else weight

    def refresh(self, weights: list[torch.Tensor], bias: torch.Tensor | None) -> None:
        """New values, at the same addresses where the layout allows it (what a captured CUDA graph reads)."""
        if self.out_features != sum(w.shape[0] for w in weights) or (self.bias is None) != (bias is None):
            _Linear.__init__(self, weights, bias, self.rows_hint, self.kernels)
            return
        if self.kernels is not None:
            self.kernels.pack_linear(weights, self.weight)
        elif self.packed:
            self.weight = torch.ops.mkldnn._reorder_linear_weight(_cat(weights), self.rows_hint)
        else:
            row = 0
            for w in weights:
                if self.weight[row:].data_ptr() != w.data_ptr():
                    self.weight[row:row + w.shape[0]].copy_(w)
                row += w.shape[0]
        if bias is not None and self.bias is not None and self.bias.data_ptr() != bias.data_ptr():
            self.bias.copy_(bias)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            flat = x.reshape(-1, x.shape[-1])
            if flat.stride(-1) != 1:
                flat = flat.contiguous()
            return self.kernels.linear(flat, self.weight, self.out_features, self.bias).view(
                *x.shape[:-1], self.out_features)
        if self.packed:
            if x.numel() == x.shape[-1]:  # one row: M = 1 takes another oneDNN kernel (other bits)
                return torch.ops.mkldnn._linear_pointwise(torch.cat([x, x], dim=-2), self.weight, self.bias,
                                                          "none", [], "")[..., :1, :]
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def _cat(weights: list[torch.Tensor]) -> torch.Tensor:
    return (weights[0] if len(weights) == 1 else torch.cat(weights)).detach().contiguous()


def _onednn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _cat_bias(*linears: torch.nn.Linear) -> torch.Tensor | None:
    if all(lin.bias is None for lin in linears):
        return None
    return torch.cat([lin.bias if lin.bias is not None else lin.weight.new_zeros(lin.out_features) for lin in linears])


def _norm(module: torch.nn.Module, unit_offset: bool, before: tuple | None = None) -> tuple:
    """An RMS norm module as the arguments :func:`_rms_norm` takes after ``x``: its weight (aliased,
    so in-place updates show; Gemma's ``1 + weight`` in float32, a copy, refreshed in ``before``'s
    buffer when given: a captured CUDA graph reads that address), its epsilon, and whether the
    weight scales in float32 before the cast back."""
    eps = module.variance_epsilon if hasattr(module, "variance_epsilon") else module.eps
    if not unit_offset:
        return (module.weight.detach(), eps)
    scale = 1.0 + module.weight.detach().float()
    if before is not None and before[0].shape == scale.shape:
        before[0].copy_(scale)
        return (before[0], eps, True)
    return (scale, eps, True)


class _Layer:
    """One decoder layer's packed weights and the maths around its attention (which the sessions
    run, over their caches): the residual adds, norms and feed-forward of Llama-shaped layers, of
    Gemma 3's (a norm after attention and after the MLP, (1 + w) norms) and of Qwen3-MoE's sparse
    blocks."""

    def __init__(self, model: torch.nn.Module, layer: torch.nn.Module, rows_hint: int,
                 kernels: DecodeKernels | None = None):
        attn, mlp = layer.self_attn, layer.mlp
        self.q_size, self.kv_size = attn.q_proj.out_features, attn.k_proj.out_features
        self.head_dim = attn.head_dim
        # Gemma 3: query_pre_attn_scalar ** -0.5. Its attn_logit_softcapping is not applied by
        # transformers' Gemma 3 attention, nor here (the self-check compares the two).
        self.scaling = attn.scaling
        self.window = _sliding_window(model, attn)
        # Gemma 3 rotates sliding and full layers with their own base: one rotation per layer type.
        self.rope = getattr(attn, "layer_type", None) if hasattr(model.model.rotary_emb, "layer_types") else None
        self.unit_offset = model.config.model_type in UNIT_OFFSET_NORM_TYPES
        self.experts = _Experts(mlp, rows_hint) if hasattr(mlp, "experts") else None
        self.intermediate = 0 if self.experts is not None else mlp.gate_proj.out_features
        self.act: Any = None if self.experts is not None else mlp.act_fn

        def fused(group: tuple[torch.nn.Linear, ...]) -> _Linear:
            return _Linear([lin.weight for lin in group], _cat_bias(*group), rows_hint, kernels)

        qkv, o, gate_up, down = self._linears(layer)
        assert qkv is not None and o is not None
        self.qkv, self.o = fused(qkv), fused(o)
        self.gate_up: _Linear | None = None if gate_up is None else fused(gate_up)
        self.down: _Linear | None = None if down is None else fused(down)
        self._alias_norms(layer)

    @staticmethod
    def _linears(layer: torch.nn.Module) -> tuple[tuple[torch.nn.Linear, ...] | None, ...]:
        attn, mlp = layer.self_attn, layer.mlp
        dense = not hasattr(mlp, "experts")
        return ((attn.q_proj, attn.k_proj, attn.v_proj), (attn.o_proj,),
                (mlp.gate_proj, mlp.up_proj) if dense else None, (mlp.down_proj,) if dense else None)

    def _alias_norms(self, layer: torch.nn.Module) -> None:
        attn, before = layer.self_attn, dict(vars(self))

        def norm(module: torch.nn.Module | None, name: str) -> Any:
            return None if module is None else _norm(module, self.unit_offset, before.get(name))

        gemma = hasattr(layer, "pre_feedforward_layernorm")  # Gemma 3: norms around both blocks' outputs
        self.norm_in = norm(layer.input_layernorm, "norm_in")
        self.q_norm, self.k_norm = norm(getattr(attn, "q_norm", None), "q_norm"), norm(getattr(attn, "k_norm", None), "k_norm")
        self.norm_attention_out = norm(layer.post_attention_layernorm if gemma else None, "norm_attention_out")
        self.norm_post = norm(layer.pre_feedforward_layernorm if gemma else layer.post_attention_layernorm, "norm_post")
        self.norm_mlp_out = norm(layer.post_feedforward_layernorm if gemma else None, "norm_mlp_out")

    def heads(self, q: torch.Tensor, k: torch.Tensor, rows: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Queries and keys ``[rows, width, heads * head_dim]`` as ``[rows, heads, width, head_dim]``,
        each head RMS-normed where the model does it (Qwen3, Gemma 3), before the rotary embedding."""
        q, k = q.view(rows, width, -1, self.head_dim), k.view(rows, width, -1, self.head_dim)
        if self.q_norm is not None:
            q, k = _rms_norm(q, *self.q_norm), _rms_norm(k, *self.k_norm)
        return q.transpose(1, 2), k.transpose(1, 2)

    def add_attention(self, x: torch.Tensor, attention: torch.Tensor) -> torch.Tensor:
        """The residual stream after the attention block (``attention``: heads side by side)."""
        out = self.o(attention)
        if self.norm_attention_out is not None:
            out = _rms_norm(out, *self.norm_attention_out)
        return x + out

    def add_feed_forward(self, x: torch.Tensor) -> torch.Tensor:
        """The residual stream after the feed-forward block."""
        h = _rms_norm(x, *self.norm_post)
        if self.experts is not None:
            out = self.experts(h)
        else:
            assert self.gate_up is not None and self.down is not None  # a dense layer's
            gate, up = self.gate_up(h).split((self.intermediate, self.intermediate), dim=-1)
            out = self.down(self.act(gate) * up)
        if self.norm_mlp_out is not None:
            out = _rms_norm(out, *self.norm_mlp_out)
        return x + out

    def refresh(self, layer: torch.nn.Module) -> None:
        """The layer's current weights into the fused matrices, in place where the layout allows it."""
        for fused, group in zip((self.qkv, self.o, self.gate_up, self.down), self._linears(layer)):
            if fused is not None and group is not None:
                fused.refresh([lin.weight for lin in group], _cat_bias(*group))
        if self.experts is not None:
            self.experts.refresh(layer.mlp)
        self._alias_norms(layer)


class _Experts:
    """A sparse block (Qwen3-MoE): a softmax router picks each token's top-k experts (their weights
    renormalised to sum to 1 with ``norm_topk_prob``); each expert, a gated MLP, runs once over the
    tokens routed to it, and a token sums its experts' outputs, weighted, in expert order (as
    transformers does). Batch-invariant as the dense layers are: an expert's matmul gives a token
    the same bits whatever other tokens share it (the router's and experts' weights are prepacked
    :class:`_Linear` ones: any M >= 2 the same, one token doubled), and a token's sum never
    involves another's."""

    def __init__(self, block: torch.nn.Module, rows_hint: int):
        self.top_k, self.normalize = block.gate.top_k, block.gate.norm_topk_prob
        self.act = block.experts.act_fn
        self.intermediate = block.experts.gate_up_proj.shape[1] // 2
        self.router = _Linear([block.gate.weight], None, rows_hint)
        self.gate_up = [_Linear([w], None, rows_hint) for w in block.experts.gate_up_proj]
        self.down = [_Linear([w], None, rows_hint) for w in block.experts.down_proj]

    def refresh(self, block: torch.nn.Module) -> None:
        self.router.refresh([block.gate.weight], None)
        for fused, w in zip(self.gate_up, block.experts.gate_up_proj):
            fused.refresh([w], None)
        for fused, w in zip(self.down, block.experts.down_proj):
            fused.refresh([w], None)

    def __call__(self, h: torch.Tensor) -> torch.Tensor:
        flat = h.reshape(-1, h.shape[-1])
        probs = torch.softmax(self.router(flat), dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        weights = weights.to(flat.dtype)
        # Group the (token, slot) picks by expert: a stable sort keeps each expert's tokens in order.
        order = chosen.flatten().argsort(stable=True)
        counts = torch.bincount(chosen.flatten(), minlength=len(self.gate_up)).tolist()
        tokens, picked = order // self.top_k, weights.flatten()[order]
        out = torch.zeros_like(flat)
        first = 0
        for expert, count in enumerate(counts):
            if count:
                rows = tokens[first:first + count]
                gate, up = self.gate_up[expert](flat[rows]).split((self.intermediate, self.intermediate), dim=-1)
                y = self.down[expert](self.act(gate) * up) * picked[first:first + count, None]
                out.index_add_(0, rows, y)
                first += count
        return out.view(h.shape)


def kernel_problem(model: torch.nn.Module, planned_dtype: torch.dtype | None = None) -> str | None:
    """Why the compiled decode kernels (:mod:`nexrl_torch_kernels`) cannot run ``model`` on the
    fast path (None when they can); ``planned_dtype``: a model on the meta device that the CPU
    engine will load in that dtype (``nexrl plan``). Whether they build here is not asked."""
    if nexrl_torch_kernels is None:
        return KERNELS_MISSING
    parameter = next(model.parameters())
    if planned_dtype is None and parameter.device.type != "cpu":
        return f"the model is on {parameter.device}, the kernels are for the CPU"
    dtypes, dtype = nexrl_torch_kernels.DTYPES, planned_dtype or parameter.dtype
    if dtype not in dtypes:
        return f"dtype {dtype} (kernels: {', '.join(dtypes.values())})"
    model_type = model.config.model_type
    if model_type not in KERNEL_MODEL_TYPES:
        return f"model_type {model_type!r}: the kernels compute Llama-shaped layers ({', '.join(KERNEL_MODEL_TYPES)})"
    inner = model.model
    if any(_sliding_window(model, layer.self_attn) is not None for layer in inner.layers):
        return "sliding-window attention: the kernels' attention call sees every key of a row"
    if hasattr(inner.layers[0].self_attn, "q_norm"):
        return "per-head q/k norms (Qwen3): the kernels' attention call rotates without them"
    probe = torch.linspace(-8, 8, 33)
    for layer in inner.layers:  # what the activation computes, whatever its class
        if not torch.allclose(layer.mlp.act_fn(probe), F.silu(probe)):
            return f"activation {type(layer.mlp.act_fn).__name__} (kernels: SiLU)"
    attn = inner.layers[0].self_attn
    inv_freq = getattr(inner.rotary_emb, "inv_freq", None)
    if attn.head_dim % 2 or inv_freq is None or 2 * inv_freq.numel() != attn.head_dim:
        return "rotary embedding over part of the head"
    return None


def decode_copies(model: torch.nn.Module, *, on_cuda: bool, dtype: torch.dtype, kernels: bool) -> tuple[int, int]:
    """Bytes of the weight copies the fast path keeps beside the model's own (a model of
    :func:`fast_path_problem`'s layout, in ``dtype``; the meta device will do), and the most one
    refresh allocates before it frees what it replaces: what ``nexrl plan`` counts for the engine.
    :class:`_Linear`'s matrices: on the CPU each one packed (the compiled ``kernels``' layout,
    refreshed in place, or oneDNN's, packed anew from a concatenation at every refresh), the LM head
    included; unpacked (a GPU, a dtype oneDNN does not pack) only the concatenations of several
    linears (q/k/v, gate/up), refreshed in place."""
    size = torch.empty(0, dtype=dtype).element_size()
    groups: list[tuple[int, int]] = []  # (elements, linears concatenated) of each _Linear
    for layer in model.model.layers:
        if hasattr(layer.mlp, "experts"):
            block = layer.mlp
            groups.append((block.gate.weight.numel(), 1))
            groups += [(w[0].numel(), 1) for w in (block.experts.gate_up_proj, block.experts.down_proj)
                       for _ in range(w.shape[0])]
        for group in _Layer._linears(layer):
            if group is not None:
                groups.append((sum(lin.weight.numel() for lin in group), len(group)))
    groups.append((model.lm_head.weight.numel(), 1))
    packed = not on_cuda and (kernels and dtype == torch.float32 or
                              _onednn_available() and dtype in (torch.float32, torch.bfloat16))
    if not packed:
        return sum(n for n, k in groups if k > 1) * size, 0
    if kernels and dtype == torch.float32:
        return sum(n for n, _ in groups) * 4, 0
    # oneDNN: the concatenation (several linears) and the new packed matrix, the old one still held
    return sum(n for n, _ in groups) * size, max(n * (2 if k > 1 else 1) for n, k in groups) * size


class FastLlama:
    """Packed weights of one model of :data:`FAST_MODEL_TYPES`; hands out :class:`FastLlamaSession` objects.
    ``kernels``: decode steps through the compiled CPU kernels (:mod:`nexrl_torch_kernels`)
    instead of torch ops; the self-check turns them off, with a warning, if they disagree."""

    def __init__(self, model: torch.nn.Module, rows_hint: int = 16, kernels: DecodeKernels | None = None):
        problem = fast_path_problem(model)
        if problem:
            raise ValueError(f"fast decoding path unsupported: {problem}")
        self.model = model
        self.rows_hint = rows_hint
        self.kernels = kernels
        self.enabled = True
        self._packed_versions: tuple[int, ...] | None = None
        self.layers: list[_Layer] = []  # packed on first use
        self._checked = False
        self.batch_invariant = False  # set by the self-check on first use

    def _versions(self) -> tuple[int, ...] | None:
        try:
            return tuple(p._version for p in self.model.parameters())
        except RuntimeError:  # inference tensors keep no version counter: repack every time
            return None

    def _pack_if_stale(self) -> None:
        """Pack the weights on first use; after that, repack in place (the same buffers) when a
        parameter was modified since."""
        versions = self._versions()
        if versions is not None and versions == self._packed_versions:
            return
        inner, head = self.model.model, self.model.lm_head
        self.embed = inner.embed_tokens  # Gemma's scales its output: called as the model does
        self.dtype = head.weight.dtype
        self.rotary = inner.rotary_emb
        self.final_norm = _norm(inner.norm, self.model.config.model_type in UNIT_OFFSET_NORM_TYPES,
                                getattr(self, "final_norm", None))
        self.softcap = getattr(self.model.config, "final_logit_softcapping", None)
        head_bias = None if head.bias is None else head.bias.detach()
        if not self.layers:
            kernels = self.kernels
            self.layers = [_Layer(self.model, layer, self.rows_hint, kernels) for layer in inner.layers]
            self.lm_head = _Linear([head.weight], head_bias, self.rows_hint, kernels)
            first = self.layers[0]
            self.num_kv_heads = first.kv_size // first.head_dim
        else:
            for fast, layer in zip(self.layers, inner.layers):
                fast.refresh(layer)
            self.lm_head.refresh([head.weight], head_bias)
        self._packed_versions = versions

    def rotations(self, x: torch.Tensor, positions: torch.Tensor) -> dict[str | None, tuple[torch.Tensor, torch.Tensor]]:
        """cos and sin ``[rows, 1, T, head_dim]`` at ``positions`` ``[rows, T]``, per layer type that
        has its own rotary base (Gemma 3: sliding and full layers), else under None."""
        out = {}
        for kind in dict.fromkeys(layer.rope for layer in self.layers):
            cos, sin = self.rotary(x, positions) if kind is None else self.rotary(x, positions, kind)
            out[kind] = cos.unsqueeze(1), sin.unsqueeze(1)
        return out

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """The head over the last hidden states ``x``: final norm, then (Gemma) tanh soft-capping."""
        logits = self.lm_head(_rms_norm(x, *self.final_norm))
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def session(self, tokens: int | None = None) -> "FastLlamaSession | HFSession":
        """A session for one batch: the fast one, or the HF one if the self-check failed. ``tokens``:
        the batch's :meth:`footprint`, where a decoder reserves its KV cache up front."""
        if self.enabled:
            self._pack_if_stale()
            if not self._checked:
                self._self_check()
                self._checked = True
        return self._fast_session() if self.enabled else HFSession(self.model)

    def __call__(self, tokens: int | None = None) -> "FastLlamaSession | HFSession":
        return self.session(tokens)

    def _fast_session(self) -> "FastLlamaSession":
        return FastLlamaSession(self)

    @staticmethod
    def footprint(rows: int, capacity: int) -> int:
        """KV-cache tokens a batch of ``rows`` rows and ``capacity`` columns holds."""
        return rows * capacity

    def release(self) -> None:
        """Nothing to free between batches: a session's buffers go with it."""

    def refresh(self) -> None:
        """Repack the weights the model holds now (after an in-flight update), in the buffers the
        running session reads."""
        if self.enabled and self.layers:
            self._pack_if_stale()

    @torch.inference_mode()
    def _self_check(self) -> None:
        """Compare prefill + two steps against the HF forward on a left-padded batch, and a padded
        row decoded alone against itself in the batch (batch invariance, bit for bit). The torch ops
        are checked on 2 rows within :data:`SELF_CHECK_TOLERANCE` of the logits' scale; the compiled
        kernels on :data:`KERNEL_CHECK_BATCHES` of 33 rows, each row against the HF forward's, within
        :data:`KERNEL_CHECK_ULPS` of float32 rounding (a bf16 model: :data:`LOW_PRECISION_ULPS`)."""
        vocab = self.model.config.vocab_size
        rows = max(KERNEL_CHECK_BATCHES) if self.kernels is not None else 2
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (rows, 6), generator=generator).to(self.model.device)
        mask = torch.ones_like(ids)
        mask[1::2, :2] = 0  # every other row left-padded
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        nxt = torch.randint(0, vocab, (rows, 2), generator=generator).to(self.model.device)

        def decode(session, rows: slice) -> torch.Tensor:
            keep = int(mask[rows].sum(-1).max())  # without the columns that are padding in every row
            out = [session.prefill(ids[rows, -keep:], mask[rows, -keep:], positions[rows, -keep:])]
            for t in range(2):
                out.append(session.step(nxt[rows, t], positions[rows, -1] + 1 + t))
            return torch.stack(out)

        def batch(n: int) -> slice:
            return slice(1, 2) if n == 1 else slice(0, n)  # alone: the padded row 1

        ref = decode(HFSession(self.model), slice(0, rows))  # every row's last prompt token is real
        scale = max(float(ref.abs().max()), 1.0)
        while True:
            sizes = KERNEL_CHECK_BATCHES if self.kernels is not None else (rows,)
            if self.kernels is not None and ref.dtype == torch.float32:
                tolerance = KERNEL_CHECK_ULPS * torch.finfo(torch.float32).eps
            else:
                tolerance = max(SELF_CHECK_TOLERANCE, LOW_PRECISION_ULPS * torch.finfo(ref.dtype).eps)
            fast = {n: decode(self._fast_session(), batch(n)) for n in sizes}
            worst = max(float((out - ref[:, batch(n)]).abs().max()) for n, out in fast.items())
            if worst <= tolerance * scale:
                break
            message = (f"disagrees with the model's own forward (max |diff| {worst:.3g} at logit scale {scale:.3g}, "
                       f"allowed {tolerance * scale:.3g}; batches of {'/'.join(map(str, sizes))} rows)")
            if self.kernels is None:
                self.enabled = False
                logger.warning(f"fast decoding path {message}; using the transformers forward")
                return
            self.kernels, self.layers, self._packed_versions = None, [], None  # repack for oneDNN
            self._pack_if_stale()
            logger.warning(f"fast decoding path with the compiled CPU kernels {message}; decoding with torch ops")
        alone = fast[1] if 1 in fast else decode(self._fast_session(), batch(1))
        self.batch_invariant = torch.equal(alone[:, 0], fast[max(fast)][:, 1])
        if not self.batch_invariant:
            logger.warning(f"fast decoding path: a row's logits depend on the other rows of its batch on this machine "
                           f"({'GPU kernels pick their algorithm by shape' if ids.is_cuda else 'no oneDNN?'}); runs "
                           f"with several rollout workers are not bit-reproducible")


class FastLlamaSession:
    """One batch's decoding state: a ``[layers, rows, kv_heads, capacity, head_dim]`` K and V buffer,
    each row's first key column (its left padding), and the next free column (all rows advance
    together).

    Finished rows are not copied out at once: they stay in the buffer until at most half the rows
    are live, then the buffer is compacted. Meanwhile the torch ops decode them too (a few more rows
    cost little next to streaming the weights); the compiled kernels decode the live rows only.
    Attention runs per run of adjacent buffer rows with the same first key column (see the module
    doc): callers that order rows by prompt length make few runs.
    """

    def __init__(self, owner: FastLlama):
        self.o = owner
        self.keys = torch.empty(0)  # [layers, rows, kv_heads, capacity, head_dim] from the prefill on
        self.values = torch.empty(0)
        self.starts: list[int] = []  # per buffer row: the column of its first real token
        self.live: torch.Tensor | None = None  # buffer rows the caller's rows map to (None: all, in order)
        self.length = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        """``attention_mask`` must be left padding (each row's real tokens at its end); ``capacity``:
        the columns the batch will need (prompt and new tokens; the buffer grows past it if need be)."""
        rows, width = input_ids.shape
        self._allocate(rows, max(capacity or width + 64, width + 1), input_ids.device)
        self.starts = (width - attention_mask.sum(-1)).tolist()
        return self._forward(input_ids, position_ids)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the caller's ``rows`` (indices into the current rows, in their new order; may repeat)."""
        buffer_rows = self.keys.shape[1]
        live = rows if self.live is None else self.live[rows]
        if len(live) > buffer_rows or len(torch.unique(live)) < len(live) or 2 * len(live) <= buffer_rows:
            self._gather(live)
        else:
            self.live = live

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.length == self.keys.shape[3]:
            self._grow()
        if self.o.kernels is not None:  # decode steps only: a one-token prompt's prefill keeps the torch ops' bits
            return self._kernel_step(tokens, positions)
        if self.live is not None:  # finished rows still in the buffer decode a dummy token
            tokens = tokens.new_zeros(self.keys.shape[1]).index_copy_(0, self.live, tokens)
            positions = positions.new_zeros(self.keys.shape[1]).index_copy_(0, self.live, positions)
        return self._forward(tokens.unsqueeze(-1), positions.unsqueeze(-1), self.live)

    def _allocate(self, rows: int, capacity: int, device: torch.device) -> None:
        o = self.o
        shape = (len(o.layers), rows, o.num_kv_heads, capacity, o.layers[0].head_dim)
        self.keys = torch.empty(shape, dtype=o.dtype, device=device)
        self.values = torch.empty(shape, dtype=o.dtype, device=device)

    def _gather(self, live: torch.Tensor) -> None:
        """Copy the filled columns of buffer rows ``live`` into a fresh buffer."""
        keys, values = self.keys, self.values
        self._allocate(len(live), keys.shape[3], keys.device)
        n = self.length
        self.keys[:, :, :, :n] = keys[:, live, :, :n]
        self.values[:, :, :, :n] = values[:, live, :, :n]
        self.starts = [self.starts[i] for i in live.tolist()]
        self.live = None

    def _grow(self) -> None:
        extra = max(64, self.keys.shape[3])
        pad = list(self.keys.shape)
        pad[3] = extra
        self.keys = torch.cat([self.keys, self.keys.new_empty(pad)], dim=3)
        self.values = torch.cat([self.values, self.values.new_empty(pad)], dim=3)

    def _runs(self) -> list[tuple[int, int, int]]:
        """``(first_row, end_row, start_column)`` of each run of adjacent buffer rows sharing a first key column."""
        runs: list[tuple[int, int, int]] = []
        for row, start in enumerate(self.starts):
            if runs and runs[-1][2] == start:
                runs[-1] = (runs[-1][0], row + 1, start)
            else:
                runs.append((row, row + 1, start))
        return runs

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run ``input_ids`` ``[rows, T]`` into cache columns ``length .. length+T-1`` (T > 1 only for the
        prefill); logits of the last position of ``out_rows`` (all rows when None)."""
        o = self.o
        rows, width = input_ids.shape
        start, end = self.length, self.length + width
        runs = self._runs()
        x = o.embed(input_ids)
        rotations = o.rotations(x, position_ids)
        for i, layer in enumerate(o.layers):
            h = _rms_norm(x, *layer.norm_in)
            q, k, v = layer.qkv(h).split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
            q, k = layer.heads(q, k, rows, width)
            cos, sin = rotations[layer.rope]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i, :, :, start:end] = k
            self.values[i, :, :, start:end] = v.view(rows, width, -1, layer.head_dim).transpose(1, 2)
            attn = self._attend(i, q, runs, end, layer.scaling, layer.window)
            x = layer.add_feed_forward(layer.add_attention(x, attn.transpose(1, 2).reshape(rows, width, -1)))
        self.length = end
        return o.logits(x[:, -1] if out_rows is None else x[out_rows, -1])

    def _kernel_step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """A decode step of the live rows only (``tokens``/``positions`` ``[rows]``, in the caller's
        order) through the compiled kernels: between two matmuls, one call (attention with rotary and
        cache write; residual add with the next norm; SiLU times up). Finished rows still in the
        buffer cost nothing: the few-row matmul's time grows with its rows."""
        o, kernels = self.o, self.o.kernels
        assert kernels is not None  # step() comes here only with them
        rows, column = tokens.shape[0], self.length
        x = o.embed(tokens)
        cos, sin = o.rotary(x, positions.unsqueeze(-1))
        cos, sin = cos.reshape(rows, -1).contiguous(), sin.reshape(rows, -1).contiguous()
        starts = torch.tensor(self.starts, dtype=torch.int64)
        cache_rows = None if self.live is None else self.live.to(torch.int64).contiguous()
        first = o.layers[0]
        normed = torch.empty_like(x)
        attention = x.new_empty(rows, first.q_size)
        activation = x.new_empty(rows, first.intermediate)
        # Llama-shaped layers only (kernel_problem): norms (weight, eps), a dense MLP.
        kernels.add_rms_norm(x, None, first.norm_in[0], first.norm_in[1], normed)
        for i, layer in enumerate(o.layers):
            assert layer.gate_up is not None and layer.down is not None
            kernels.attend(layer.qkv(normed), cos, sin, self.keys[i], self.values[i], starts, column, layer.scaling,
                           attention, cache_rows)
            kernels.add_rms_norm(x, layer.o(attention), layer.norm_post[0], layer.norm_post[1], normed)
            kernels.silu_mul(layer.gate_up(normed), activation)
            following = o.layers[i + 1].norm_in if i + 1 < len(o.layers) else o.final_norm
            kernels.add_rms_norm(x, layer.down(activation), following[0], following[1], normed)
        self.length = column + 1
        return o.lm_head(normed)

    def _attend(self, layer: int, q: torch.Tensor, runs: list[tuple[int, int, int]], end: int,
                scaling: float, window: int | None = None) -> torch.Tensor:
        """Attention of queries ``q`` ``[rows, heads, T, head_dim]`` (the last T columns up to ``end``),
        each run over exactly its rows' own keys (with a sliding ``window``: the last ``window`` of
        them up to each query's own). In the prefill (T > 1) causal, with zeros for padding queries."""
        width = q.shape[2]
        keys, values = self.keys[layer], self.values[layer]
        if width == 1:
            # The query heads of one KV head attend as that head's group of queries: no per-call copy
            # of the keys and values for every query head (what enable_gqa does).
            rows, heads, _, head_dim = q.shape
            grouped = q.reshape(rows, keys.shape[1], heads // keys.shape[1], head_dim)
            first = [s if window is None else max(s, end - window) for _, _, s in runs]
            parts = [decode_attention(grouped[a:b], keys[a:b, :, f:end], values[a:b, :, f:end], scaling)
                     for (a, b, _), f in zip(runs, first)]
            return (parts[0] if len(parts) == 1 else torch.cat(parts)).reshape(rows, heads, 1, head_dim)
        out = q.new_zeros(q.shape)
        for a, b, s in runs:
            if s < end:  # a row of padding only has no query to answer
                # Query i sees keys i - window + 1 .. i: a band mask only where the window is shorter
                # than the run (else the plain causal kernel, the same bits as without a window).
                band = None if window is None or window >= end - s else _band(end - s, window, q.device)
                out[a:b, :, s:] = F.scaled_dot_product_attention(
                    q[a:b, :, s:], keys[a:b, :, s:end], values[a:b, :, s:end], attn_mask=band, scale=scaling,
                    is_causal=band is None, enable_gqa=True)
        return out


def _band(width: int, window: int, device: torch.device) -> torch.Tensor:
    """``[width, width]``: True where query i sees key j (j <= i, j > i - window)."""
    offset = torch.arange(width, device=device)[:, None] - torch.arange(width, device=device)[None, :]
    return (offset >= 0) & (offset < window)


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """``softmax(query @ keys.T * scale) @ values`` over the last two dimensions, as two matmuls and
    a float32 softmax. Each batch row gets the same bits whatever the other rows are: torch's CPU
    SDPA kernel divides its work by the batch's size, and with two threads a row's result changed
    with the number of rows beside it (SmolLM2's shapes, about half the contexts tried), which
    made runs with several rollout workers differ from run to run. Both matmuls run in float32
    whatever the cache's dtype: with bf16 scores (rounded to 8 bits before the softmax) the result
    erred 4x as much as SDPA's against exact arithmetic."""
    scores = torch.matmul(query.float(), keys.float().transpose(-1, -2)).mul_(scale)
    return torch.matmul(torch.softmax(scores, dim=-1), values.float()).to(values.dtype)


# --------------------------------------------------------------------------- the static path (GPU)

CAPACITY_STEP = 64  # columns of a static batch are a multiple of this (fewer shapes, fewer graphs)


def static_rows(rows: int) -> int:
    """Rows a static batch is padded to: a power of two, so few decode-step shapes (and CUDA graphs) exist."""
    return 1 << max(0, rows - 1).bit_length()


def static_capacity(capacity: int) -> int:
    return -(-capacity // CAPACITY_STEP) * CAPACITY_STEP


def kv_token_bytes(model: torch.nn.Module) -> int:
    """Bytes of keys and values one token takes over every layer, in the model's dtype."""
    config = model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next(model.parameters()).dtype
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_budget_tokens(device_bytes: int, fraction: float, weight_bytes: int, workspace_bytes: int,
                     token_bytes: int) -> int:
    """Tokens of KV cache the engine may hold: its share of the device (``fraction``, as vLLM's
    ``gpu_memory_utilization``) less its weights and the decode step's workspace."""
    return max(0, int((fraction * device_bytes - weight_bytes - workspace_bytes) // token_bytes))


class StaticLlama(FastLlama):
    """The fast path with a static KV cache: one pool (zeroed: masked columns must hold finite
    numbers) sized to the batch's footprint, at most ``kv_tokens`` tokens; batches laid out in it
    as ``[rows, 2, layers, kv_heads, capacity, head_dim]`` with rows and capacity rounded up
    (:func:`static_rows`, :func:`static_capacity`), and a decode step of fixed shape that, with
    ``graphs``, is captured once per layout as a CUDA graph and replayed.

    A sliding-window layer masks the columns before its window. A model with experts (Qwen3-MoE)
    runs its decode steps eagerly, never as graphs (:func:`graphs_problem`).

    Weight updates are copied into the fused matrices in place, so captured graphs stay valid. With
    ``release`` the pool is freed after each batch (:meth:`release`, the engine calls it when idle:
    the trainer steps in that memory) and allocated again for the next one; graphs captured against
    an earlier pool address are dropped when the address changes.

    On the CPU the same code runs eagerly (its twin in the tests); the CPU's own fast path is
    :class:`FastLlamaSession`, which attends over exactly each row's keys (batch-invariant) instead
    of a mask over the whole capacity.
    """

    def __init__(self, model: torch.nn.Module, rows_hint: int = 16, *, kv_tokens: int, graphs: bool = False,
                 release: bool = True):
        super().__init__(model, rows_hint)
        if kv_tokens < 1:
            raise ValueError("kv_tokens must be >= 1")
        self.kv_tokens = kv_tokens
        self.graphs = graphs and next(model.parameters()).is_cuda and graphs_problem(model) is None
        self.release_between_batches = release
        self.pool: torch.Tensor | None = None
        self._steps: dict[tuple[int, int, int], _DecodeStep] = {}
        self._graph_memory: Any = None
        # Counters for benchmarks: a pool at a new address drops every captured graph.
        self.pool_allocations = 0
        self.graph_captures = 0

    def _fast_session(self) -> "StaticSession":
        return StaticSession(self)

    @staticmethod
    def footprint(rows: int, capacity: int) -> int:
        return static_rows(rows) * static_capacity(capacity)

    def release(self) -> None:
        if self.release_between_batches:
            self.pool = None

    def view(self, rows: int, capacity: int) -> torch.Tensor:
        """The pool's first ``rows`` row blocks of ``capacity`` columns: ``[rows, 2, layers, kv_heads,
        capacity, head_dim]``. A row's block sits at the same place whatever the row count."""
        layer = self.layers[0]
        block = (2, len(self.layers), self.num_kv_heads, capacity, layer.head_dim)
        need = rows * capacity
        if need > self.kv_tokens:
            raise ValueError(f"a batch of {rows} rows x {capacity} columns needs {need} tokens of KV cache; the "
                             f"budget holds {self.kv_tokens}")
        self._room(need)
        assert self.pool is not None  # _room made it
        return self.pool[:need * block[0] * block[1] * block[2] * block[4]].view(rows, *block)

    def session(self, tokens: int | None = None) -> "FastLlamaSession | HFSession":
        session = super().session()
        if tokens is not None and isinstance(session, StaticSession):
            self._room(min(tokens, self.kv_tokens))  # the batch's rows then move inside one pool
        return session

    def _room(self, tokens: int) -> None:
        """A pool of at least ``tokens`` tokens: a power of two (few sizes, so the allocator hands
        back the same address and captured graphs replay), at most the budget, never the whole
        budget for a small batch. A smaller pool is replaced with its contents kept (a row's block
        does not move)."""
        layer = self.layers[0]
        per_token = 2 * len(self.layers) * self.num_kv_heads * layer.head_dim
        if self.pool is not None and self.pool.numel() >= tokens * per_token:
            return
        size = min(self.kv_tokens, 1 << max(0, tokens - 1).bit_length())
        pool = torch.zeros(size * per_token, dtype=self.dtype, device=self.final_norm[0].device)
        if self.pool is not None:
            pool[:self.pool.numel()].copy_(self.pool)
        self.pool = pool
        self.pool_allocations += 1

    def decode_step(self, rows: int, capacity: int) -> "_DecodeStep":
        """The decode step of this layout over the current pool (captured once per pool address)."""
        assert self.pool is not None  # the session's layout made it
        address = self.pool.data_ptr()
        key = (rows, capacity, address)
        step = self._steps.get(key)
        if step is None:
            if any(k[2] != address for k in self._steps):  # graphs of a freed pool must never replay
                self._steps = {k: v for k, v in self._steps.items() if k[2] == address}
            if self.graphs and (self._graph_memory is None or self._graph_memory[0] != address):
                # Dropped graphs free their memory pool for good: later captures take a new one.
                self._graph_memory = (address, torch.cuda.graph_pool_handle())
            step = self._steps[key] = _DecodeStep(self, self.view(rows, capacity), self._graph_memory[1]
                                                  if self.graphs else None)
        return step


_CAPTURE_LOCK = threading.Lock()


class _DecodeStep:
    """One decode step over a fixed layout: static input buffers (tokens, positions, each row's first
    key column, the column being written), the step's maths over them, and on a GPU that maths
    captured as a CUDA graph on first use and replayed after."""

    def __init__(self, owner: StaticLlama, kv: torch.Tensor, graph_memory: Any):
        self.o = owner
        rows, capacity, device = kv.shape[0], kv.shape[4], kv.device
        self.keys, self.values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)  # [layers, rows, heads, C, D]
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.starts = torch.zeros(rows, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self.columns = torch.arange(capacity, device=device)
        self.graph_memory = graph_memory
        self.graph: Any = None
        self.logits: torch.Tensor | None = None

    def __call__(self) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of the step over the buffers' current contents."""
        if self.graph_memory is None:
            return self._compute()
        if self.graph is None:
            # Warm-up on a side stream, then capture. Both write the same keys and values the replay
            # below writes again: the step is idempotent over its buffers. One capture at a time in
            # the process: entering a capture synchronizes the device, which would break another
            # engine's capture under way (replicas share a card).
            with _CAPTURE_LOCK:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._compute()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: the trainer's thread may allocate on the same card meanwhile.
                with torch.cuda.graph(graph, pool=self.graph_memory, capture_error_mode="thread_local"):
                    self.logits = self._compute()
                self.graph = graph
                self.o.graph_captures += 1
        self.graph.replay()
        assert self.logits is not None  # captured with the graph
        return self.logits.clone()  # the next replay overwrites the graph's output

    def _compute(self) -> torch.Tensor:
        o, rows = self.o, self.tokens.shape[0]
        x = o.embed(self.tokens[:, None])
        rotations = o.rotations(x, self.positions[:, None])
        # Each row sees its own columns up to the one written now: never an empty row (no NaN).
        visible = (self.columns >= self.starts[:, None]) & (self.columns <= self.column)
        masks = {window: (visible if window is None else visible & (self.columns > self.column - window))[:, None, None, :]
                 for window in {layer.window for layer in o.layers}}
        for i, layer in enumerate(o.layers):
            h = _rms_norm(x, *layer.norm_in)
            q, k, v = layer.qkv(h).split((layer.q_size, layer.kv_size, layer.kv_size), dim=-1)
            q, k = layer.heads(q, k, rows, 1)
            cos, sin = rotations[layer.rope]
            q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
            self.keys[i].index_copy_(2, self.column, k)
            self.values[i].index_copy_(2, self.column, v.view(rows, 1, -1, layer.head_dim).transpose(1, 2))
            # A KV head's query heads attend as one group of queries (no copy of keys per query head).
            grouped = q.reshape(rows, self.keys.shape[2], -1, layer.head_dim)
            attn = F.scaled_dot_product_attention(grouped, self.keys[i], self.values[i], attn_mask=masks[layer.window],
                                                  scale=layer.scaling)
            x = layer.add_feed_forward(layer.add_attention(x, attn.reshape(rows, 1, -1)))
        return o.logits(x[:, -1])


class StaticSession(FastLlamaSession):
    """One batch in a :class:`StaticLlama` pool. The prefill is :class:`FastLlamaSession`'s (each run
    of rows over exactly its keys) into the pool's layout; each decode step is the owner's fixed-shape
    :class:`_DecodeStep` for this layout. Finished rows keep their place (they decode a dummy token)
    until at most half the padded rows are live; then the live rows move to the front and the
    layout shrinks. Row moves copy whole row blocks in an order that never overwrites a block
    before it is read, so no second copy of the cache is ever held."""

    o: StaticLlama

    def __init__(self, owner: StaticLlama):
        super().__init__(owner)
        self.rows = 0
        self.capacity = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        rows, width = input_ids.shape
        self.capacity = static_capacity(max(capacity or width + CAPACITY_STEP, width + 1))
        self._layout(static_rows(rows))
        self.starts = (width - attention_mask.sum(-1)).tolist() + [0] * (self.rows - rows)
        self.live = None if rows == self.rows else torch.arange(rows, device=input_ids.device)
        return self._forward(input_ids, position_ids)

    def _layout(self, rows: int) -> None:
        self._uploaded: _DecodeStep | None = None
        self.rows = rows
        kv = self.o.view(rows, self.capacity)
        self.blocks = kv
        self.keys, self.values = kv[:, 0].transpose(0, 1), kv[:, 1].transpose(0, 1)

    def _forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                 out_rows: torch.Tensor | None = None) -> torch.Tensor:
        # The prefill's rows are the first of the padded layout: run them alone.
        real = input_ids.shape[0]
        keys, values, starts = self.keys, self.values, self.starts
        self.keys, self.values, self.starts = keys[:, :real], values[:, :real], starts[:real]
        try:
            return super()._forward(input_ids, position_ids, out_rows)
        finally:
            self.keys, self.values, self.starts = keys, values, starts

    def select(self, rows: torch.Tensor) -> None:
        live = rows if self.live is None else self.live[rows]
        n = len(live)
        target = static_rows(n)
        distinct = len(torch.unique(live)) == n
        if distinct and target == self.rows:
            self.live = live
            return
        if not distinct or target < self.rows or n > self.rows:
            self._move(live.tolist(), target)

    def _move(self, sources: list[int], rows: int) -> None:
        """Row ``j`` of the new layout (``rows`` padded rows) takes buffer row ``sources[j]``."""
        grows = rows > self.rows
        if grows:
            self._layout(rows)  # the old rows keep their blocks: a row's place does not depend on the row count
        order = range(len(sources) - 1, -1, -1) if all(s <= j for j, s in enumerate(sources)) else \
            range(len(sources)) if all(s >= j for j, s in enumerate(sources)) else None
        if order is None:  # neither a compaction nor an expansion: one gather (not made by the engine)
            moved = self.blocks[torch.tensor(sources, device=self.blocks.device)].clone()
            self.blocks[:len(sources)] = moved
        else:
            for j in order:
                if sources[j] != j:
                    self.blocks[j].copy_(self.blocks[sources[j]])
        self.starts = [self.starts[s] for s in sources] + [0] * (rows - len(sources))
        if not grows:
            self._layout(rows)
        self.live = None if len(sources) == rows else torch.arange(len(sources), device=self.blocks.device)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.length == self.capacity:
            raise ValueError(f"static batch full: {self.capacity} columns (pass the capacity the batch needs)")
        step = self.o.decode_step(self.rows, self.capacity)
        if self.live is None:
            step.tokens.copy_(tokens)
            step.positions.copy_(positions)
        else:  # finished rows still in the layout decode a dummy token
            step.tokens.index_copy_(0, self.live, tokens)
            step.positions.index_copy_(0, self.live, positions)
        if self._uploaded is not step:  # first keys per row: new only when the layout changes
            step.starts.copy_(torch.tensor(self.starts, device=step.starts.device))
            self._uploaded = step
        step.column.fill_(self.length)
        logits = step()
        self.length += 1
        return logits if self.live is None else logits[self.live]


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, scale_in_float32: bool = False) -> torch.Tensor:
    """The model's RMSNorm: in float32 for a low-precision ``x``, then cast back and scaled by the
    weight, as transformers' Llama does, or (``scale_in_float32``, Gemma) scaled then cast back."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, (x.shape[-1],), weight, eps)
    if scale_in_float32:
        return F.rms_norm(x.float(), (x.shape[-1],), weight, eps).to(x.dtype)
    return weight * F.rms_norm(x.float(), (x.shape[-1],), None, eps).to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return x * cos + torch.cat((-x[..., half:], x[..., :half]), dim=-1) * sin


def cpu_decode_kernels(model: torch.nn.Module, mode: str) -> DecodeKernels | None:
    """The compiled decode kernels for ``model`` under ``cpu_kernels: mode``, or None (torch ops)."""
    if mode == "false":
        return None
    problem = kernel_problem(model)
    if problem is None:
        assert nexrl_torch_kernels is not None  # kernel_problem said so
        try:
            kernels = nexrl_torch_kernels.decode_kernels()
            logger.info(f"cpu_kernels: decode steps through the compiled kernels ({kernels.path})")
            return kernels
        except nexrl_torch_kernels.KernelBuildError as exc:
            problem = f"they cannot be built here: {exc}"
            if mode == "auto":
                if problem not in KERNEL_PROBLEMS_SAID:  # once per process, not per engine or weight push
                    KERNEL_PROBLEMS_SAID.add(problem)
                    logger.warning(f"cpu_kernels: {problem}; decoding with torch ops (slower decode steps)")
                return None
    if mode == "true":
        raise ValueError(f"cpu_kernels: true, but the compiled decode kernels cannot run: {problem}")
    logger.info(f"cpu_kernels: off ({problem})")
    return None


# --------------------------------------------------------------------------- the generic static path

# Cache layers whose state transformers keeps in fixed tensors written in place (full and sliding attention).
STATIC_CACHE_LAYERS = ("StaticLayer", "StaticSlidingWindowLayer")
STATIC_CACHE_CPU = ("static_cache: auto takes it on a CUDA device only; eager on the CPU it decoded no faster than "
                    "the growing cache")
STATIC_CACHE_OFF = "static_cache: false"
GENERIC_NOT_INVARIANT = ("not batch-invariant (the transformers forward's matmul and attention kernels depend on the "
                         "batch's shape): with several rollout workers, runs are bit-reproducible only with "
                         "max_batch_size: 1")


def _static_cache_problem(model_class: type, config: PreTrainedConfig) -> str | None:
    """Why transformers cannot run ``model_class`` over a ``StaticCache`` built from ``config`` (None when it can)."""
    from transformers import StaticCache

    if getattr(config, "is_encoder_decoder", False):
        return "an encoder-decoder model"
    if not getattr(model_class, "_can_compile_fullgraph", False):
        return f"transformers does not mark {model_class.__name__} as compilable over a static cache " \
               f"(_can_compile_fullgraph)"
    if getattr(config, "use_bidirectional_attention", False):
        return "bidirectional attention"
    try:
        layers = StaticCache(config=config, max_cache_len=CAPACITY_STEP).layers
    except (ValueError, TypeError, KeyError, AttributeError) as exc:
        return f"transformers builds no StaticCache for its config ({exc})"
    kinds = sorted({type(layer).__name__ for layer in layers} - set(STATIC_CACHE_LAYERS))
    if kinds or not layers:
        return f"cache layers {kinds or 'none'} (static path: {', '.join(STATIC_CACHE_LAYERS)})"
    return None


def static_path_problem(model: torch.nn.Module) -> str | None:
    """Why :class:`StaticHF` cannot serve ``model`` (None when it can): the class's own flags and the
    cache transformers builds for its config decide, not a list of model types."""
    config = getattr(model, "config", None)
    if config is None:
        return "no config"
    problem = _static_cache_problem(type(model), config)
    if problem is None and getattr(config, "_attn_implementation", None) not in ("sdpa", "eager"):
        return f"attention implementation {config._attn_implementation!r} (static path: sdpa, eager)"
    if problem is None and any(p.is_meta for p in model.parameters()):
        return "meta tensors"
    return problem


def compile_problem(model: torch.nn.Module) -> str | None:
    """Why a decode step of ``model`` over a static cache is not compiled with CUDA graphs (None when it is)."""
    from transformers import StaticCache

    if any(type(layer).__name__ != "StaticLayer" for layer in StaticCache(config=model.config, max_cache_len=2).layers):
        return "sliding-window cache layers count their tokens in a Python int (every step would recompile)"
    return None


def _decode_forward(model: torch.nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    position_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    out = model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, past_key_values=cache,
                use_cache=True, logits_to_keep=1)
    return out.logits[:, -1, :]


class StaticHF:
    """The generic static path, for models outside :data:`FAST_MODEL_TYPES` that transformers runs over a
    ``StaticCache`` (:func:`static_path_problem`): the model's own forward, over caches preallocated per
    layout (rows x capacity) within ``kv_tokens`` and written in place. With ``compiled`` each decode
    step goes through ``torch.compile`` (on a GPU in ``reduce-overhead`` mode: replayed as CUDA graphs),
    and layouts are padded (:func:`static_rows`, :func:`static_capacity`) so few shapes, and graphs, exist;
    ``pad_shapes`` forces that padding without compiling (how the tests reach it on the CPU).

    Not batch-invariant (:data:`GENERIC_NOT_INVARIANT`). It checks itself against :class:`HFSession`
    once on first use and turns itself off (with a warning) when the logits disagree."""

    def __init__(self, model: torch.nn.Module, *, kv_tokens: int | None = None, compiled: bool = False,
                 pad_shapes: bool | None = None, release: bool = True):
        problem = static_path_problem(model)
        if problem:
            raise ValueError(f"static-cache decoding path unsupported: {problem}")
        if kv_tokens is not None and kv_tokens < 1:
            raise ValueError("kv_tokens must be >= 1")
        self.model = model
        self.kv_tokens = kv_tokens
        self.compiled = compiled
        self.pad_shapes = compiled if pad_shapes is None else pad_shapes
        self.release_between_batches = release
        self.caches: dict[tuple[int, int], Any] = {}  # (rows, capacity) -> StaticCache, reused across batches
        self.enabled = True
        self._checked = False
        self.batch_invariant = False  # by construction: GENERIC_NOT_INVARIANT
        self.sessions_served = 0  # batches this path decoded (not counting the self-check's)
        self._step: Any = _decode_forward
        if compiled:
            mode = "reduce-overhead" if next(model.parameters()).is_cuda else "default"
            self._step = torch.compile(_decode_forward, mode=mode, fullgraph=True, dynamic=False)

    def footprint(self, rows: int, capacity: int) -> int:
        """KV-cache tokens a batch of ``rows`` rows and ``capacity`` columns holds (in its padded layout)."""
        return StaticLlama.footprint(rows, capacity) if self.pad_shapes else rows * capacity

    def __call__(self, tokens: int | None = None) -> "StaticHFSession | HFSession":
        if self.enabled and not self._checked:
            self._checked = True
            self._self_check()
        if not self.enabled:
            return HFSession(self.model)
        self.sessions_served += 1
        return StaticHFSession(self)

    def release(self) -> None:
        if self.release_between_batches:
            self.caches = {}

    def refresh(self) -> None:
        """Nothing packed: the model's own forward reads its weights (updated in place: the addresses a
        captured graph reads stay)."""

    def cache(self, rows: int, capacity: int, keep: Any = None) -> Any:
        """The cache of this layout, reset, or a new one: the others are dropped first (all but ``keep``,
        the one a session still reads) when its shapes are not padded or the budget needs the room."""
        from transformers import StaticCache

        cache = self.caches.get((rows, capacity))
        if cache is not None:
            cache.reset()
            return cache
        need = rows * capacity
        if self.kv_tokens is not None and need > self.kv_tokens:
            raise ValueError(f"a batch of {rows} rows x {capacity} columns needs {need} tokens of KV cache; the "
                             f"budget holds {self.kv_tokens}")
        held = sum(r * c for r, c in self.caches)
        if not self.pad_shapes or (self.kv_tokens is not None and held + need > self.kv_tokens):
            self.caches = {k: c for k, c in self.caches.items() if c is keep}
        cache = self.caches[(rows, capacity)] = StaticCache(config=self.model.config, max_cache_len=capacity)
        return cache

    def step(self, cache: Any, tokens: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Logits ``[rows, vocab]`` of one decode step of every row of ``cache``."""
        if not self.compiled:
            return self._step(self.model, tokens[:, None], mask, positions[:, None], cache)
        if tokens.is_cuda:  # the previous replay's outputs are read by now; the clone outlives the next one
            torch.compiler.cudagraph_mark_step_begin()
        return self._step(self.model, tokens[:, None], mask, positions[:, None], cache).clone()

    @torch.inference_mode()
    def _self_check(self) -> None:
        """Prefill + two steps of a left-padded 2-row batch against :class:`HFSession`, within
        :data:`SELF_CHECK_TOLERANCE` of the logits' scale (a low-precision model: :data:`LOW_PRECISION_ULPS`)."""
        vocab, device = self.model.config.vocab_size, next(self.model.parameters()).device
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab, (2, 6), generator=generator).to(device)
        mask = torch.ones_like(ids)
        mask[1, :2] = 0
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        steps = torch.randint(0, vocab, (2, 2), generator=generator).to(device)

        def decode(session: Any) -> torch.Tensor:
            out = [session.prefill(ids, mask, positions, capacity=ids.shape[1] + 2)]
            out += [session.step(steps[:, t], positions[:, -1] + 1 + t) for t in range(2)]
            return torch.stack(out)

        ref = decode(HFSession(self.model))
        got = decode(StaticHFSession(self))
        self.caches = {}
        scale = max(float(ref.abs().max()), 1.0)
        tolerance = max(SELF_CHECK_TOLERANCE, LOW_PRECISION_ULPS * torch.finfo(ref.dtype).eps) * scale
        worst = float((got - ref).abs().max())
        if not worst <= tolerance:  # NaN included
            self.enabled = False
            logger.warning(f"static-cache decoding path disagrees with the model's own forward (max |diff| {worst:.3g} "
                           f"at logit scale {scale:.3g}, allowed {tolerance:.3g}); using the transformers forward "
                           f"with a growing cache")


class StaticHFSession:
    """One batch in a :class:`StaticHF` cache: all rows advance together (one column per step); each
    row's mask holds its left padding as zeros and ones everywhere after (causality hides the columns
    not written yet), so a decode step's inputs keep their shape. Finished rows keep their place (they
    decode a dummy token) until the layout shrinks (padded: to the next power of two; else to at most
    half its rows); then the live rows are gathered into the smaller layout's cache. Padding rows are
    copies of a real row (finite keys, a row that sees its own tokens)."""

    def __init__(self, owner: StaticHF):
        self.o = owner
        self.cache: Any = None
        self.mask = torch.empty(0, 0, dtype=torch.long)  # [rows, capacity]
        self.live: torch.Tensor | None = None  # layout rows the caller's rows map to (None: all, in order)
        self.rows = self.capacity = self.length = 0

    def prefill(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                capacity: int | None = None) -> torch.Tensor:
        real, width = input_ids.shape
        capacity = max(capacity or width + CAPACITY_STEP, width + 1)
        pad = self.o.pad_shapes
        self.rows, self.capacity = (static_rows(real), static_capacity(capacity)) if pad else (real, capacity)
        self.cache = self.o.cache(self.rows, self.capacity)
        fill = torch.zeros(self.rows, dtype=torch.long, device=input_ids.device)  # padding rows copy row 0
        fill[:real] = torch.arange(real, device=input_ids.device)
        input_ids, attention_mask, position_ids = input_ids[fill], attention_mask[fill], position_ids[fill]
        self.mask = attention_mask.new_ones(self.rows, self.capacity)
        self.mask[:, :width] = attention_mask
        self.live = None if real == self.rows else torch.arange(real, device=input_ids.device)
        self.length = width
        logits = _decode_forward(self.o.model, input_ids, self.mask, position_ids, self.cache)
        return logits if self.live is None else logits[self.live]

    def _layout_rows(self, n: int) -> int:
        if self.o.pad_shapes:
            return static_rows(n)
        return self.rows if n <= self.rows < 2 * n else n

    def select(self, rows: torch.Tensor) -> None:
        """Keep the caller's ``rows`` (indices into the current rows, in their new order; may repeat)."""
        live = rows if self.live is None else self.live[rows]
        n, target = len(live), self._layout_rows(len(live))
        if target == self.rows and len(torch.unique(live)) == n:
            self.live = None if n == self.rows and torch.equal(live, torch.arange(n, device=live.device)) else live
            return
        sources = torch.cat([live, live[:1].expand(target - n)])
        target_cache = self.cache if target == self.rows else self.o.cache(target, self.capacity, keep=self.cache)
        for old, new in zip(self.cache.layers, target_cache.layers):
            keys, values = old.keys[sources], old.values[sources]  # copies: the target may be the same cache
            if not new.is_initialized:
                new.lazy_initialization(keys, values)
            new.keys.copy_(keys)
            new.values.copy_(values)
            new.cumulative_length.copy_(old.cumulative_length)
            if hasattr(old, "cumulative_length_int"):
                new.cumulative_length_int = old.cumulative_length_int
        self.mask = self.mask[sources]
        self.cache, self.rows = target_cache, target
        self.live = None if n == target else torch.arange(n, device=live.device)

    def step(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        if self.length == self.capacity:
            raise ValueError(f"static batch full: {self.capacity} columns (pass the capacity the batch needs)")
        if self.live is not None:  # finished and padding rows decode a dummy token
            tokens = tokens.new_zeros(self.rows).index_copy_(0, self.live, tokens)
            positions = positions.new_zeros(self.rows).index_copy_(0, self.live, positions)
        logits = self.o.step(self.cache, tokens, self.mask, positions)
        self.length += 1
        return logits if self.live is None else logits[self.live]


class HFDecoder:
    """Sessions through the model's own forward (the same interface as :class:`FastLlama`)."""

    def __init__(self, model: torch.nn.Module):
        self.model = model

    def __call__(self, tokens: int | None = None) -> HFSession:
        return HFSession(self.model)

    footprint = staticmethod(FastLlama.footprint)

    def release(self) -> None:
        pass

    def refresh(self) -> None:
        """Nothing packed: the model's own forward reads its weights."""


def graphs_problem(model: torch.nn.Module) -> str | None:
    """Why a decode step of ``model`` cannot be captured as a CUDA graph (None when it can)."""
    if any(hasattr(layer.mlp, "experts") for layer in model.model.layers):
        return "experts are picked per token (their row counts change from step to step)"
    return None


def make_session_factory(model: torch.nn.Module, mode: Any, rows_hint: int, *, kv_tokens: int | None = None,
                         graphs: Any = "auto", release: bool = True, cpu_kernels: Any = "auto",
                         static_cache: Any = "auto"):
    """The engine's decoder: called, it gives a session for one batch; ``footprint(rows, capacity)``
    is the KV-cache tokens such a batch holds; ``release()`` frees what it keeps between batches.

    ``mode`` is ``auto`` (fast path when the model allows it, else as ``static_cache`` says: the
    generic static path :class:`StaticHF` where transformers runs the model over a static cache,
    else the HF forward with a growing cache; the log says which and why), ``true`` (fast path or a
    ValueError saying why not) or ``false`` (HF forward, growing cache). ``static_cache``: ``auto``
    (the static path on a CUDA device only), ``true`` (on any device; a ValueError when the model
    cannot) or ``false``. On a GPU the fast path is :class:`StaticLlama` (a
    static cache of ``kv_tokens`` tokens; decode steps as CUDA graphs unless ``graphs`` is false);
    on the CPU it is :class:`FastLlama`, with the compiled decode kernels unless ``cpu_kernels`` is
    false (``true``: a ValueError when they cannot be built or cannot run the model)."""
    mode, graphs = auto_flag(mode, "fast_path"), auto_flag(graphs, "cuda_graphs")
    cpu_kernels, static_cache = auto_flag(cpu_kernels, "cpu_kernels"), auto_flag(static_cache, "static_cache")
    on_cuda = next(model.parameters()).is_cuda
    if static_cache == "true" and mode == "false":
        raise ValueError("static_cache: true needs fast_path: auto (fast_path: false is the transformers forward with "
                         "a growing cache)")
    if graphs == "true" and (mode == "false" or not on_cuda):
        raise ValueError("cuda_graphs: true needs the fast decoding path (fast_path: auto or true) on a CUDA device")
    if cpu_kernels == "true" and (mode == "false" or on_cuda):
        raise ValueError("cpu_kernels: true needs the fast decoding path (fast_path: auto or true) on the CPU")
    if mode != "false":
        problem = fast_path_problem(model)
        if problem is None:
            if on_cuda:
                if kv_tokens is None:
                    raise ValueError("the static decoding path needs a KV-cache budget (kv_tokens)")
                if graphs != "false" and graphs_problem(model):
                    if graphs == "true":
                        raise ValueError(f"cuda_graphs: true, but this model's decode steps cannot be captured: "
                                         f"{graphs_problem(model)}")
                    logger.info(f"cuda_graphs: off ({graphs_problem(model)}); decode steps run eagerly")
                return StaticLlama(model, rows_hint, kv_tokens=kv_tokens, graphs=graphs != "false", release=release)
            return FastLlama(model, rows_hint, kernels=cpu_decode_kernels(model, cpu_kernels))
        if mode == "true":
            raise ValueError(f"fast_path: true, but the fast decoding path cannot run this model: {problem}")
        static_problem = static_path_problem(model)
        if static_problem is not None and static_cache == "true":
            raise ValueError(f"static_cache: true, but the static-cache path cannot run this model: {static_problem}")
        if static_problem is None and (static_cache == "true" or (static_cache == "auto" and on_cuda)):
            return _generic_static(model, problem, kv_tokens=kv_tokens, graphs=graphs, release=release)
        if static_problem is None:
            static_problem = STATIC_CACHE_OFF if static_cache == "false" else STATIC_CACHE_CPU
        logger.info(f"decoding path: the transformers forward with a growing cache (DynamicCache), slower: not on "
                    f"the fast path ({problem}) nor on the static-cache path ({static_problem}); "
                    f"{GENERIC_NOT_INVARIANT}")
    return HFDecoder(model)


def _generic_static(model: torch.nn.Module, fast_problem: str, *, kv_tokens: int | None, graphs: str,
                    release: bool) -> StaticHF:
    """:class:`StaticHF` for a model off the fast path, compiled with CUDA graphs on a GPU unless
    ``graphs`` is false or :func:`compile_problem` says why not; eager on the CPU."""
    on_cuda = next(model.parameters()).is_cuda
    why_eager = "on the CPU" if not on_cuda else "cuda_graphs: false" if graphs == "false" else compile_problem(model)
    if on_cuda and graphs == "true" and why_eager is not None:
        raise ValueError(f"cuda_graphs: true, but this model's decode steps cannot be captured: {why_eager}")
    logger.info(f"decoding path: transformers' forward over a static KV cache (the generic path; decode steps "
                f"{'compiled with CUDA graphs' if why_eager is None else f'eager: {why_eager}'}) for model_type "
                f"{model.config.model_type!r}, not on the hand-written fast path ({fast_problem}); "
                f"{GENERIC_NOT_INVARIANT}")
    return StaticHF(model, kv_tokens=kv_tokens, compiled=why_eager is None, release=release)
