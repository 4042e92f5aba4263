"""Memory plans (``nexrl plan``) of the local train service and the ``hf`` engine, from the model's
config alone: the model is built on the ``meta`` device (no weights read, exact parameter counts for
any family, LoRA adapters included), the data's prompts are tokenized for their length.

What each term counts, in bytes (P parameters, T trainable ones, L layers, h hidden size):

- train service: float32 master weights (P x 4; a LoRA base in bf16: x 2), gradients and AdamW's
  two moments of the trainable ones (T x 4 and T x 8), bf16 autocast's cached copies of the trained
  linear weights (x 2), a frozen KL reference when the recipe needs one, the activations its
  backward keeps (tokens x L x (10 h + 4 kv + 4 intermediate) elements, bf16 under autocast), the LM
  head's float32 logits (capped as the fused head caps them) and their gradient, and with LoRA the
  merged weights built at each push; with several ranks, each rank's share of the batch's prompt
  groups, and under FSDP2 its shards plus what it gathers whole (the root's parameters and two
  layers' through the forward and backward, one weight at a time when exporting);
- engine: its weights in its dtype, the KV cache of the requests it decodes at once, the decode
  step's logits, and the fast decoding path's own copies of the weights (on the CPU every linear and
  the LM head prepacked, and at each weight push the largest packed anew before the old is freed).

Checked against measured peaks in ``benchmarks/qwen3_shape_lora.py`` and, for LoRA on 2 FSDP2
ranks, ``benchmarks/lora_fsdp_plan.py`` (CPU: each process's peak RSS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from nexrl_core import MemoryItem, MemoryPlan, PlanInputs, Saving

from .logprobs import _SAVED_LOGITS_BUDGET
from .models import ModelSettings, auto_dtype, auto_flag, resolve_device, resolve_model_path
from .rollout.settings import HFBackendSettings
from .train.lora import LoraSettings, add_adapters
from .train.settings import TrainServiceSettings

_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


@dataclass
class ModelShape:
    params: int  # every parameter, a tied embedding once
    linear_params: int  # weights of the decoder's linears (what autocast casts and LoRA merges)
    vocab: int
    hidden: int
    layers: int
    kv_dim: int  # key/value width: kv heads x head dim
    intermediate: int  # the MLP width one token goes through (a MoE: its active experts')
    layer_params: int  # one decoder layer's (what FSDP2 gathers at a time)
    largest: int  # elements of the largest tensor (the embedding, as a rule)
    model: torch.nn.Module  # the model on the meta device


_SHAPES: dict[str, ModelShape] = {}


def model_shape(settings: ModelSettings) -> ModelShape:
    """The model of ``settings`` (``model_path``/``gguf_file``), measured on the meta device (cached)."""
    path = resolve_model_path(settings.model_path, settings.gguf_file)
    if path not in _SHAPES:
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        text = getattr(config, "text_config", None) or config
        heads = int(text.num_attention_heads)
        head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // heads)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        active_experts = getattr(text, "num_experts_per_tok", None)
        moe_width = getattr(text, "moe_intermediate_size", None)
        intermediate = int(active_experts * moe_width) if active_experts and moe_width else int(text.intermediate_size)
        head = model.get_output_embeddings()
        linear = sum(m.weight.numel() for m in model.modules()
                     if isinstance(m, torch.nn.Linear) and m is not head)
        layers = getattr(getattr(model, "model", None), "layers", None) or []
        _SHAPES[path] = ModelShape(
            params=sum(p.numel() for p in model.parameters()), linear_params=linear, vocab=int(text.vocab_size),
            hidden=int(text.hidden_size), layers=int(text.num_hidden_layers), kv_dim=kv_heads * head_dim,
            intermediate=intermediate,
            layer_params=sum(p.numel() for p in layers[0].parameters()) if len(layers) else 0,
            largest=max(p.numel() for p in model.parameters()), model=model)
    return _SHAPES[path]


def _adapter_params(shape: ModelShape, lora: LoraSettings) -> int:
    """Parameters of the adapters ``lora`` adds to the model (peft on a fresh meta copy)."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(shape.model.config)
    add_adapters(model, lora)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def prompt_tokens(settings: ModelSettings, inputs: PlanInputs) -> int:
    """The longest prompt of the data in tokens, chat template applied as the engine applies it."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(settings.model_path, settings.gguf_file))
    longest = 1
    for prompt in inputs.prompts:
        if isinstance(prompt, list) and getattr(tokenizer, "chat_template", None):
            ids = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=True)
            count = len(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
        else:
            text = prompt if isinstance(prompt, str) else " ".join(str(m.get("content", "")) for m in prompt)
            count = len(tokenizer(text)["input_ids"])
        longest = max(longest, count)
    return longest


def _device(settings: ModelSettings) -> str:
    device = resolve_device(settings.device)
    return "cpu" if device.type == "cpu" else f"{device.type}:{device.index or 0}"


def _capacity(device: str) -> dict[str, int]:
    if device == "cpu":
        try:
            with open("/proc/meminfo") as f:
                total = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemTotal:"))
            return {"cpu": total}
        except (OSError, StopIteration):
            return {}
    if device.startswith("cuda") and torch.cuda.is_available():
        return {device: int(torch.cuda.get_device_properties(int(device.split(":")[1])).total_memory)}
    return {}


def _trained_tokens(inputs: PlanInputs, prompt: int, packed: bool, rows: int) -> int:
    """Tokens one forward of ``rows`` rows runs: packed, a group's prompt once."""
    response = inputs.max_new_tokens
    if packed:
        return math.ceil(rows / max(1, inputs.group_size)) * prompt + rows * response
    return rows * (prompt + response)


def train_service_plan(settings: TrainServiceSettings, inputs: PlanInputs) -> MemoryPlan:
    """``LocalTorchTrainService.memory_plan``: one rank (``world_size`` ranks each hold this, FSDP's
    sharded parts divided among them)."""
    shape = model_shape(settings)
    device = _device(settings)
    role = "train service"
    dtype = auto_dtype(settings.dtype, resolve_device(settings.device))
    autocast = dtype == "bfloat16"
    lora = settings.lora
    world = settings.world_size
    shard = world if world > 1 and settings.parallel in ("auto", "fsdp") else 1
    if lora is not None:
        trainable = _adapter_params(shape, lora)
        base = shape.params
        base_bytes = _BYTES[lora.base_dtype]
        weights = base * base_bytes + trainable * 4
        what = f"weights ({base / 1e6:.0f}M frozen {lora.base_dtype}, {trainable / 1e6:.1f}M adapter float32)"
    else:
        trainable = shape.params
        base_bytes = 4
        weights = trainable * 4
        what = f"weights ({trainable / 1e6:.0f}M, float32 masters)"
    items = [MemoryItem(device, role, what, weights // shard),
             MemoryItem(device, role, "gradients (float32)", trainable * 4 // shard)]
    adam = trainable * 8 // shard
    offload = settings.offload_optimizer and device != "cpu"
    items.append(MemoryItem("cpu" if offload else device, role, "AdamW state (2 float32 moments)", adam,
                            "offload_optimizer: on the host between steps" if offload else ""))
    if autocast and lora is None:
        items.append(MemoryItem(device, role, "bf16 copies of the weights (autocast's cache)",
                                shape.linear_params * 2 // shard))
    if inputs.frozen_reference:
        items.append(MemoryItem(device, role, "frozen KL reference (a copy of the model)",
                                shape.params * (2 if autocast and lora is None else 4)))
    if shard > 1:
        # FSDP2 gathers the root's parameters (embeddings, final norm) for the whole forward and
        # backward, and a layer's (the next one prefetched) while it computes.
        root = shape.params - shape.layers * shape.layer_params
        unsharded = (root + 2 * shape.layer_params) * base_bytes
        items.append(MemoryItem(device, role, "parameters FSDP2 gathers (the root's, two layers')",
                                unsharded - unsharded // shard))
    prompt = prompt_tokens(settings, inputs)
    # Each of several ranks trains its share of the batch's prompt groups (shard_rows).
    groups = math.ceil(inputs.batch_size / max(1, inputs.group_size))
    rank_rows = min(inputs.batch_size, math.ceil(groups / world) * max(1, inputs.group_size))
    rows = min(rank_rows, settings.micro_batch_size or rank_rows)
    packed = auto_flag(settings.packing, "packing") != "false"
    tokens = _trained_tokens(inputs, prompt, packed, rows)
    width = 2 if autocast else 4
    per_token = shape.layers * (10 * shape.hidden + 4 * shape.kv_dim + 4 * shape.intermediate) * width
    # With activation checkpointing the backward keeps each layer's input and recomputes one layer at a time.
    per_token_checkpointed = shape.layers * shape.hidden * width + per_token // max(1, shape.layers)
    checkpointed = settings.activation_checkpointing
    activations = tokens * (per_token_checkpointed if checkpointed else per_token)
    items.append(MemoryItem(device, role, "activations kept for the backward", activations,
                            f"{tokens} tokens a forward{' (packed)' if packed else ''}: prompts of up to {prompt}, "
                            f"responses of up to {inputs.max_new_tokens}"
                            f"{'; activation_checkpointing: layer inputs and one layer' if checkpointed else ''}"))
    logits = min(tokens * shape.vocab * 4, _SAVED_LOGITS_BUDGET)
    items.append(MemoryItem(device, role, "LM head logits (float32) and their gradient", 2 * logits))
    if lora is not None:
        items.append(MemoryItem(device, role, "merged weights built at each push",
                                shape.linear_params * base_bytes // shard,
                                "W + BA of every adapted linear, sent to the engine"
                                f"{' (each rank its shards, gathered one weight at a time)' if shard > 1 else ''}"))
    if shard > 1:
        items.append(MemoryItem(device, role, "a weight gathered whole (export, checkpoint)", shape.largest * 4))
    savings = []
    if lora is None:  # gradients, moments (and autocast's copies) of the base go; adapters and the merge come
        adapters = _adapter_params(shape, LoraSettings())
        lora_cost = adapters * 16 + shape.linear_params * 4
        saved = trainable * 12 // shard + (shape.linear_params * 2 // shard if autocast else 0) - lora_cost
        if saved > 0:
            savings.append(Saving(device, "train LoRA adapters instead of every weight (service.train_service.lora: "
                                          "{rank: 16})", saved))
    elif lora.base_dtype == "float32":
        savings.append(Saving(device, "a bf16 base (service.train_service.dtype: bfloat16 and lora.base_dtype: "
                                      "bfloat16)", shape.params * 2))
    if device != "cpu" and not offload:
        savings.append(Saving(device, "service.train_service.offload_optimizer: true", adam))
    if not checkpointed and tokens * (per_token - per_token_checkpointed) > 0:
        savings.append(Saving(device, "service.train_service.activation_checkpointing: true (one more forward a step)",
                              tokens * (per_token - per_token_checkpointed)))
    if rows > max(1, inputs.group_size):
        smaller = max(1, inputs.group_size)
        kept_per_token = per_token_checkpointed if checkpointed else per_token
        saved = activations - _trained_tokens(inputs, prompt, packed, smaller) * kept_per_token
        savings.append(Saving(device, f"service.train_service.micro_batch_size: {smaller}", saved))
    return MemoryPlan(items=items, savings=savings, capacity=_capacity(device))


def engine_plan(settings: HFBackendSettings, inputs: PlanInputs) -> MemoryPlan:
    """The ``hf`` backend's plan: each replica holds this (replica i on the i-th device from ``device``)."""
    shape = model_shape(settings)
    device = _device(settings)
    role = "inference engine"
    dtype = auto_dtype(settings.dtype, resolve_device(settings.device))
    size = _BYTES[dtype]
    prompt = prompt_tokens(settings, inputs)
    at_once = min(settings.max_batch_size, inputs.concurrent_requests)
    kv_tokens = at_once * (prompt + inputs.max_new_tokens)
    if settings.max_kv_tokens:
        kv_tokens = min(kv_tokens, settings.max_kv_tokens)
    kv = kv_tokens * shape.layers * 2 * shape.kv_dim * size
    items = [MemoryItem(device, role, f"weights ({shape.params / 1e6:.0f}M, {dtype})", shape.params * size),
             MemoryItem(device, role, "KV cache", kv, f"{at_once} requests at once x {prompt + inputs.max_new_tokens} "
                                                     f"tokens"),
             MemoryItem(device, role, "decode step logits (float32)", at_once * shape.vocab * 4 * 3)]
    held, refresh, how = _decode_copies(settings, shape, device, dtype)
    if held:
        items.append(MemoryItem(device, role, "decode path's weight copies", held, how))
    if refresh:
        items.append(MemoryItem(device, role, "repacking at a weight push", refresh,
                                "the largest matrix packed anew before the old one is freed"))
    savings = []
    if dtype == "float32":
        held_bf16, refresh_bf16, _ = _decode_copies(settings, shape, device, "bfloat16")
        savings.append(Saving(device, "service.inference_service.dtype: bfloat16 (the engine's weights in bf16)",
                              shape.params * 2 + held + refresh - held_bf16 - refresh_bf16))
    replicas = settings.replicas
    if replicas > 1:
        items.append(MemoryItem(device, role, f"(each of {replicas} replicas holds this on its own device)", 0))
    return MemoryPlan(items=items, savings=savings, capacity=_capacity(device))


def _decode_copies(settings: HFBackendSettings, shape: ModelShape, device: str, dtype: str) -> tuple[int, int, str]:
    """The fast decoding path's own copies of the weights and what a refresh allocates before it frees
    (:func:`~.rollout.decoding.decode_copies`), and how they are held: on the CPU every linear and the
    LM head prepacked, on a GPU the concatenated q/k/v and gate/up; nothing off the fast path."""
    from .rollout.decoding import decode_copies, fast_path_problem, kernel_problem

    if auto_flag(settings.fast_path, "fast_path") == "false" or fast_path_problem(shape.model, loaded=False):
        return 0, 0, ""
    torch_dtype = getattr(torch, dtype)
    on_cuda = device != "cpu"
    kernels = not on_cuda and auto_flag(settings.cpu_kernels, "cpu_kernels") != "false" and \
        kernel_problem(shape.model, planned_dtype=torch_dtype) is None
    held, refresh = decode_copies(shape.model, on_cuda=on_cuda, dtype=torch_dtype, kernels=kernels)
    how = "q/k/v and gate/up concatenated" if on_cuda else \
        f"every linear and the LM head prepacked ({'the compiled kernels' if kernels else 'oneDNN'})"
    return held, refresh, how
