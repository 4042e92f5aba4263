"""Training-as-a-service on local torch: forward, forward_backward, optim_step, checkpoints.

Batches are dicts of tensors in verl's layout: ``input_ids``/``attention_mask``/``position_ids``
``[B, P + R]`` (left-padded prompt, right-padded response), ``responses`` and ``response_mask``
``[B, R]``. An optional ``temperature`` ``[B]`` holds the temperature each row's log-probs are
taken at (the one it was sampled with; 1 when absent). An optional ``prompt_groups`` ``[B]``
marks rows with identical prompts, which a packed forward then computes once. Other entries
(advantages, old logprobs, per-row lists) travel with the rows when the batch is cut into
micro-batches.

Checkpoints hold no pickle: the model is an HF safetensors folder, the optimizer and RNG
tensors are safetensors files, everything else is JSON.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import json
import math
import os
import random
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from nexrl_core import MemoryPlan, NexRLError, Option, PlanInputs, TrainService, algorithms

from ..cpu_threads import computing, follow_share_at_layers, release_idle_workers
from ..logprobs import (
    compute_response_logprobs,
    compute_response_logprobs_packed,
    pack_count,
    packing_problem,
    position_ids_from_mask,
    scoring_batch,
)
from ..models import (
    apply_process_options,
    auto_dtype,
    auto_flag,
    check_model_section,
    config_errors,
    log_auto_device,
    log_auto_dtype,
    model_from_config,
    own_settings,
    resolve_device,
    resolve_model_path,
)
from . import sharded
from .distributed import GatheredWeights, RankGroup, shard_rows, start_ranks, wrap
from .lora import (
    ADAPTER_FOLDER,
    adapter_tensors,
    add_adapters,
    check_checkpoint,
    load_adapter,
    merged_state,
    save_adapter,
)
from .settings import TRAIN_DTYPES, TrainServiceSettings

# Its metrics: numbers by name, and per-row values under ROW_OUTPUTS.
LossFn = Callable[[torch.Tensor, dict[str, Any]], tuple[torch.Tensor, dict[str, Any]]]

# A loss_fn's metrics may hold, under this key, {name: one value per row of its micro-batch};
# forward_backward returns them under it too, {name: [value per row of the batch]} in batch order.
ROW_OUTPUTS = "rows"
REQUIRED_KEYS = ("input_ids", "attention_mask", "responses", "response_mask")
CHECKPOINT_FORMAT = 1
# What save_checkpoint adds to the HF folder for a resume; an export leaves them out.
SCHEDULER_FILE = "scheduler.json"  # the lr schedule's position (steps taken)
SCHEDULER_STATE = ("last_epoch", "_step_count", "base_lrs", "_last_lr")  # what torch's LR schedulers keep
TRAINING_STATE_FILES = ("optimizer.safetensors", "optimizer.json", "rng.safetensors", "rng.json", "extra_state.json",
                        "distributed.json", SCHEDULER_FILE)
DISTRIBUTED_FILE = "distributed.json"  # the world size and parallel mode that wrote a checkpoint
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# The dict of tensors above with a LossFn. A service taking it also offers ``tokenizer`` (and
# ``model``, the torch module, which a KL reference is copied from).
BATCH_FORMAT = "torch_tensors"


class _Readers:
    """Consumers still to read the live parameters (:meth:`HeldWeights.hold`): whatever writes the
    parameters (an optimizer step, a checkpoint load) waits for them first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._count = 0

    def hold(self) -> Callable[[], None]:
        with self._cond:
            self._count += 1
        released = threading.Event()

        def release() -> None:
            if released.is_set():  # once, however often it is called
                return
            released.set()
            with self._cond:
                self._count -= 1
                self._cond.notify_all()
        return release

    def wait(self) -> None:
        with self._cond:
            self._cond.wait_for(lambda: self._count == 0)


class HeldWeights(dict):
    """:meth:`LocalTorchTrainService.export_weights`' tensors by name. A consumer that reads them after
    the call returned (the in-process engine copying them at its next decode step, while the trainer
    goes on) calls :meth:`hold` first and the function it returns once it has read them: the service's
    next optimizer step waits until then, so the tensors need no copy. Pickled (a transport to another
    process), a plain dict."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], readers: _Readers):
        super().__init__(tensors)
        self._readers = readers

    def hold(self) -> Callable[[], None]:
        """Keep the parameters as they are until the returned function is called."""
        return self._readers.hold()

    def __reduce__(self) -> Any:
        return dict, (dict(self),)


def _every_rank(method: Callable[..., Any]) -> Callable[..., Any]:
    """On rank 0 of several, broadcast the call first: every rank runs the method, so the collectives
    inside it match (see :mod:`nexrl_torch.train.distributed`). In one process: the method itself. Either
    way the calling thread's OpenMP workers are paused afterwards (:mod:`nexrl_torch.cpu_threads`)."""
    @functools.wraps(method)
    def call(self: LocalTorchTrainService, *args: Any, **kwargs: Any) -> Any:
        try:
            with computing("trainer"):  # an engine beside it keeps to its threads (cpu_threads.ThreadShare)
                if self.ranks is not None and self.ranks.leader:
                    self.ranks.broadcast_call(method.__name__, args, kwargs)
                    return self.ranks.run(lambda: method(self, *args, **kwargs))
                return method(self, *args, **kwargs)
        finally:
            release_idle_workers()  # the caller's thread goes back to other work (cpu_threads)
    return call


class LocalTorchTrainService(TrainService):
    """One model and its AdamW optimizer in this process: the ``local_torch`` train service.

    Config keys: ``model_path`` (required unless ``model``/``tokenizer`` are passed), ``gguf_file``,
    ``dtype`` (float32; bfloat16: mixed precision, see :data:`TRAIN_DTYPES`), ``lr`` (1e-6), ``weight_decay`` (0.0), ``betas`` ([0.9, 0.999]), ``eps``
    (1e-8), ``grad_clip`` (1.0; <= 0 or null: no clipping), ``seed`` (seeds torch, numpy and
    python RNGs), ``micro_batch_size`` (rows per forward; null: the whole batch), ``packing`` (auto: forward
    and backward run on packed sequences with no padding when the batch and model allow it, see
    :func:`~nexrl_torch.logprobs.compute_response_logprobs_packed`; true: packed or an error;
    false: padded rows), ``max_tokens_per_pack`` (2048: tokens per packed sequence; a longer group is split).
    """

    SETTINGS = TrainServiceSettings
    OPTIONS = {"temperature": Option(removed="each row is scored at the temperature its trajectory was sampled with "
                                             "(rollout_worker.sampling.temperature): delete this key")}
    BATCH_FORMAT = BATCH_FORMAT

    @classmethod
    def check_config(cls, section: Mapping[str, Any], path: str = "service.train_service") -> list[str]:
        return check_model_section(section, path)

    @classmethod
    def memory_plan(cls, section: Mapping[str, Any], inputs: PlanInputs) -> MemoryPlan:
        """What ``nexrl plan`` counts for this service (:func:`nexrl_torch.plan.train_service_plan`)."""
        from ..plan import train_service_plan

        return train_service_plan(TrainServiceSettings.own(section, "service.train_service"), inputs)

    @classmethod
    def from_config(cls, config: Mapping[str, Any], *, seed: int, total_steps: int,
                    path: str = "service.train_service") -> LocalTorchTrainService:
        """From the recipe's section: model paths resolved (GGUF converted once), ``seed`` defaulting
        to the recipe's, ``num_threads`` and ``keep_freed_memory`` applied to the process."""
        cfg = dict(config)
        cfg.pop("backend", None)
        cfg["model_path"] = resolve_model_path(cfg.get("model_path"), cfg.get("gguf_file"))
        cfg.pop("gguf_file", None)
        if cfg.get("seed") is None:
            cfg["seed"] = int(seed)
        if cfg.get("total_steps") is None:
            cfg["total_steps"] = int(total_steps)
        with config_errors(path):
            apply_process_options(own_settings(TrainServiceSettings, cfg))
            return cls(cfg)

    def __init__(self, config: Mapping[str, Any] | None = None, *, model: torch.nn.Module | None = None,
                 tokenizer: Any = None, rank_group: RankGroup | None = None):
        self.settings = settings = own_settings(TrainServiceSettings, config or {})
        # the section with every declared key at its value (defaults filled): what a trainer reads of it
        self.config = config = {**dict(config or {}), **settings.to_dict()}
        world_size, parallel = settings.world_size, settings.parallel
        if parallel == "auto" and world_size > 1:
            parallel = "fsdp"
        if parallel != "auto" and rank_group is None:
            if model is not None:
                raise ValueError("world_size: every rank loads the model from model_path (pass no model=)")
            rank_group = start_ranks({**dict(config), "parallel": parallel}, world_size, parallel, _serve_follower)
        self.ranks = rank_group
        seed = settings.seed
        if seed is not None:
            torch.manual_seed(seed)
            np.random.seed(seed % 2**32)
            random.seed(seed)
        self.device = resolve_device(settings.device)
        if self.ranks is not None and self.device.type == "cuda":
            # Rank r on the box's GPU r; a rank Ray placed sees only its own GPU.
            self.device = torch.device("cuda", self.ranks.rank % torch.cuda.device_count())
            torch.cuda.set_device(self.device)
        if self.ranks is None or self.ranks.leader:
            log_auto_device("train service", settings.device, self.device)
        self.dtype = auto_dtype(settings.dtype, self.device)
        log_auto_dtype("train service", settings.dtype, self.dtype, self.device)
        if self.dtype not in TRAIN_DTYPES:
            raise ValueError(f"dtype: {self.dtype!r} is not one of {', '.join(TRAIN_DTYPES)} "
                             f"(bfloat16 trains with float32 master weights)")
        # The weights are the float32 masters whatever the compute precision.
        model, tokenizer = model_from_config("LocalTorchTrainService", settings, model, tokenizer, self.device,
                                             dtype="float32")
        if any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters()):
            model = model.float()
        self.adapters = None  # the PeftModel wrapper when lora trains adapters (the model itself is adapted in place)
        lora = settings.lora
        if lora is not None:
            if lora.base_dtype == "bfloat16" and self.dtype != "bfloat16":
                raise ValueError("lora.base_dtype: bfloat16 needs dtype: bfloat16 (bf16 autocast runs the frozen "
                                 "base's matmuls; without it a float32 input meets bf16 weights)")
            self.adapters = add_adapters(model, lora)
        if settings.activation_checkpointing:
            if not getattr(model, "supports_gradient_checkpointing", False):
                raise ValueError(f"activation_checkpointing: {type(model).__name__} does not support it")
            # non-reentrant: gradients reach the layers even when their input needs none (LoRA's frozen embedding)
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model = model
        # What a forward pass calls: the model, or DDP's wrapper around it (FSDP2 shards it in place).
        self._forward_model = model if self.ranks is None else wrap(model, self.ranks, self.device)
        self.tokenizer = tokenizer
        self.micro_batch_size = settings.micro_batch_size
        self.packing = auto_flag(settings.packing, "packing")
        self.max_tokens_per_pack = settings.max_tokens_per_pack
        self.grad_clip = settings.grad_clip if settings.grad_clip is not None and settings.grad_clip > 0 else None
        self.offload_optimizer = settings.offload_optimizer

        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        self._param_names = [n for n, _ in named]
        self._params = [p for _, p in named]
        self._readers = _Readers()  # consumers of exported live tensors (HeldWeights.hold)
        beta1, beta2 = settings.betas
        self.optimizer = torch.optim.AdamW(
            self._params,
            lr=settings.lr,
            betas=(beta1, beta2),
            eps=settings.eps,
            weight_decay=settings.weight_decay,
            # One fused kernel over all parameters; the default on CPU is a per-tensor Python loop.
            fused=(self.ranks is None and all(p.device.type in ("cpu", "cuda") for p in self._params)) or None,
        )
        self.scheduler = _lr_scheduler(self.optimizer, settings)
        follow_share_at_layers(model, "trainer")  # an engine beside it may lend or take back threads mid-pass
        release_idle_workers()  # the thread that loaded the model computes no more here

    # ------------------------------------------------------------------ ranks

    def serve(self) -> None:
        """A follower rank's life: run each call rank 0 broadcasts until it says ``close``."""
        ranks = self.ranks
        if ranks is None:
            raise RuntimeError("serve: only a follower rank serves")
        while True:
            name, args, kwargs = ranks.receive_call()
            if name == "close":
                break
            result = getattr(type(self), name).__wrapped__(self, *args, **kwargs)
            if isinstance(result, GatheredWeights):
                result.drain()  # rank 0's consumer gathers them in this order
        ranks.close()

    def close(self) -> None:
        """Stop the follower ranks (a no-op in one process)."""
        if self.ranks is not None and self.ranks.leader:
            try:
                self.ranks.broadcast_call("close", (), {})
            except Exception:  # noqa: BLE001 - a rank already gone: the others are stopped below
                pass
            self.ranks.close()
            self.ranks = None

    def _shard(self, batch: dict[str, Any], ranks: RankGroup) -> tuple[dict[str, Any], list[list[int]]]:
        """This rank's rows of ``batch`` (:func:`~nexrl_torch.train.distributed.shard_rows`) and every rank's row indices."""
        rows = batch["input_ids"].shape[0]
        groups = batch.get("prompt_groups")
        groups = groups.tolist() if groups is not None else list(range(rows))
        shards = shard_rows(groups, batch["attention_mask"].sum(-1).tolist(), ranks.world_size)
        index = shards[ranks.rank]
        return {k: _take(v, index, rows) for k, v in batch.items()}, shards

    def _pass_count(self, shards: list[list[int]]) -> int:
        """Forward passes every rank makes: the most micro-batches any rank's rows need (at least one)."""
        return max(1, max(-(-len(rows) // (self.micro_batch_size or max(len(rows), 1))) for rows in shards))

    def _packs_per_pass(self, batch: dict[str, Any], shards: list[list[int]], passes: int) -> list[int] | None:
        """Model calls each packed pass makes on every rank: the most any rank's rows of that pass
        pack into (a rank with fewer pads with empty calls, so the collectives inside match). Every
        rank holds the whole batch, so each works this out alone. None: the batch is not packed."""
        if self.packing == "false":
            return None
        mask, groups, length = batch["attention_mask"], batch.get("prompt_groups"), batch["responses"].shape[1]
        problem = packing_problem(self.model, mask, length)
        if problem is not None:
            if self.packing == "true":
                raise ValueError(f"packing: true, but this batch cannot be packed: {problem}")
            return None

        def count(rows: list[int]) -> int:
            index = torch.tensor(rows or [0], dtype=torch.long)  # an empty pass runs the batch's first row
            return pack_count(mask[index], length, groups[index] if groups is not None else None,
                              self.max_tokens_per_pack)
        most = [0] * passes
        for rows in shards:
            size = self.micro_batch_size or max(len(rows), 1)
            for p in range(passes):
                most[p] = max(most[p], count(rows[p * size:(p + 1) * size]))
        return most

    # ------------------------------------------------------------------ compute

    @_every_rank
    def forward(self, batch: dict[str, Any]) -> torch.Tensor:
        """Logprobs ``[B, R]`` of the response tokens under the current weights (no grad), on the
        CPU with the batch's other per-row tensors."""
        self._check(batch)
        self.model.eval()
        mine, passes, packs = batch, None, None
        shards: list[list[int]] = []  # every rank's rows, when there are ranks
        if self.ranks is not None:
            mine, shards = self._shard(batch, self.ranks)
            passes = self._pass_count(shards)
            packs = self._packs_per_pass(batch, shards, passes)
        with self._out_of_memory("forward"), torch.no_grad(), self._autocast(), computing("trainer"):
            parts = [self._logprobs(mb, packs[p] if packs else None)
                     for p, mb in enumerate(self._micro_batches(mine, passes, empty_from=batch))]
        mine_out = torch.cat(parts, dim=0).cpu()[:len(mine["input_ids"])]
        if self.ranks is None:
            return mine_out
        full = torch.zeros((batch["input_ids"].shape[0], mine_out.shape[1]), dtype=mine_out.dtype)
        for rows, out in zip(shards, self.ranks.gather(mine_out)):
            full[rows] = out
        return full

    @_every_rank
    def forward_backward(self, batch: dict[str, Any], loss_fn: LossFn) -> dict[str, Any]:
        """Accumulate gradients of ``loss_fn`` over the batch, one micro-batch at a time.

        ``loss_fn(log_probs[B_mb, R], micro_batch) -> (loss, metrics)`` must return this
        micro-batch's *share* of the whole batch's loss: gradients of the shares are summed,
        so the shares must add up to the full-batch loss. Each micro-batch carries
        ``batch_num_seqs`` (rows of the whole batch with a valid response token) and
        ``batch_num_tokens`` (valid response tokens of the whole batch); passing them to
        :func:`~nexrl_grpo.losses.agg_loss` (through a loss's ``LossContext``) makes every
        aggregation mode exact.

        Returns ``loss`` (the sum of the shares, i.e. the full-batch loss) and each metric of
        ``loss_fn`` combined over micro-batches by the core's rule
        (:func:`nexrl_core.algorithms.aggregate_metrics`): a name ending in ``_max``/``_min`` is
        the max/min, any other the mean weighted by each micro-batch's share of valid tokens
        (exact for token means such as ``pg_clipfrac``). Per-row values of ``loss_fn`` (under
        :data:`ROW_OUTPUTS`) come back under that key, one per row of ``batch``, in its order.
        """
        self._check(batch)
        mask = batch["response_mask"]
        num_tokens = float(mask.sum())
        num_rows = batch["input_ids"].shape[0]
        shared = {"batch_num_seqs": int((mask.sum(-1) > 0).sum()), "batch_num_tokens": num_tokens}
        mine, passes, packs, scale = batch, None, None, 1.0
        if self.ranks is not None:
            mine, shards = self._shard(batch, self.ranks)
            passes = self._pass_count(shards)
            packs = self._packs_per_pass(batch, shards, passes)
            scale = float(self.ranks.world_size)  # FSDP and DDP average gradients over ranks: undo it (a sum)
        self._forward_model.train()
        total_loss = 0.0
        parts: list[tuple[float, dict[str, float]]] = []
        row_parts: list[dict[str, Any]] = []  # this rank's rows, in order
        with self._out_of_memory("forward_backward"):
            for p, mb in enumerate(self._micro_batches(mine, passes, empty_from=batch)):
                with self._autocast():
                    log_probs = self._logprobs(mb, packs[p] if packs else None)
                if mb.get("_empty"):  # this rank has no rows left: a pass for the collectives only
                    (log_probs.sum() * 0.0).backward()
                    continue
                mb.update(shared)
                loss, mb_metrics = loss_fn(log_probs, mb)
                if ROW_OUTPUTS in mb_metrics:
                    mb_metrics = dict(mb_metrics)
                    row_parts.append(mb_metrics.pop(ROW_OUTPUTS))
                (loss * scale if scale != 1.0 else loss).backward()
                total_loss += float(loss.detach())
                weight = float(mb["response_mask"].sum()) / num_tokens if num_tokens else \
                    mb["input_ids"].shape[0] / num_rows
                parts.append((weight, mb_metrics))
        rows = _row_outputs(row_parts)
        if self.ranks is not None:
            gathered = self.ranks.gather((total_loss, parts, rows))
            total_loss = sum(loss for loss, _, _ in gathered)
            parts = [part for _, rank_parts, _ in gathered for part in rank_parts]
            rows = _in_batch_order([r for _, _, r in gathered], shards, num_rows)
        out: dict[str, Any] = {"loss": total_loss, **algorithms.aggregate_metrics(parts), **self.memory_metrics()}
        return {**out, ROW_OUTPUTS: rows} if rows else out

    @_every_rank
    def optim_step(self) -> dict[str, float]:
        """Clip the gradient norm, take an AdamW step, zero the gradients.

        A non-finite gradient norm skips the step (the weights stay put) and is reported as is.
        """
        self._readers.wait()  # a consumer still reading the exported weights (HeldWeights.hold) reads these values
        grads = [p for p in self._params if p.grad is not None]
        on_cpu = all(g.device.type == "cpu" for g in grads)  # foreach kernels are slower than a loop on CPU
        with self._out_of_memory("optim_step"):
            grad_norm = float(torch.nn.utils.clip_grad_norm_(grads, self.grad_clip if self.grad_clip else math.inf,
                                                             foreach=False if on_cpu else None))
            lr = float(self.optimizer.param_groups[0]["lr"])  # what this step uses
            if math.isfinite(grad_norm):
                self._move_optimizer_state(self.device)
                self.optimizer.step()
                if self.offload_optimizer:
                    self._move_optimizer_state(torch.device("cpu"))
        self.optimizer.zero_grad(set_to_none=True)
        if self.scheduler is not None:
            self.scheduler.step()  # a skipped step counts too: the schedule follows the run's steps
        return {"grad_norm": grad_norm, "lr": lr}

    def frozen_copy(self, device: torch.device) -> torch.nn.Module:
        """A frozen copy of the model as it is now, on ``device`` (the KL reference). Sharded across
        ranks, the weights are read again from ``model_path`` (the copy is taken before training)."""
        if (self.ranks is not None and self.ranks.parallel == "fsdp") or self.adapters is not None:
            from ..models import load_causal_lm  # with adapters: the base, as the adapters start from it

            model, _ = load_causal_lm(str(self.settings.model_path), dtype="float32", device=device)
        else:
            model = copy.deepcopy(self.model).to(device)
        return model.eval().requires_grad_(False)

    def memory_metrics(self) -> dict[str, float]:
        """Device memory of this service's GPU (GiB): allocated now and the peak since the last call
        (none on the CPU)."""
        if self.device.type != "cuda":
            return {}
        gib = float(1 << 30)
        out = {"memory_allocated_gib": torch.cuda.memory_allocated(self.device) / gib,
               "memory_peak_gib": torch.cuda.max_memory_allocated(self.device) / gib}
        torch.cuda.reset_peak_memory_stats(self.device)
        return out

    def _move_optimizer_state(self, device: torch.device) -> None:
        """AdamW's state tensors to ``device`` (``offload_optimizer``: the host between steps)."""
        if not self.offload_optimizer:
            return
        moved = False
        for state in self.optimizer.state.values():
            for key, value in state.items():
                # The step counter is a scalar: it stays where AdamW put it.
                if torch.is_tensor(value) and key != "step" and value.device != device:
                    state[key] = value.to(device, non_blocking=device.type == "cpu")
                    moved = True
        if moved and device.type == "cpu" and self.device.type == "cuda":
            # The copies land in pinned memory asynchronously: a checkpoint read before they finish
            # would save whatever the buffers held.
            torch.cuda.synchronize(self.device)

    @contextlib.contextmanager
    def _out_of_memory(self, phase: str):
        """Out of device memory is an error that names the keys to lower, not a CUDA traceback."""
        try:
            yield
        except torch.OutOfMemoryError:
            micro = self.micro_batch_size or "null (the whole batch)"
            hints = [f"micro_batch_size (now {micro})"]
            if self.packing != "false":
                hints.append(f"max_tokens_per_pack (now {self.max_tokens_per_pack})")
            if not self.offload_optimizer:
                hints.append("or set offload_optimizer: true")
            used = ""
            if self.device.type == "cuda":
                free, total = torch.cuda.mem_get_info(self.device)
                used = f" ({(total - free) / (1 << 30):.1f} of {total / (1 << 30):.1f} GiB in use)"
            self.optimizer.zero_grad(set_to_none=True)
            raise NexRLError(f"service.train_service: out of memory on {self.device} in {phase}{used}: lower "
                             f"{', '.join(hints)}; on a GPU shared with the engine, also "
                             f"service.inference_service.gpu_memory_utilization") from None

    def score(self, requests: list[tuple[list[int], list[int], float]]) -> list[list[float]]:
        """Log-probs of the given response tokens under the current weights (no grad), computed as
        :meth:`forward` computes a batch's: what the served-version probe compares an engine with."""
        out = self.forward(scoring_batch(requests, self._pad_token_id()))
        return [out[row, :len(r)].tolist() for row, (_, r, _) in enumerate(requests)]

    def _pad_token_id(self) -> int:
        pad = getattr(self.tokenizer, "pad_token_id", None)
        return int(pad if pad is not None else (getattr(self.tokenizer, "eos_token_id", None) or 0))

    def sampling_client(self) -> dict[str, torch.Tensor]:
        """The current weights as tensors by name (live, see :meth:`export_weights`): what an
        in-process weight sync loads into the engine rollouts sample from."""
        return self.export_weights()

    @_every_rank
    def export_weights(self, copy: bool = False) -> Mapping[str, torch.Tensor]:
        """The model's tensors by name, detached.

        Without ``copy`` they alias the live parameters: consume them (e.g. ``load_weights`` of
        the in-process engine copies them) before the next ``optim_step``, or hold them
        (:class:`HeldWeights`: the next ``optim_step`` waits for the holder).
        """
        # With adapters, the merged weights: the engine serves them at full decode speed.
        state = merged_state(self.model) if self.adapters is not None else self.model.state_dict()
        if self.ranks is not None and self.ranks.parallel == "fsdp":
            return GatheredWeights(state)  # gathered weight by weight as the consumer copies them (collectives)
        if self.adapters is not None:  # merged tensors are new ones already
            return HeldWeights({k: v.clone() for k, v in state.items()} if copy else state, self._readers)
        return HeldWeights({k: v.detach().clone() if copy else v.detach() for k, v in state.items()}, self._readers)

    def export_adapter(self, folder: str | os.PathLike) -> None:
        """The LoRA adapter as it is now, in PEFT's format, into ``folder`` (what a vLLM server loads
        with ``load_lora_adapter``); NotImplementedError when this service trains every weight."""
        if self.adapters is None:
            raise NotImplementedError("the train service trains every weight (no service.train_service.lora)")
        self._write_adapter(str(folder))

    @_every_rank
    def _write_adapter(self, folder: str) -> None:
        """Rank 0 writes the adapter; sharded by FSDP2, every rank first gathers it (collectives)."""
        gathered = None
        if self.ranks is not None and self.ranks.parallel == "fsdp":
            gathered = dict(GatheredWeights(adapter_tensors(self.model)).items())
        if self.ranks is None or self.ranks.leader:
            save_adapter(self.adapters, Path(folder), gathered)

    # ------------------------------------------------------------------ checkpoints

    @_every_rank
    def save_checkpoint(self, folder: str | os.PathLike, extra_state: dict[str, Any] | None = None) -> None:
        """Write model, tokenizer, optimizer, RNG states and ``extra_state`` (JSON) to ``folder``.

        The folder is assembled next to its final place and renamed into it, so a crash never
        leaves a half-written checkpoint; an existing folder of that name is replaced.
        """
        target = Path(folder)
        leader = self.ranks is None or self.ranks.leader
        tmp = None
        if leader:
            target.parent.mkdir(parents=True, exist_ok=True)
            tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
        if self.ranks is not None:
            tmp = Path(self.ranks.broadcast(str(tmp) if tmp else None))
        if tmp is None:
            raise RuntimeError("save_checkpoint: no folder to write (the leader makes it)")
        try:
            if self.ranks is not None and self.ranks.parallel == "fsdp":
                sharded.save(self, tmp)  # every rank writes its shards (collectives)
            elif leader:
                if self.adapters is not None:
                    # A from_pretrained folder of the merged model, and the adapter in PEFT's format.
                    self.model.save_pretrained(tmp, state_dict=merged_state(self.model))
                    save_adapter(self.adapters, tmp / ADAPTER_FOLDER)
                else:
                    self.model.save_pretrained(tmp)
                self._save_optimizer(tmp)
            if leader:
                self.tokenizer.save_pretrained(tmp)
                self._save_rng(tmp)
                if self.scheduler is not None:  # its numbers only (its lr functions are code)
                    _write_json(tmp / SCHEDULER_FILE, {k: v for k, v in self.scheduler.state_dict().items()
                                                       if k in SCHEDULER_STATE})
                _write_json(tmp / "extra_state.json", extra_state or {})
                _write_json(tmp / DISTRIBUTED_FILE, {"world_size": self.ranks.world_size if self.ranks else 1,
                                                     "parallel": self.ranks.parallel if self.ranks else None})
                tmp.chmod(0o755)
                if target.exists():
                    shutil.rmtree(target)
                os.rename(tmp, target)
        finally:
            if leader:
                shutil.rmtree(tmp, ignore_errors=True)
        if self.ranks is not None:
            self.ranks.gather(None)  # nobody reads the folder before it is in place

    @_every_rank
    def load_checkpoint(self, folder: str | os.PathLike) -> dict[str, Any]:
        """Restore everything :meth:`save_checkpoint` wrote; returns its ``extra_state``."""
        folder = Path(folder)
        if not folder.is_dir():
            raise FileNotFoundError(f"checkpoint folder {folder} does not exist")
        saved = json.loads((folder / DISTRIBUTED_FILE).read_text()) if (folder / DISTRIBUTED_FILE).is_file() else {}
        world = self.ranks.world_size if self.ranks else 1
        if int(saved.get("world_size", 1)) != world and (self.ranks is None or self.ranks.leader):
            from loguru import logger

            logger.warning(f"{folder}: written by {saved.get('world_size', 1)} rank(s), resumed on {world}: the "
                           f"batch splits differently, so the run will not repeat the original bit for bit")
        self._readers.wait()  # as optim_step: nobody still reads the exported weights
        if self.ranks is not None and self.ranks.parallel == "fsdp":
            sharded.load_model(self, folder)
        else:
            self._load_model(folder)
        if (folder / sharded.OPTIMIZER_FOLDER).is_dir() or (self.ranks is not None and self.ranks.parallel == "fsdp"):
            sharded.load_optimizer(self, folder)
        else:
            self._load_optimizer(folder)
        self._load_rng(folder)
        self._load_scheduler(folder)
        return json.loads((folder / "extra_state.json").read_text())

    # The train-service interface's names for the two above.
    def save_state(self, folder: str, extra_state: dict[str, Any] | None = None) -> None:
        self.save_checkpoint(folder, extra_state)

    def load_state(self, folder: str) -> dict[str, Any]:
        return self.load_checkpoint(folder)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check(batch: dict[str, Any]) -> None:
        missing = [k for k in REQUIRED_KEYS if k not in batch]
        if missing:
            raise ValueError(f"batch is missing {missing}; a batch needs {list(REQUIRED_KEYS)} (+ position_ids)")

    def _autocast(self) -> torch.autocast:
        """bf16 autocast around the model's forward (its backward follows it); the log-probs it
        yields are float32 (:func:`~nexrl_torch.logprobs.token_logprobs` upcasts the logits)."""
        return torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.dtype == "bfloat16")

    def _micro_batches(self, batch: dict[str, Any], passes: int | None = None, empty_from: Any = None):
        """The batch's rows ``micro_batch_size`` at a time, their tensors on this service's device
        (``prompt_groups`` stays on the host: packing reads it there). With ``passes``, exactly that
        many: the missing ones are one row of ``empty_from`` marked ``_empty`` (a rank with fewer
        rows still joins every pass's collectives)."""
        rows = batch["input_ids"].shape[0]
        size = self.micro_batch_size or max(rows, 1)
        made = 0
        for start in range(0, rows, size):
            made += 1
            yield self._on_device({k: _rows(v, start, start + size, rows) for k, v in batch.items()})
        full_rows = empty_from["input_ids"].shape[0] if empty_from is not None else 0
        for _ in range(made, passes or 0):
            yield {**self._on_device({k: _rows(v, 0, 1, full_rows) for k, v in empty_from.items()}), "_empty": True}

    def _on_device(self, mb: dict[str, Any]) -> dict[str, Any]:
        return {k: v.to(self.device, non_blocking=True) if torch.is_tensor(v) and k != "prompt_groups" else v
                for k, v in mb.items()}

    def _logprobs(self, mb: dict[str, Any], packs: int | None = None) -> torch.Tensor:
        """Response log-probs of a micro-batch; with several ranks, packed only when the whole batch
        is (``packs``: the model calls every rank makes, :meth:`_packs_per_pass`)."""
        input_ids, attention_mask = mb["input_ids"], mb["attention_mask"]
        position_ids = mb.get("position_ids")
        position_ids = position_ids_from_mask(attention_mask) if position_ids is None else position_ids
        response_length = mb["responses"].shape[1]
        temperature = mb.get("temperature")
        temperature = 1.0 if temperature is None else temperature
        if self.packing != "false" and (self.ranks is None or packs is not None):
            problem = packing_problem(self.model, attention_mask, response_length)
            if problem is None:
                return compute_response_logprobs_packed(
                    self._forward_model, input_ids, attention_mask, position_ids, response_length, mb.get("prompt_groups"),
                    temperature, self.max_tokens_per_pack, packs or 0)
            if self.packing == "true":
                raise ValueError(f"packing: true, but this batch cannot be packed: {problem}")
        return compute_response_logprobs(self._forward_model, input_ids, attention_mask, position_ids, response_length,
                                         temperature)

    def _save_optimizer(self, folder: Path) -> None:
        state = self.optimizer.state_dict()
        tensors, scalars = {}, {}
        for index, param_state in state["state"].items():
            for key, value in param_state.items():
                if torch.is_tensor(value):
                    tensors[f"state.{index}.{key}"] = value.detach().contiguous().cpu()
                else:
                    scalars[f"state.{index}.{key}"] = value
        save_file(tensors, str(folder / "optimizer.safetensors"))
        _write_json(
            folder / "optimizer.json",
            {
                "format": CHECKPOINT_FORMAT,
                "param_names": self._param_names,
                "param_groups": state["param_groups"],
                "scalar_state": scalars,
            },
        )

    def _load_optimizer(self, folder: Path) -> None:
        meta = json.loads((folder / "optimizer.json").read_text())
        if meta["param_names"] != self._param_names:
            raise ValueError(f"{folder}: optimizer state was saved for different parameters than this model's")
        state: dict[int, dict[str, Any]] = {}
        flat = {**load_file(str(folder / "optimizer.safetensors")), **meta["scalar_state"]}
        for name, value in flat.items():
            _, index, key = name.split(".", 2)
            state.setdefault(int(index), {})[key] = value
        groups = meta["param_groups"]
        for group in groups:
            group["betas"] = tuple(group["betas"])
        self.optimizer.load_state_dict({"state": state, "param_groups": groups})

    def _load_scheduler(self, folder: Path) -> None:
        """The schedule's position; the learning rate itself came back with the optimizer's groups."""
        saved = folder / SCHEDULER_FILE
        if self.scheduler is None:
            if saved.is_file():
                raise ValueError(f"{folder}: the checkpoint was trained with an lr_scheduler; resume with the "
                                 f"lr_scheduler and warm-up it was trained with")
            return
        if not saved.is_file():
            raise ValueError(f"{folder}: the checkpoint was trained with a constant lr; resume without "
                             f"lr_scheduler/warm-up, or start a fresh run")
        self.scheduler.load_state_dict({**self.scheduler.state_dict(), **json.loads(saved.read_text())})

    def _load_model(self, folder: Path) -> None:
        check_checkpoint(folder, self.adapters)
        if self.adapters is not None:
            load_adapter(self.adapters, folder / ADAPTER_FOLDER)  # the base stays model_path's
            return
        loaded = sharded.model_tensors(folder)
        own = self.model.state_dict()
        unknown = sorted(set(loaded) - set(own))
        # Tied weights are saved once; a missing name is fine when it shares storage with a loaded one.
        loaded_ptrs = {own[k].data_ptr() for k in loaded if k in own}
        missing = sorted(k for k in set(own) - set(loaded) if own[k].data_ptr() not in loaded_ptrs)
        if unknown or missing:
            raise ValueError(f"{folder}: checkpoint does not match the model (unknown {unknown[:5]}, missing {missing[:5]})")
        with torch.no_grad():
            for name, tensor in loaded.items():
                own[name].copy_(tensor)

    @staticmethod
    def _save_rng(folder: Path) -> None:
        tensors = {"torch_cpu": torch.get_rng_state()}
        if torch.cuda.is_available():
            for i, s in enumerate(torch.cuda.get_rng_state_all()):
                tensors[f"torch_cuda.{i}"] = s
        kind, keys, pos, has_gauss, cached = cast("tuple[str, np.ndarray, int, int, float]", np.random.get_state())
        tensors["numpy_keys"] = torch.from_numpy(keys.astype(np.int64))
        save_file(tensors, str(folder / "rng.safetensors"))
        version, py_state, gauss = random.getstate()
        _write_json(
            folder / "rng.json",
            {
                "python": {"version": version, "state": list(py_state), "gauss_next": gauss},
                "numpy": {"kind": kind, "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
            },
        )

    @staticmethod
    def _load_rng(folder: Path) -> None:
        tensors = load_file(str(folder / "rng.safetensors"))
        meta = json.loads((folder / "rng.json").read_text())
        torch.set_rng_state(tensors["torch_cpu"])
        cuda = [tensors[k] for k in sorted(tensors) if k.startswith("torch_cuda.")]
        if cuda and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(cuda)
        np_meta = meta["numpy"]
        keys = tensors["numpy_keys"].numpy().astype(np.uint32)
        np.random.set_state((np_meta["kind"], keys, np_meta["pos"], np_meta["has_gauss"], np_meta["cached_gaussian"]))
        py = meta["python"]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))


def _lr_scheduler(optimizer: torch.optim.Optimizer, settings: TrainServiceSettings) -> Any:
    """transformers' scheduler for ``lr_scheduler`` with its warm-up; None for a constant lr without one."""
    name, steps = settings.lr_scheduler, settings.total_steps
    warmup, ratio = settings.warmup_steps, settings.warmup_ratio
    if warmup and ratio:
        raise ValueError("warmup_steps and warmup_ratio: set one of them")
    if ratio or name != "constant":
        if steps is None:
            raise ValueError(f"lr_scheduler: {name} with warm-up or decay needs total_steps (the run's "
                             f"trainer.total_train_steps, given when the trainer builds this service)")
        warmup = warmup or math.ceil(ratio * steps)
    if name == "constant" and not warmup:
        return None
    from transformers import get_scheduler

    kind = "constant_with_warmup" if name == "constant" else name
    return get_scheduler(kind, optimizer, num_warmup_steps=warmup,
                         num_training_steps=steps)


def _serve_follower(config: dict[str, Any], group: RankGroup) -> None:
    """A follower rank's whole life: its own service, answering rank 0's calls until ``close``."""
    LocalTorchTrainService(config, rank_group=group).serve()


def _row_outputs(parts: list[dict[str, Any]]) -> dict[str, list[float]]:
    """Micro-batches' per-row values (:data:`ROW_OUTPUTS`) joined: {name: one value per row}."""
    return {name: [x for part in parts for x in torch.as_tensor(part[name]).detach().double().cpu().reshape(-1).tolist()]
            for name in (parts[0] if parts else {})}


def _in_batch_order(ranks: list[dict[str, list[float]]], shards: list[list[int]], rows: int) -> dict[str, list[float]]:
    """Every rank's per-row values put back at their rows of the batch (a rank without rows gave none)."""
    names = next((r for r in ranks if r), {})
    out = {name: [math.nan] * rows for name in names}
    for values, index in zip(ranks, shards):
        for name in names:
            for row, value in zip(index, values.get(name, [])):
                out[name][row] = value
    return out


def _take(value: Any, index: list[int], rows: int) -> Any:
    """The entries ``index`` of a per-row value; everything else unchanged."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
        return value[torch.tensor(index, dtype=torch.long)]
    if isinstance(value, (list, tuple)) and len(value) == rows:
        return [value[i] for i in index]
    return value


def _rows(value: Any, start: int, stop: int, rows: int) -> Any:
    """Slice per-row entries; pass everything else through unchanged."""
    if torch.is_tensor(value) and value.dim() > 0 and value.shape[0] == rows:
        return value[start:stop]
    if isinstance(value, (list, tuple)) and len(value) == rows:
        return value[start:stop]
    return value


def _write_json(path: Path, data: Any) -> None:
    path.write_text(json.dumps(data, indent=1, sort_keys=True))


def export_model_folder(checkpoint: str | os.PathLike, out: str | os.PathLike, dtype: str | None = None,
                        merged: bool = False) -> None:
    """Copy the HF model folder inside a :meth:`LocalTorchTrainService.save_checkpoint` folder to
    the existing folder ``out``: model, config and tokenizer files, not the training state
    (:data:`TRAINING_STATE_FILES`) nor the core's ``nexrl_*`` files. ``dtype`` casts the
    floating-point weights and records the new dtype in ``config.json``. Of a LoRA checkpoint:
    the adapter (PEFT's files) and the tokenizer, or with ``merged`` the merged model."""
    src, dst = Path(checkpoint), Path(out)
    if not (src / "config.json").is_file():
        raise FileNotFoundError(f"{src}: no config.json: not a checkpoint of a self-hosted trainer")
    target = _DTYPES[dtype] if dtype is not None else None
    adapter = src / ADAPTER_FOLDER
    only_adapter = adapter.is_dir() and not merged
    sources = sorted(adapter.iterdir()) if only_adapter else []
    for path in sorted(src.iterdir()):
        if only_adapter and (path.suffix == ".safetensors" or path.name in ("config.json", "generation_config.json")):
            continue  # the merged model's files: the adapter stands in for them
        sources.append(path)
    for path in sources:
        if not path.is_file() or path.name in TRAINING_STATE_FILES or path.name.startswith("nexrl_"):
            continue
        if target is not None and path.suffix == ".safetensors":
            tensors = load_file(str(path))
            save_file({k: v.to(target) if v.is_floating_point() else v for k, v in tensors.items()},
                      str(dst / path.name), metadata={"format": "pt"})
        else:
            shutil.copy2(path, dst / path.name)
    if dtype is not None and (dst / "config.json").is_file():  # an adapter has no model config to record it in
        config = json.loads((dst / "config.json").read_text())
        keys = [k for k in ("dtype", "torch_dtype") if k in config] or ["dtype"]
        for key in keys:
            config[key] = dtype
        _write_json(dst / "config.json", config)
