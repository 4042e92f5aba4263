"""The stand-in's model side: a causal LM with LoRA adapters, Tinker's losses, AdamW, sampling, checkpoints.

One base model is loaded once and shared. Each training run owns only its trainable tensors
(LoRA ``A``/``B`` matrices, or every weight for a full fine-tune) and runs the shared module
through :func:`torch.func.functional_call` with those tensors swapped in; a sampler snapshot is a
frozen copy of them. Everything here runs on the server's single worker thread.

Conventions (those of the Tinker docs):

- a datum is ``model_input`` (N tokens) and ``loss_fn_inputs`` of shape ``(N,)``; position ``i``
  predicts ``target_tokens[i]``;
- ``cross_entropy``: ``loss = sum(-logprobs * weights)`` (weights default to 1);
  ``importance_sampling``: ``loss = -sum(exp(logprobs - sampling_logprobs) * advantages)``;
  ``ppo``: ``loss = -sum(min(r * A, clip(r, low, high) * A))`` with ``clip_low_threshold`` (0.8) and
  ``clip_high_threshold`` (1.2) from ``loss_fn_config``; the batch loss is the sum over datums;
- LoRA: ``W x + (alpha / rank) * B A x`` on the attention / MLP / unembedding linear layers the
  request names, ``alpha = 32`` (so the best learning rate does not move with the rank), ``B = 0``
  at the start (a new run samples exactly like the base model);
- ``optim_step`` is ``torch.optim.AdamW`` with the step's ``AdamParams`` (``grad_clip_norm`` > 0
  clips the global gradient norm first); gradients accumulate over ``forward_backward`` calls
  until then;
- sampled logprobs are those of the distribution actually sampled from
  (``log_softmax(logits / temperature)``, full vocabulary, before top-k/top-p truncation; at
  temperature 0 the argmax token's logprob at temperature 1).
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file
from torch import nn
from torch.func import functional_call

LORA_ALPHA = 32.0
CHECKPOINT_FORMAT = 1
LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo")
# Module-name parts that place a linear layer in the attention or MLP block.
_ATTN_PARTS = {"self_attn", "attn", "attention", "self_attention"}
_MLP_PARTS = {"mlp", "feed_forward", "ffn", "experts"}
_TOKENS_PER_CHUNK = 4096  # forward/backward micro-batch budget


class UserError(ValueError):
    """A request the client got wrong: reported as a failed request of category ``user``."""


class LoraLinear(nn.Module):
    """``base(x) + (alpha / rank) * x A^T B^T``; zero-rank placeholders until a run swaps its tensors in."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base = base
        self.lora_A = nn.Parameter(torch.zeros(0, base.in_features), requires_grad=False)
        self.lora_B = nn.Parameter(torch.zeros(base.out_features, 0), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.base(x)
        rank = self.lora_A.shape[0]
        if rank:
            out = out + (x @ self.lora_A.t()) @ self.lora_B.t() * (LORA_ALPHA / rank)
        return out


@dataclass
class Example:
    """One datum as the engine sees it: input tokens and its ``loss_fn_inputs`` arrays."""

    tokens: list[int]
    inputs: dict[str, np.ndarray]


@dataclass
class SampleInput:
    """One checked sample request (:meth:`BaseModel.sample_input`)."""

    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float
    top_k: int
    top_p: float
    stop_tokens: set[int]
    stop_strings: list[str]
    generator: torch.Generator
    prompt_logprobs: bool


class BaseModel:
    """A causal LM (and its tokenizer) served under ``name``, its linear layers wrapped for LoRA."""

    def __init__(self, name: str, model: nn.Module, tokenizer: Any):
        self.name = name
        self.tokenizer = tokenizer
        self.model = model.eval().requires_grad_(False)
        self.lora_targets: dict[str, str] = {}  # module path -> "attn" | "mlp" | "unembed"
        unembed = model.get_output_embeddings()
        for path, module in list(model.named_modules()):
            if not isinstance(module, nn.Linear):
                continue
            parts = set(path.split("."))
            kind = "unembed" if module is unembed else "attn" if parts & _ATTN_PARTS else \
                "mlp" if parts & _MLP_PARTS else None
            if kind is None:
                continue
            parent_path, _, child = path.rpartition(".")
            setattr(model.get_submodule(parent_path) if parent_path else model, child, LoraLinear(module))
            self.lora_targets[path] = kind
        self.vocab_size = int(model.config.vocab_size)
        self.max_length = int(getattr(model.config, "max_position_embeddings", 0) or 1 << 20)
        eos: set[int] = set()
        for source in (getattr(model, "generation_config", None), model.config):
            value = getattr(source, "eos_token_id", None)
            eos.update(value if isinstance(value, (list, tuple)) else [] if value is None else [value])
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            eos.add(int(tokenizer.eos_token_id))
        self.eos_token_ids = eos
        # transformers 5 renamed the forward's KV-cache argument (the old name warns)
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"

    @classmethod
    def from_folder(cls, name: str, folder: str) -> BaseModel:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        return cls(name, model, AutoTokenizer.from_pretrained(folder))

    def full_parameter_names(self) -> list[str]:
        return [n for n, _ in self.model.named_parameters() if not n.endswith((".lora_A", ".lora_B"))]

    def call(self, params: dict[str, torch.Tensor], **kwargs: Any) -> Any:
        return functional_call(self.model, params, args=(), kwargs=kwargs)

    # ------------------------------------------------------------------ forward

    def token_logprobs(self, params: dict[str, torch.Tensor], examples: list[Example]) -> list[torch.Tensor]:
        """Logprob of ``target_tokens[i]`` at every position ``i`` of each example (graph kept)."""
        n = len(examples)
        width = max(len(e.tokens) for e in examples)
        ids = torch.zeros((n, width), dtype=torch.long)
        targets = torch.zeros((n, width), dtype=torch.long)
        mask = torch.zeros((n, width), dtype=torch.long)
        for row, e in enumerate(examples):
            ids[row, :len(e.tokens)] = torch.tensor(e.tokens, dtype=torch.long)
            targets[row, :len(e.tokens)] = torch.from_numpy(e.inputs["target_tokens"].astype(np.int64))
            mask[row, :len(e.tokens)] = 1
        logits = self.call(params, input_ids=ids, attention_mask=mask).logits.float()
        logprobs = torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        return [logprobs[row, :len(e.tokens)] for row, e in enumerate(examples)]

    def check_examples(self, examples: list[Example], loss_fn: str) -> None:
        if loss_fn not in LOSS_FNS:
            raise UserError(f"loss_fn '{loss_fn}' is not supported by the stand-in (supported: {', '.join(LOSS_FNS)})")
        required = {"cross_entropy": ("target_tokens",),
                    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
                    "ppo": ("target_tokens", "logprobs", "advantages")}[loss_fn]
        for index, e in enumerate(examples):
            n = len(e.tokens)
            if n == 0:
                raise UserError(f"datum {index}: model_input is empty")
            if n > self.max_length:
                raise UserError(f"datum {index}: {n} tokens exceed the model's context of {self.max_length}")
            for key in required:
                if key not in e.inputs:
                    raise UserError(f"datum {index}: loss '{loss_fn}' needs loss_fn_inputs['{key}']")
            for key, value in e.inputs.items():
                if value.shape != (n,):
                    raise UserError(f"datum {index}: loss_fn_inputs['{key}'] has shape {list(value.shape)}, "
                                    f"expected [{n}] (one value per model_input token)")
            bad = [t for t in list(e.tokens) + e.inputs["target_tokens"].tolist() if not 0 <= t < self.vocab_size]
            if bad:
                raise UserError(f"datum {index}: token id {bad[0]} is outside the vocabulary (size {self.vocab_size})")

    # ------------------------------------------------------------------ sampling

    def sample_input(self, prompt: list[int], num_samples: int, sampling: Any, prompt_logprobs: bool) -> SampleInput:
        """One sample request checked against this model (a :class:`UserError` names what is wrong)."""
        if not prompt:
            raise UserError("prompt is empty")
        if any(not 0 <= t < self.vocab_size for t in prompt):
            raise UserError(f"prompt holds a token id outside the vocabulary (size {self.vocab_size})")
        if num_samples < 1:
            raise UserError(f"num_samples must be >= 1, got {num_samples}")
        room = self.max_length - len(prompt)
        if room < 1:
            raise UserError(f"prompt has {len(prompt)} tokens; the model's context is {self.max_length}")
        max_tokens = room if sampling.max_tokens is None else min(int(sampling.max_tokens), room)
        if max_tokens < 1:
            raise UserError(f"max_tokens must be >= 1, got {sampling.max_tokens}")
        stop_tokens, stop_strings = self._stops(sampling.stop)
        temperature, top_k, top_p = float(sampling.temperature), int(sampling.top_k), float(sampling.top_p)
        if temperature < 0 or not 0 < top_p <= 1:
            raise UserError(f"need temperature >= 0 and 0 < top_p <= 1, got {temperature} and {top_p}")
        generator = torch.Generator()
        generator.manual_seed(int(sampling.seed) % (2**63) if sampling.seed is not None else
                              int.from_bytes(os.urandom(8), "little") >> 1)
        return SampleInput(list(prompt), int(num_samples), max_tokens, temperature, top_k, top_p, stop_tokens,
                           stop_strings, generator, bool(prompt_logprobs))

    def sample(self, params: dict[str, torch.Tensor], prompt: list[int], num_samples: int, sampling: Any,
               prompt_logprobs: bool) -> tuple[list[tuple[list[int], list[float], str]], list[float] | None]:
        """``num_samples`` continuations of ``prompt``: (tokens, logprobs, "stop" | "length") each."""
        return self.sample_batch(params, [self.sample_input(prompt, num_samples, sampling, prompt_logprobs)])[0]

    @torch.no_grad()
    def sample_batch(self, params: dict[str, torch.Tensor], inputs: list[SampleInput]
                     ) -> list[tuple[list[tuple[list[int], list[float], str]], list[float] | None]]:
        """Several requests of the same weights decoded as one batch, each as :meth:`sample` returns it.

        Prompts are left-padded, identical prompts prefilled once, and a row leaves the batch (and
        the KV cache) when it finishes. A request's tokens come from its own generator, so they do
        not depend on the other requests; its logprobs are those of the logits it was sampled from.
        """
        distinct: dict[tuple[int, ...], int] = {}
        prompt_of = [distinct.setdefault(tuple(s.prompt), len(distinct)) for s in inputs]
        prompts = list(distinct)
        width = max(len(p) for p in prompts)
        ids = torch.zeros((len(prompts), width), dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for row, p in enumerate(prompts):
            ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[row, width - len(p):] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        want_prompt_lps = any(s.prompt_logprobs for s in inputs)
        cache = self._new_cache()
        out = self.call(params, input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=0 if want_prompt_lps else 1, **{self._cache_kwarg: cache})
        prompt_lps: dict[int, list[float]] = {}
        for index, s in enumerate(inputs):
            row = prompt_of[index]
            if s.prompt_logprobs and row not in prompt_lps:
                n = len(prompts[row])
                full = torch.log_softmax(out.logits[row, width - n:].float(), dim=-1)
                prompt_lps[row] = [math.nan] + full[:-1].gather(
                    -1, ids[row, width - n + 1:].unsqueeze(-1)).squeeze(-1).tolist()

        # One row per sample: the prompt's row of the prefill, repeated.
        row_request = [index for index, s in enumerate(inputs) for _ in range(s.num_samples)]
        expand = torch.tensor([prompt_of[index] for index in row_request])
        cache.batch_select_indices(expand)
        mask, logits = mask[expand], out.logits[expand, -1].float()
        next_pos = positions[expand, -1] + 1
        tokens: list[list[int]] = [[] for _ in row_request]
        logprobs: list[list[float]] = [[] for _ in row_request]
        reasons = ["length"] * len(row_request)
        active = list(range(len(row_request)))  # the sample each row of the batch decodes
        while True:
            picked = torch.empty(len(active), dtype=torch.long)
            picked_lp = torch.empty(len(active))
            rows_of: dict[int, list[int]] = {}
            for row, sample in enumerate(active):
                rows_of.setdefault(row_request[sample], []).append(row)
            for index, rows in rows_of.items():
                s, at = inputs[index], torch.tensor(rows)
                picked[at], picked_lp[at] = _pick(logits[at], s.temperature, s.top_k, s.top_p, s.generator)
            keep = []
            for row, (sample, tok, lp) in enumerate(zip(active, picked.tolist(), picked_lp.tolist())):
                s = inputs[row_request[sample]]
                tokens[sample].append(tok)
                logprobs[sample].append(lp)
                if tok in s.stop_tokens or (s.stop_strings and self._has_stop(tokens[sample], s.stop_strings)):
                    reasons[sample] = "stop"
                elif len(tokens[sample]) < s.max_tokens:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                at = torch.tensor(keep)
                cache.batch_select_indices(at)
                mask, picked, next_pos = mask[at], picked[at], next_pos[at]
                active = [active[row] for row in keep]
            mask = torch.cat([mask, mask.new_ones((len(active), 1))], dim=1)
            out = self.call(params, input_ids=picked.unsqueeze(-1), attention_mask=mask,
                            position_ids=next_pos.unsqueeze(-1), use_cache=True, **{self._cache_kwarg: cache})
            logits, next_pos = out.logits[:, -1].float(), next_pos + 1

        results = []
        first = 0
        for index, s in enumerate(inputs):
            samples = range(first, first + s.num_samples)
            first += s.num_samples
            results.append(([(tokens[r], logprobs[r], reasons[r]) for r in samples],
                            prompt_lps.get(prompt_of[index]) if s.prompt_logprobs else None))
        return results

    def _new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache()

    def _stops(self, stop: Any) -> tuple[set[int], list[str]]:
        """Stop tokens and stop strings: none given -> EOS; ``[]`` -> nothing; strings -> those and EOS."""
        if stop is None:
            return set(self.eos_token_ids), []
        if isinstance(stop, str):
            stop = [stop]
        stop = list(stop)
        if stop and all(isinstance(s, int) for s in stop):
            return {int(s) for s in stop}, []
        if any(not isinstance(s, str) for s in stop):
            raise UserError("stop must be a string, a list of strings or a list of token ids")
        if stop and self.tokenizer is None:
            raise UserError("stop strings need a tokenizer; this model was served without one")
        return (set(self.eos_token_ids) if stop else set()), [s for s in stop if s]

    def _has_stop(self, ids: list[int], stops: list[str]) -> bool:
        text = self.tokenizer.decode(ids, skip_special_tokens=False)
        return any(s in text for s in stops)


def _pick(logits: torch.Tensor, temperature: float, top_k: int, top_p: float,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Next token of every row and its logprob under the sampled-from (temperature) distribution."""
    if temperature == 0:
        logprobs = torch.log_softmax(logits, dim=-1)
        tokens = logprobs.argmax(dim=-1)
        return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)
    logprobs = torch.log_softmax(logits / temperature, dim=-1)
    probs = logprobs.exp()
    if 0 < top_k < probs.shape[-1]:
        kth = probs.topk(top_k, dim=-1).values[:, -1:]
        probs = probs.masked_fill(probs < kth, 0.0)
    if top_p < 1:
        sorted_p, order = probs.sort(dim=-1, descending=True)
        drop = (sorted_p.cumsum(-1) - sorted_p) >= top_p * sorted_p.sum(-1, keepdim=True)
        probs = probs.masked_fill(torch.zeros_like(drop).scatter(-1, order, drop), 0.0)
    tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def datum_loss(loss_fn: str, logprobs: torch.Tensor, inputs: dict[str, np.ndarray],
               config: dict[str, float]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One datum's loss (a sum over its tokens) and its output tensors."""
    def tensor(key: str) -> torch.Tensor:
        return torch.tensor(np.asarray(inputs[key], dtype=np.float32))

    if loss_fn == "cross_entropy":
        weights = tensor("weights") if "weights" in inputs else torch.ones_like(logprobs)
        elementwise = -logprobs * weights
        return elementwise.sum(), {"logprobs": logprobs, "elementwise_loss": elementwise}
    ratio = torch.exp(logprobs - tensor("logprobs"))
    advantages = tensor("advantages")
    if loss_fn == "importance_sampling":
        return -(ratio * advantages).sum(), {"logprobs": logprobs}
    low = tensor("clip_low_threshold") if "clip_low_threshold" in inputs else \
        torch.tensor(float(config.get("clip_low_threshold", 0.8)))
    high = tensor("clip_high_threshold") if "clip_high_threshold" in inputs else \
        torch.tensor(float(config.get("clip_high_threshold", 1.2)))
    clipped = torch.minimum(torch.maximum(ratio, low), high)
    return -torch.minimum(ratio * advantages, clipped * advantages).sum(), {"logprobs": logprobs}


class TrainingRun:
    """One training run (a Tinker ``model_id``): its trainable tensors and their AdamW state."""

    def __init__(self, model_id: str, base: BaseModel, lora: dict[str, Any] | None,
                 params: dict[str, torch.Tensor] | None = None):
        self.model_id = model_id
        self.base = base
        self.lora = lora  # {"rank", "seed", "train_mlp", "train_attn", "train_unembed"}; None: full weights
        if params is None:
            params = self._fresh_params()
        self.params = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
        self.optimizer = torch.optim.AdamW(list(self.params.values()), foreach=False)

    def _fresh_params(self) -> dict[str, torch.Tensor]:
        if self.lora is None:
            return {n: p.detach() for n, p in self.base.model.named_parameters()
                    if not n.endswith((".lora_A", ".lora_B"))}
        rank = int(self.lora["rank"])
        if rank < 1:
            raise UserError(f"lora_config.rank must be >= 1, got {rank}")
        wanted = {kind for kind, flag in (("attn", "train_attn"), ("mlp", "train_mlp"), ("unembed", "train_unembed"))
                  if self.lora.get(flag, True)}
        generator = torch.Generator()
        seed = self.lora.get("seed")
        generator.manual_seed(int(seed) if seed is not None else int.from_bytes(os.urandom(8), "little") >> 1)
        params = {}
        for path, kind in self.base.lora_targets.items():
            if kind not in wanted:
                continue
            linear = self.base.model.get_submodule(path).base
            bound = 1.0 / math.sqrt(linear.in_features)
            params[f"{path}.lora_A"] = torch.empty(rank, linear.in_features).uniform_(-bound, bound,
                                                                                      generator=generator)
            params[f"{path}.lora_B"] = torch.zeros(linear.out_features, rank)
        return params

    @property
    def lora_rank(self) -> int | None:
        return None if self.lora is None else int(self.lora["rank"])

    # ------------------------------------------------------------------ training

    def forward_backward(self, examples: list[Example], loss_fn: str, config: dict[str, float],
                         backward: bool) -> tuple[list[dict[str, np.ndarray]], dict[str, float]]:
        self.base.check_examples(examples, loss_fn)
        outputs: list[dict[str, np.ndarray]] = []
        total = 0.0
        for chunk in _chunks(examples):
            with torch.set_grad_enabled(backward):
                logprobs = self.base.token_logprobs(self.params, chunk)
                losses = []
                for e, lp in zip(chunk, logprobs):
                    loss, out = datum_loss(loss_fn, lp, e.inputs, config)
                    losses.append(loss)
                    outputs.append({k: v.detach().numpy().astype(np.float32) for k, v in out.items()})
                chunk_loss = torch.stack(losses).sum()
            if backward:
                chunk_loss.backward()
            total += float(chunk_loss.detach())
        return outputs, {"loss:sum": total}

    def optim_step(self, adam: Any) -> dict[str, float]:
        group = self.optimizer.param_groups[0]
        group.update(lr=float(adam.learning_rate), betas=(float(adam.beta1), float(adam.beta2)),
                     eps=float(adam.eps), weight_decay=float(adam.weight_decay))
        params = list(self.params.values())
        with_grad = [p for p in params if p.grad is not None]
        clip = float(adam.grad_clip_norm or 0.0)
        norm = float(torch.nn.utils.clip_grad_norm_(with_grad, clip if clip > 0 else math.inf, foreach=False)) \
            if with_grad else 0.0
        if math.isfinite(norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": norm, "learning_rate:mean": float(adam.learning_rate)}

    def snapshot(self) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.params.items()}

    # ------------------------------------------------------------------ checkpoints

    def save(self, folder: Path, with_optimizer: bool) -> None:
        """Weights (and AdamW state) as safetensors + JSON, written next to ``folder`` and renamed in."""
        tensors = {k: v.detach().contiguous() for k, v in self.params.items()}
        meta: dict[str, Any] = {"format": CHECKPOINT_FORMAT, "base_model": self.base.name, "lora": self.lora,
                                "param_names": list(self.params)}
        optimizer_tensors: dict[str, torch.Tensor] = {}
        if with_optimizer:
            group = self.optimizer.param_groups[0]
            meta["optimizer"] = {"lr": group["lr"], "betas": list(group["betas"]), "eps": group["eps"],
                                 "weight_decay": group["weight_decay"], "step": {}}
            for name, p in self.params.items():
                state = self.optimizer.state.get(p)
                if state:
                    meta["optimizer"]["step"][name] = float(state["step"])
                    optimizer_tensors[f"exp_avg.{name}"] = state["exp_avg"].contiguous()
                    optimizer_tensors[f"exp_avg_sq.{name}"] = state["exp_avg_sq"].contiguous()
        folder.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        try:
            save_file(tensors, str(tmp / "weights.safetensors"))
            if with_optimizer:
                save_file(optimizer_tensors, str(tmp / "optimizer.safetensors"))
            (tmp / "state.json").write_text(json.dumps(meta, indent=1, sort_keys=True))
            if folder.exists():
                shutil.rmtree(folder)
            os.rename(tmp, folder)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)

    @staticmethod
    def read(folder: Path) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        meta_path = folder / "state.json"
        if not meta_path.is_file():
            raise UserError(f"no checkpoint at {folder.name}")
        meta = json.loads(meta_path.read_text())
        if meta.get("format") != CHECKPOINT_FORMAT:
            raise UserError(f"checkpoint {folder.name} has format {meta.get('format')}, expected {CHECKPOINT_FORMAT}")
        return meta, load_file(str(folder / "weights.safetensors"))

    def load(self, folder: Path, with_optimizer: bool) -> None:
        meta, tensors = self.read(folder)
        if meta["base_model"] != self.base.name or meta["lora"] != self.lora or set(tensors) != set(self.params):
            raise UserError(f"checkpoint {folder.name} was saved by a run of another shape "
                            f"(base model {meta['base_model']}, lora {meta['lora']})")
        with torch.no_grad():
            for name, p in self.params.items():
                p.copy_(tensors[name])
        self.optimizer = torch.optim.AdamW(list(self.params.values()), foreach=False)
        if not with_optimizer:
            return
        if "optimizer" not in meta:
            raise UserError(f"checkpoint {folder.name} holds no optimizer state (saved for sampling)")
        opt = meta["optimizer"]
        state_tensors = load_file(str(folder / "optimizer.safetensors"))
        self.optimizer.param_groups[0].update(lr=opt["lr"], betas=tuple(opt["betas"]), eps=opt["eps"],
                                              weight_decay=opt["weight_decay"])
        for name, step in opt["step"].items():
            p = self.params[name]
            self.optimizer.state[p] = {"step": torch.tensor(float(step)),
                                       "exp_avg": state_tensors[f"exp_avg.{name}"].clone(),
                                       "exp_avg_sq": state_tensors[f"exp_avg_sq.{name}"].clone()}


def _chunks(examples: list[Example]):
    chunk: list[Example] = []
    tokens = 0
    for e in examples:
        if chunk and tokens + len(e.tokens) > _TOKENS_PER_CHUNK:
            yield chunk
            chunk, tokens = [], 0
        chunk.append(e)
        tokens += len(e.tokens)
    if chunk:
        yield chunk
