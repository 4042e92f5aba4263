"""nexrl vs TRL's GRPOTrainer at the same GRPO configuration, alternating in one process.

TRL runs in both of its precisions (``bf16=True``: bf16 autocast over fp32 weights; and fp32), nexrl
in each ``--nexrl-dtype`` (float32; bfloat16 = mixed precision in the trainer and bf16 decoding in the
engine, or the recipe's setting). Same model (SmolLM2-135M-Instruct, loaded in fp32 from the cached
safetensors folder), same prompts (the
generated ``arithmetic`` task, in the same order), same sampling (temperature 1.0, top_p 1,
``--max-new-tokens``), same batch (``--prompts`` x ``--samples`` completions per optimizer step),
same loss (PPO-clip 0.2, per-sequence token mean, group-std-normalised advantages, beta=0: no KL,
no reference model), same optimizer (AdamW, constant ``--lr``, grad clip 1.0), same reward
(``nexrl_core.builtins.evaluators.NumericAnswerEvaluator``), CPU, no checkpoints, no evaluation.

nexrl runs through ``NexRLController`` with ``recipes/quickstart.yaml`` plus overrides (the path
``nexrl run`` takes); TRL runs ``GRPOTrainer.train()``. Each runs in its own thread and is paused
between blocks at a step boundary, so only one system computes at a time. A held system's thread
pauses its OpenMP team first, as does the main thread once the systems are built: in one process
the idle teams of the others would otherwise slow whichever system runs (GNU OpenMP stops spinning
once the process holds more OpenMP threads than CPUs; ``nexrl_torch.cpu_threads``), which a system
alone in its process does not pay:

    warm-up (each) -> [TRL-bf16 k steps, TRL-fp32 k steps, nexrl k steps] x blocks   (the order rotates)

A block's time runs from releasing the system to the end of its k-th optimizer step (nexrl: also
until its rollout workers are idle, so no leftover work spills into TRL's block; the weight push
of each step belongs to the block). Background load hits both systems alike because the blocks
interleave. Prints seconds/step per system, the ratio (nexrl steps/s / TRL steps/s) against each
TRL precision and the mean reward per step of each.

Then the decode roofline: one decode step of nexrl's fast path (``--roofline-rows`` rows, the
engine's dtype) against the matmul time of the same weights at the same rows and dtype (every
projection and the LM head, through ``F.linear`` and through oneDNN with prepacked weights; the
faster counts): the ratio says how close decoding runs to what the matmuls alone cost on this CPU.

``--quick`` is the guard run before stopping work: fewer systems, blocks and steps, no roofline.
Every run ends by comparing its ratios with the recorded reference of its mode
(``benchmarks/results/grpo_vs_trl.json``, ``grpo_vs_trl_quick.json``; ``--record`` rewrites it) and
prints ``SLOWER by X%`` (exit status 1) where a ratio fell by more than the noise threshold (wider
when other jobs shared the machine), on any CPU: a ratio is nexrl against TRL in the same run, and a
reference from another CPU is said so.

    pip install -c constraints-cpu.txt -r benchmarks/requirements.txt
    python benchmarks/grpo_vs_trl.py                      # defaults: ~10-15 min on 2 CPU cores
    python benchmarks/grpo_vs_trl.py --quick              # the guard: ~2 min idle (estimated), 4-9 min loaded
    python benchmarks/grpo_vs_trl.py --quick --record     # new quick reference (quiet machine only)
    python benchmarks/grpo_vs_trl.py --nexrl-dtype bfloat16 --trl-precisions bf16
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, "recipes", "quickstart.yaml")
RESULTS = os.path.join(REPO, "benchmarks", "results")

# Each mode's settings (an explicit flag wins) and its recorded reference. The quick mode keeps the
# full mode's shapes and seed, so its timed steps are the full run's first ones; it runs nexrl as the
# quickstart ships against TRL's cheaper precision (two systems: half the memory and time of
# three), one step per block, no roofline.
MODES: dict[str, dict[str, Any]] = {
    "full": {"warmup": 1, "blocks": 3, "steps_per_block": 2, "nexrl_dtype": ["float32", "bfloat16"],
             "trl_precisions": ["bf16", "fp32"], "roofline_rows": 0},
    "quick": {"warmup": 1, "blocks": 3, "steps_per_block": 1, "nexrl_dtype": ["recipe"],
              "trl_precisions": ["bf16"], "roofline_rows": -1},
}
REFERENCES = {"full": os.path.join(RESULTS, "grpo_vs_trl.json"),
              "quick": os.path.join(RESULTS, "grpo_vs_trl_quick.json")}
# A ratio that fell by more than this fraction against the reference is flagged: on a quiet machine,
# and where other jobs ran alongside (their ratios spread wider; benchmarks/README.md, "The guard").
NOISE = {"quiet": 0.10, "busy": 0.40}
# The arguments that set the measured work: a reference taken with other values is another measurement.
WORKLOAD_ARGS = ("warmup", "blocks", "steps_per_block", "prompts", "samples", "max_new_tokens", "lr",
                 "rollout_limit", "seed", "threads", "workers", "nexrl_override", "trl_gradient_checkpointing")


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


class Gate:
    """Lets a system's thread run ``n`` more optimizer steps, then holds it at a step boundary."""

    def __init__(self, name: str):
        self.name = name
        self._cond = threading.Condition()
        self._allowed = 0
        self.done = 0
        self.step_end_times: list[float] = []
        self.failed: BaseException | None = None
        self.finished = False

    def allow(self, n: int) -> None:
        with self._cond:
            self._allowed += n
            self._cond.notify_all()

    def step_end(self) -> None:
        """Called by the system at the end of each optimizer step: count it, hold if no budget.
        A held thread first pauses its OpenMP team: the systems share this process, and idle teams
        would slow the running one (``nexrl_torch.cpu_threads``), which separate processes do not."""
        from nexrl_torch.cpu_threads import release_idle_workers

        release_idle_workers()
        with self._cond:
            self.done += 1
            self.step_end_times.append(time.perf_counter())
            self._cond.notify_all()
            self._cond.wait_for(lambda: self._allowed > self.done or self.finished)

    def wait_done(self, n: int, timeout: float = 3600.0) -> None:
        with self._cond:
            ok = self._cond.wait_for(lambda: self.done >= n or self.failed is not None or self.finished, timeout)
        if self.failed is not None:
            raise RuntimeError(f"{self.name} failed: {self.failed!r}") from self.failed
        if not ok or self.done < n:
            raise RuntimeError(f"{self.name}: {self.done} of {n} steps done (finished={self.finished})")

    def release_all(self) -> None:
        with self._cond:
            self.finished = True
            self._cond.notify_all()


# ----------------------------------------------------------------------------- the task


def arithmetic_rows(seed: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The quickstart's training rows (same generator, same config)."""
    from nexrl_core.builtins.dataloaders import ArithmeticDataLoader
    from nexrl_core.launch.recipe import load_recipe

    cfg = load_recipe(QUICKSTART, [f"seed={seed}"])
    data = cfg.data
    loader = ArithmeticDataLoader(data, is_validate=False)
    return [loader[i] for i in range(loader.num_rows())], data


def make_reward_fn(log: list[float]) -> Callable[..., list[float]]:
    from nexrl_core.builtins.evaluators import NumericAnswerEvaluator
    from nexrl_core.evaluation import BaseEvaluationTarget

    evaluator = NumericAnswerEvaluator()

    def numeric_answer(completions: list[Any], answer: list[Any], **_: Any) -> list[float]:
        rewards = []
        for completion, truth in zip(completions, answer):
            text = completion[-1]["content"] if isinstance(completion, list) else str(completion)
            rewards.append(evaluator.evaluate({"answer": truth}, BaseEvaluationTarget(final_answer=text)).reward)
        log.append(sum(rewards) / len(rewards))
        return rewards

    return numeric_answer


# ----------------------------------------------------------------------------- TRL


def timed(fn: Callable[..., Any], intervals: list[tuple[float, float]]) -> Callable[..., Any]:
    """``fn``, recording the (start, end) of every call in ``intervals``."""
    def wrapper(*a: Any, **k: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*a, **k)
        finally:
            intervals.append((t0, time.perf_counter()))
    return wrapper


class GatedSystem:
    """One system under test, run in its own thread and held at step boundaries by its Gate."""

    gate: Gate
    thread: threading.Thread

    def work(self) -> None:
        raise NotImplementedError

    def _run(self) -> None:
        try:
            self.work()
        except BaseException as exc:  # noqa: BLE001  (reported by Gate.wait_done)
            self.gate.failed = exc
        finally:
            self.gate.release_all()

    def start(self) -> None:
        self.thread.start()

    def settle(self) -> None:
        """Wait until the system is idle between blocks (nothing to wait for by default)."""


class TrlSystem(GatedSystem):
    def __init__(self, args: argparse.Namespace, model_path: str, rows: list[dict[str, Any]], order: list[int],
                 total_steps: int, out_dir: str, precision: str):
        import torch
        from datasets import Dataset
        from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
        from trl import GRPOConfig, GRPOTrainer

        self.name = f"TRL-{precision}"
        self.gate = Gate(self.name)
        self.rewards: list[float] = []
        self.gen_intervals: list[tuple[float, float]] = []
        dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": rows[i]["prompt"]}],
                                      "answer": rows[i]["answer"]} for i in order])
        config = GRPOConfig(
            output_dir=out_dir,
            use_cpu=args.device == "cpu", bf16=precision == "bf16", fp16=False,  # bf16: autocast, fp32 masters
            # completions per step: one generation, then one optimizer step over its micro-batches
            per_device_train_batch_size=args.micro_batch or args.prompts * args.samples,
            gradient_accumulation_steps=args.prompts * args.samples // (args.micro_batch or args.prompts * args.samples),
            num_generations=args.samples,
            max_completion_length=args.max_new_tokens,
            temperature=1.0, top_p=1.0, top_k=0,
            beta=0.0, num_iterations=1, epsilon=0.2,
            loss_type="grpo",  # per-sequence token mean, then batch mean (= nexrl's seq-mean-token-mean)
            scale_rewards="group",
            learning_rate=args.lr, lr_scheduler_type="constant", warmup_steps=0,
            weight_decay=0.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, max_grad_norm=1.0,
            # GRPOConfig's default is True (recompute activations in backward: slower); nexrl keeps them.
            gradient_checkpointing=args.trl_gradient_checkpointing,
            max_steps=total_steps, logging_steps=1, save_strategy="no", report_to="none",
            shuffle_dataset=False,  # the dataset is already in nexrl's order
            dataloader_num_workers=0, disable_tqdm=True, log_completions=False, use_vllm=False,
            seed=args.seed,
        )
        model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32, local_files_only=True)
        tokenizer = AutoTokenizer.from_pretrained(model_path, local_files_only=True)
        gate = self.gate

        class Pause(TrainerCallback):
            def on_step_end(self, *_a: Any, **_k: Any) -> None:
                gate.step_end()

        self.trainer = GRPOTrainer(model=model, reward_funcs=[make_reward_fn(self.rewards)], args=config,
                                   train_dataset=dataset, processing_class=tokenizer, callbacks=[Pause()])
        from transformers.trainer_callback import PrinterCallback

        self.trainer.remove_callback(PrinterCallback)  # no per-step log dicts on stdout
        # Time generation (+ reward) separately, for the breakdown.
        self.trainer._generate_and_score_completions = timed(  # type: ignore[method-assign]
            self.trainer._generate_and_score_completions, self.gen_intervals)
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def work(self) -> None:
        self.trainer.train()

    @property
    def response_tokens(self) -> list[float]:
        """Generated tokens of each step (TRL logs the mean completion length)."""
        batch = self.trainer.args.per_device_train_batch_size * self.trainer.args.gradient_accumulation_steps
        return [row["completions/mean_length"] * batch for row in self.trainer.state.log_history
                if "completions/mean_length" in row]

    def close(self) -> None:
        self.gate.release_all()
        if self.thread.ident is not None:  # a system that failed to build never started
            self.thread.join(timeout=600)


# ----------------------------------------------------------------------------- nexrl


class NexrlSystem(GatedSystem):
    def __init__(self, args: argparse.Namespace, total_steps: int, run_dir: str, dtype: str):
        from omegaconf import OmegaConf

        from nexrl_core.controller import NexRLController
        from nexrl_core.launch.recipe import load_recipe

        overrides = [
            f"run_dir={run_dir}", f"seed={args.seed}",
            f"trainer.total_train_steps={total_steps}", "trainer.save_freq=0", "trainer.save_final=false",
            "validate.validate_before_train=false", "weight.validate_freq=0", "logger.backend=[]",
            f"trajectory_pool.batch_size={args.prompts * args.samples}", f"trajectory_pool.group_size={args.samples}",
            f"rollout_worker.num_workers={args.workers or args.prompts * args.samples}",
            f"rollout_worker.sampling.max_tokens={args.max_new_tokens}", "rollout_worker.sampling.temperature=1.0",
            f"service.train_service.lr={args.lr}", "service.train_service.grad_clip=1.0",
            *([f"weight.rollout_limit={args.rollout_limit}"] if args.rollout_limit != "recipe" else []),
            "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
            f"+service.train_service.device={args.device}", f"+service.inference_service.device={args.device}",
            f"service.train_service.model_path={args.model}", f"service.inference_service.model_path={args.model}",
        ]
        if dtype != "recipe":
            base = load_recipe(QUICKSTART)
            for key in ("service.train_service.dtype", "service.inference_service.dtype"):
                present = OmegaConf.select(base, key, default=None) is not None
                overrides.append(f"{'' if present else '+'}{key}={dtype}")
        if args.micro_batch:
            key = "service.train_service.micro_batch_size"
            present = OmegaConf.select(load_recipe(QUICKSTART), key, default=None) is not None
            overrides.append(f"{'' if present else '+'}{key}={args.micro_batch}")
        self.config = load_recipe(QUICKSTART, overrides + list(args.nexrl_override))
        service = self.config.service
        # What the two sides compute in (auto resolved on this CPU), and the system's name from it.
        from nexrl_torch.models import auto_dtype

        self.dtypes = (auto_dtype(service.train_service.get("dtype")), auto_dtype(service.inference_service.get("dtype")))
        short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
        self.name = "nexrl-" + "/".join(dict.fromkeys(short.get(d, d) for d in self.dtypes))
        self.gate = Gate(self.name)
        self.controller = NexRLController(self.config)
        self.run_dir = run_dir
        self.gen_intervals: list[tuple[float, float]] = []
        engine = self.controller.inference_client
        engine._generate = timed(engine._generate, self.gen_intervals)
        # Hold the trainer at the end of each step, before the new weights are pushed: in sync mode
        # the rollout workers stay blocked until then, so nothing of nexrl runs while it is held.
        ws = self.controller.weight_sync_controller
        orig_update = ws.train_worker_notify_weight_update

        def update(*a: Any, **k: Any) -> Any:
            self.gate.step_end()
            return orig_update(*a, **k)

        ws.train_worker_notify_weight_update = update
        self.summary: Any = None
        self.thread = threading.Thread(target=self._run, name=self.name, daemon=True)

    def work(self) -> None:
        self.summary = self.controller.run()

    def settle(self) -> None:
        """Wait until no rollout is in flight (requests started before the batch was complete)."""
        tracker = self.controller.activity_tracker
        while not tracker.is_rollout_worker_quiescent():
            time.sleep(0.005)

    def _series(self, key: str) -> list[float]:
        path = os.path.join(self.run_dir, "metrics.jsonl")
        if not os.path.exists(path):
            return []
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
        return [r[key] for r in sorted(rows, key=lambda r: r["step"]) if key in r]

    @property
    def rewards(self) -> list[float]:
        return self._series("train/reward_mean")

    def timing_split(self, warmup: int) -> dict[str, float]:
        """Mean seconds per step of the trainer's phases (metrics' ``timing/*_s``), warm-up steps left out."""
        keys = ("timing/wait_batch_s", "timing/prepare_s", "timing/update_s", "timing/weight_sync_s")
        return {key: statistics.mean(series[warmup:] or series) for key in keys if (series := self._series(key))}

    @property
    def response_tokens(self) -> list[float]:
        """Generated tokens of each step."""
        return self._series("train/num_response_tokens")

    def close(self) -> None:
        self.gate.release_all()
        if self.thread.ident is not None:  # a system that failed to build never started
            self.thread.join(timeout=600)


# ----------------------------------------------------------------------------- driver


def run_block(system: Any, n: int) -> tuple[float, float, float]:
    """Run ``n`` steps of ``system``: (start, end) on the wall clock and the process's CPU seconds
    in between (all threads; the other systems are held, so nearly all of it is this one's)."""
    from nexrl_torch.cpu_threads import release_idle_workers

    release_idle_workers()  # this thread built the systems; it only waits from here on
    target = system.gate.done + n
    t0, c0 = time.perf_counter(), time.process_time()
    system.gate.allow(n)
    if not system.thread.is_alive() and not system.gate.finished:
        system.start()  # a system starts inside its warm-up block, so it never runs unpermitted
    system.gate.wait_done(target)
    system.settle()
    return t0, time.perf_counter(), time.process_time() - c0


def overlap(intervals: list[tuple[float, float]], windows: list[tuple[float, float]]) -> float:
    return sum(max(0.0, min(b, wb) - max(a, wa)) for a, b in intervals for wa, wb in windows)


def decode_roofline(model_path: str, dtype: str, rows: int, prompt_len: int, steps: int) -> dict[str, Any]:
    """Median seconds of one fast-path decode step at ``rows`` rows against the median of the bare
    ``F.linear`` time of the same weights (every projection and the LM head, ``rows`` rows, same dtype)."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from nexrl_torch.rollout.decoding import FastLlama, _Linear, cpu_decode_kernels

    torch_dtype = getattr(torch, dtype)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch_dtype, local_files_only=True).eval()
    gen = torch.Generator().manual_seed(0)
    with torch.inference_mode():
        # The engine's own choice: with the compiled kernels where they build (``cpu_kernels: auto``).
        fast = FastLlama(model, rows_hint=rows, kernels=cpu_decode_kernels(model, "auto"))
        session = fast.session()
        ids = torch.randint(100, model.config.vocab_size - 1, (rows, prompt_len), generator=gen)
        positions = torch.arange(prompt_len).expand(rows, prompt_len)
        session.prefill(ids, torch.ones_like(ids), positions)
        token = torch.randint(100, model.config.vocab_size - 1, (rows,), generator=gen)
        step_times = []
        for i in range(steps):
            t0 = time.perf_counter()
            session.step(token, torch.full((rows,), prompt_len + i))
            step_times.append(time.perf_counter() - t0)
        weights = [m.weight for m in model.modules() if isinstance(m, torch.nn.Linear)]
        inputs = {w.shape[1]: torch.randn(rows, w.shape[1], generator=gen).to(torch_dtype) for w in weights}
        # The matmuls alone, each way there is: torch's F.linear, oneDNN with the weight prepacked, and
        # the compiled kernels' packed matmul (float32, where they build); the fastest is the reference.
        ways: dict[str, list[Any]] = {"F.linear": [functools.partial(F.linear, weight=w) for w in weights],
                "prepacked": [_Linear([w], None, rows) for w in weights]}
        if fast.kernels is not None and torch_dtype == torch.float32:
            ways["compiled"] = [_Linear([w], None, rows, fast.kernels) for w in weights]
        matmul_times: dict[str, list[float]] = {way: [] for way in ways}
        for _ in range(steps):
            for way, linears in ways.items():
                t0 = time.perf_counter()
                for w, linear in zip(weights, linears):
                    linear(inputs[w.shape[1]])
                matmul_times[way].append(time.perf_counter() - t0)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    matmul = {way: statistics.median(t[1:]) for way, t in matmul_times.items()}
    return {"step_s": statistics.median(step_times[steps // 4:]), "matmul_s": min(matmul.values()),
            "matmul_by_way_s": matmul, "weight_bytes": weight_bytes, "context": prompt_len + steps,
            "cpu_kernels": fast.kernels is not None}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line, with the settings of the chosen mode (``--quick`` or full) filled in where
    no flag gave them."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help=f"the short guard run before you stop: {describe_mode('quick')}; the full mode: "
                        f"{describe_mode('full')}")
    p.add_argument("--record", action="store_true",
                   help="write this run as its mode's reference (benchmarks/results/grpo_vs_trl.json, or "
                        "grpo_vs_trl_quick.json with --quick); only from a quiet machine")
    p.add_argument("--noise", type=float,
                   help=f"flag a ratio that fell by more than this fraction against the reference (default: "
                        f"{NOISE['quiet']} on a quiet machine, {NOISE['busy']} where other jobs ran alongside)")
    p.add_argument("--warmup", type=int, help="untimed steps per system before the blocks")
    p.add_argument("--blocks", type=int, help="timed blocks per system")
    p.add_argument("--steps-per-block", type=int, help="optimizer steps per block")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--samples", type=int, default=4, help="completions per prompt (GRPO group size)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--lr", type=float, default=None, help="learning rate (default: the quickstart recipe's)")
    p.add_argument("--rollout-limit", default="batch",
                   help="nexrl weight.rollout_limit: batch (start no more rollouts than a step trains on), "
                        "null (rollouts run until the batch is ready), or 'recipe' (leave the recipe's)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--device", default="cpu", help="where both systems train and generate: cpu, or cuda "
                                                   "(benchmarks/gpu_check.py)")
    p.add_argument("--model", help="an HF model folder (default: the quickstart's SmolLM2-135M-Instruct)")
    p.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    p.add_argument("--workers", type=int, default=0,
                   help="nexrl rollout_worker.num_workers (0: prompts x samples, one step's completions)")
    p.add_argument("--nexrl-dtype", nargs="+", choices=("recipe", "float32", "bfloat16", "auto"),
                   help="one nexrl system per value: the train service's and the engine's dtype "
                        "(recipe: leave the quickstart's)")
    p.add_argument("--trl-precisions", nargs="+", choices=("bf16", "fp32"),
                   help="TRL systems to run (bf16: GRPOConfig(bf16=True); fp32: bf16=False)")
    p.add_argument("--nexrl-override", nargs="*", default=[], help="extra nexrl recipe overrides key=value")
    p.add_argument("--micro-batch", type=int, default=0,
                   help="rows per forward/backward on both sides (0: the whole step), for batches whose "
                        "activations do not fit at once; must divide prompts x samples")
    p.add_argument("--trl-gradient-checkpointing", action="store_true",
                   help="run TRL with gradient checkpointing (GRPOConfig's default; off by default here because "
                        "nexrl keeps activations, so both do the same compute)")
    p.add_argument("--roofline-rows", type=int,
                   help="rows of the decode roofline (0: prompts x samples; -1: skip it)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    if args.noise is not None and args.noise <= 0:
        p.error(f"--noise must be a positive fraction, got {args.noise}")
    if args.micro_batch and (args.prompts * args.samples) % args.micro_batch:
        p.error(f"--micro-batch {args.micro_batch} does not divide {args.prompts} x {args.samples} rows")
    args.mode = "quick" if args.quick else "full"
    for key, value in MODES[args.mode].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    return args


def describe_mode(mode: str) -> str:
    m = MODES[mode]
    return (f"nexrl {'+'.join(m['nexrl_dtype'])} vs TRL {'+'.join(m['trl_precisions'])}, warm-up {m['warmup']}, "
            f"{m['blocks']} blocks x {m['steps_per_block']} steps, "
            f"{'no roofline' if m['roofline_rows'] < 0 else 'decode roofline'}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    load_before = loadavg()  # before this run adds its own load

    import torch
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    import trl

    from nexrl_torch.models import resolve_model_path

    model_path = args.model = args.model or resolve_model_path("smollm2-135m-instruct")
    if args.lr is None:
        from nexrl_core.launch.recipe import load_recipe

        args.lr = float(load_recipe(QUICKSTART).service.train_service.lr)
    steps_per_system = args.warmup + args.blocks * args.steps_per_block
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"grpo_vs_trl  {started}  torch {torch.__version__} ({torch.get_num_threads()} threads), "
          f"transformers {transformers.__version__}, trl {trl.__version__}; CPU {cpu_name()}"
          + (f"; GPU {torch.cuda.get_device_name(torch.device(args.device))}" if args.device != "cpu" else ""))
    print(f"model {model_path}; {args.prompts} prompts x {args.samples} samples/step, <= {args.max_new_tokens} "
          f"new tokens, temperature 1.0, beta 0, lr {args.lr}; warm-up {args.warmup}, {args.blocks} blocks x "
          f"{args.steps_per_block} steps per system ({args.mode} mode); nexrl weight.rollout_limit="
          f"{args.rollout_limit}; load avg {load_before} before the run, {loadavg()} now", flush=True)

    with tempfile.TemporaryDirectory(prefix="nexrl-vs-trl-") as tmp:
        nexrls = [NexrlSystem(args, steps_per_system, os.path.join(tmp, f"nexrl-{i}"), dtype)
                  for i, dtype in enumerate(args.nexrl_dtype)]
        for nx in nexrls:
            print(f"{nx.name}: train service {nx.dtypes[0]}, engine {nx.dtypes[1]}", flush=True)
        rows, _ = arithmetic_rows(args.seed)
        # TRL sees the prompts in the order nexrl's data loader hands them out (epoch 0).
        order = list(nexrls[0].controller.dataloader._order)
        need = steps_per_system * args.prompts
        order = (order * (need // len(order) + 1))[:need]
        trls = [TrlSystem(args, model_path, rows, order, steps_per_system, os.path.join(tmp, f"trl-{precision}"),
                          precision) for precision in args.trl_precisions]
        systems: list[Any] = [*trls, *nexrls]
        times: dict[str, list[float]] = {s.name: [] for s in systems}
        windows: dict[str, list[tuple[float, float]]] = {s.name: [] for s in systems}
        peak_gib: dict[str, float] = {s.name: 0.0 for s in systems}  # device memory, on a GPU
        cpu_times: dict[str, list[float]] = {s.name: [] for s in systems}
        block_loads: list[str] = []
        try:
            for s in systems:  # warm-up: model load, first generation, allocator warm-up
                t0, t1, _ = run_block(s, args.warmup) if args.warmup else (0.0, 0.0, 0.0)
                print(f"warm-up {s.name}: {args.warmup} step(s) in {t1 - t0:.1f}s", flush=True)
            for b in range(args.blocks):
                shift = b % len(systems)
                for s in systems[shift:] + systems[:shift]:
                    if args.device != "cpu":
                        torch.cuda.reset_peak_memory_stats()
                    t0, t1, cpu = run_block(s, args.steps_per_block)
                    if args.device != "cpu":
                        peak_gib[s.name] = max(peak_gib[s.name], torch.cuda.max_memory_allocated() / (1 << 30))
                    took = t1 - t0
                    times[s.name].append(took)
                    cpu_times[s.name].append(cpu)
                    windows[s.name].append((t0, t1))
                    block_loads.append(loadavg())
                    print(f"block {b + 1} {s.name:<15}: {args.steps_per_block} steps in {took:7.1f}s "
                          f"= {took / args.steps_per_block:6.2f} s/step, CPU {cpu:6.1f}s   "
                          f"(load avg {block_loads[-1]})", flush=True)
        finally:
            for s in systems:
                s.close()
        rewards = {s.name: s.rewards for s in systems}
        tokens = {s.name: s.response_tokens for s in systems}
        engines = {nx.name: (nx.controller.inference_client, nx.controller.trajectory_pool.counters()) for nx in nexrls}
        # nexrl's own split of a step (its metrics' timing/*), over the timed steps: where "the rest" goes.
        trainer_split = {nx.name: nx.timing_split(args.warmup) for nx in nexrls}

    n = args.blocks * args.steps_per_block
    sps = {name: n / sum(t) for name, t in times.items()}
    print()
    for name, t in times.items():
        print(f"{name:<15}: {1 / sps[name]:6.2f} s/step  ({sps[name]:.4f} steps/s)   blocks {[f'{x:.1f}' for x in t]}")
    ratios: dict[str, float] = {}
    cpu_ratios: dict[str, float] = {}  # the same in CPU seconds: steadier under load, blind to idle waits
    # Issue 32's targets, for the pairs of the same precision; a mixed pair is printed without one.
    targets = {"nexrl-fp32 / TRL-fp32": ">= 2.9", "nexrl-bf16 / TRL-bf16": ">= 2.5"}
    for nx in nexrls:
        for trl_sys in trls:
            key = f"{nx.name} / {trl_sys.name}"
            ratios[key] = sps[nx.name] / sps[trl_sys.name]
            per_block = [t / x for t, x in zip(times[trl_sys.name], times[nx.name])]
            cpu_ratios[key] = sum(cpu_times[trl_sys.name]) / sum(cpu_times[nx.name])
            print(f"ratio {key} (steps/s): {ratios[key]:.2f}x   per block: "
                  f"{', '.join(f'{r:.2f}' for r in per_block)} (median {statistics.median(per_block):.2f})   "
                  f"{'target ' + targets[key] + '   ' if key in targets else ''}(CPU seconds per step: {cpu_ratios[key]:.2f}x)")
    gen = {s.name: overlap(s.gen_intervals, windows[s.name]) / n for s in systems}
    tokens_per_s = {name: statistics.mean(t) * sps[name] for name, t in tokens.items() if t}
    print("response tokens/s: " + ", ".join(f"{name} {v:.0f}" for name, v in tokens_per_s.items())
          + ("; peak device memory: " + ", ".join(f"{name} {v:.1f} GiB" for name, v in peak_gib.items())
             if args.device != "cpu" else ""))
    for name in times:
        step = sum(times[name]) / n
        print(f"  {name:<15} per step: generation {gen[name]:6.2f}s, the rest (logprobs, loss, backward, optimizer, "
              f"weight push, framework) {step - gen[name]:6.2f}s")
    print("  (TRL generation = _generate_and_score_completions; nexrl = the engine's batched decode.)")
    for name, split in trainer_split.items():
        print(f"  {name} trainer per step: " + ", ".join(f"{key.removeprefix('timing/').removesuffix('_s')} {v:.2f}s"
                                                      for key, v in split.items()))
    for name, (engine, stats) in engines.items():
        decoder = getattr(engine, "decoder", None)  # the GPU's static decoder counts KV pools and CUDA graphs
        static = {key: getattr(decoder, key) for key in ("pool_allocations", "graph_captures") if hasattr(decoder, key)}
        print(f"  {name} engine: {engine.num_batches} batches / {engine.num_requests} requests for "
              f"{len(rewards[name])} steps x {args.prompts * args.samples} trained; pool counters {stats}"
              + (f"; decoder {static}" if static else ""))
    steps = min(len(r) for r in rewards.values())
    names = list(rewards)
    print(f"mean reward per step (step: {' / '.join(names)}):")
    print("  " + "  ".join(f"{i + 1}: " + "/".join(f"{rewards[k][i]:.3f}" for k in names) for i in range(steps)))
    print("  mean over steps: " + ", ".join(f"{k} {statistics.mean(rewards[k][:steps]):.3f}" for k in names)
          + f"   load avg {loadavg()}")
    rooflines = {}
    if args.roofline_rows >= 0:
        rows_ = args.roofline_rows or args.prompts * args.samples
        for dtype in sorted({nx.dtypes[1] for nx in nexrls}, reverse=True):
            roofline = rooflines[dtype] = decode_roofline(model_path, dtype, rows_, prompt_len=40,
                                                          steps=args.max_new_tokens)
            ways = ", ".join(f"{way} {t * 1e3:.1f} ms" for way, t in roofline["matmul_by_way_s"].items())
            kernels = "compiled kernels" if roofline["cpu_kernels"] else "torch ops"
            print(f"decode roofline ({dtype}, {rows_} rows, context up to {roofline['context']}): fast-path step ({kernels}) "
                  f"{roofline['step_s'] * 1e3:.1f} ms; the matmuls of the same weights alone "
                  f"({roofline['weight_bytes'] / 1e6:.0f} MB; {ways}): {roofline['step_s'] / roofline['matmul_s']:.2f}x "
                  f"the faster   target <= 1.3")
    others = other_load(load_before, block_loads, torch.get_num_threads())
    noise = args.noise or NOISE["busy" if others >= 1.0 else "quiet"]
    run = {"date": started, "mode": args.mode, "args": vars(args), "cpu": cpu_name(),
           "torch_threads": torch.get_num_threads(), "load_avg": [load_before, *block_loads],
           "other_load": others, "times": times, "cpu_times": cpu_times, "ratios": ratios,
           "cpu_ratios": cpu_ratios, "generation_s_per_step": gen, "nexrl_trainer_split_s": trainer_split, "rewards": rewards,
           "decode_roofline": rooflines,
           "response_tokens_per_s": tokens_per_s, "peak_memory_gib": peak_gib}
    print(f"\nother jobs' load: about {others:.1f} (1-minute load average {load1(load_before):.1f} before "
          f"the run, up to {max(map(load1, block_loads), default=0.0):.1f} during it with its own "
          f"{torch.get_num_threads()} threads): {'busy' if others >= 1.0 else 'quiet'} machine, "
          f"noise threshold {noise:.0%}")
    verdict: list[str] | None = None
    judged_ref: dict[str, Any] | None = None
    for mode in dict.fromkeys([args.mode, *MODES]):  # its own mode's reference first: the only one judged
        ref = load_reference(REFERENCES[mode])
        if ref is None and mode != args.mode:
            continue
        lines, slower = compare_to_reference(run, ref, noise, os.path.relpath(REFERENCES[mode], REPO))
        print("\n".join(lines))
        if mode == args.mode:
            verdict, judged_ref = slower, ref
    for path in ([args.json] if args.json else []) + ([REFERENCES[args.mode]] if args.record else []):
        with open(path, "w") as f:
            json.dump(run, f, indent=1)
            f.write("\n")
    if args.record:
        print(f"recorded as the {args.mode} reference: {os.path.relpath(REFERENCES[args.mode], REPO)}"
              + (f" (WARNING: other jobs ran alongside, load about {others:.1f}: record again on a quiet machine)"
                 if others >= 1.0 else ""))
    line, status = guard_outcome(args.mode, run["cpu"], verdict, noise, judged_ref)
    print(line)
    return status


def guard_outcome(mode: str, cpu: str, verdict: list[str] | None, noise: float,
                  ref: dict[str, Any] | None) -> tuple[str, int]:
    """The guard's last line and the exit status: 1 when a ratio fell by more than ``noise`` against
    the reference (``verdict``: the slowdowns, None when nothing was judged), on any CPU; the line
    says when the reference ratio came from another CPU."""
    outcome = ("not judged (see above)" if verdict is None else f"SLOWER: {', '.join(verdict)}" if verdict
               else f"no ratio fell by more than {noise:.0%}")
    if verdict is not None and ref is not None and ref.get("cpu") != cpu:
        outcome += f" (the reference ratio came from another CPU: {ref.get('cpu', '?')})"
    return f"guard ({mode} mode, CPU {cpu}): {outcome}", 1 if verdict else 0


def load1(load: str) -> float:
    """The 1-minute figure of a :func:`loadavg` string (0 where the platform has none)."""
    try:
        return float(load.split()[0])
    except (ValueError, IndexError):
        return 0.0


def other_load(load_before: str, block_loads: list[str], own_threads: int) -> float:
    """About how much other work shared the machine: the 1-minute load average before the run, or
    the highest one during it less this run's own compute threads, whichever is larger."""
    during = max(map(load1, block_loads), default=0.0) - own_threads
    return round(max(load1(load_before), during, 0.0), 2)


def load_reference(path: str) -> dict[str, Any] | None:
    """The run recorded at ``path`` (None when none is); a damaged file stops with its name and line."""
    try:
        with open(path) as f:
            ref = json.load(f)
    except FileNotFoundError:
        return None
    except json.JSONDecodeError as exc:
        raise SystemExit(f"{path}:{exc.lineno}: not valid JSON ({exc.msg}); record it again with --record") from None
    if not isinstance(ref, dict) or not isinstance(ref.get("ratios"), dict):
        raise SystemExit(f"{path}: no 'ratios' mapping; record it again with --record")
    return ref


def compare_to_reference(run: dict[str, Any], ref: dict[str, Any] | None, noise: float,
                         label: str) -> tuple[list[str], list[str] | None]:
    """Lines comparing ``run``'s ratios (nexrl steps/s over TRL steps/s) with the recorded ``ref``, and
    the slowdowns: each ratio below the reference's by more than ``noise`` (a fraction). Judged on
    any CPU: each ratio is nexrl against TRL measured in the same run, so the machine's own speed
    cancels out; a reference from another CPU is said so (how much the pair's ratio moves between
    CPUs is in benchmarks/README.md, "The guard"). None when nothing can be judged: no reference,
    or one taken with other workload settings (another measurement; the changes are shown)."""
    if ref is None:
        return [f"no reference at {label} yet: record one on a quiet machine with --record"], None
    ref_args = ref.get("args", {})
    other = [f"{key} {ref_args.get(key)!r} -> {run['args'].get(key)!r}" for key in WORKLOAD_ARGS
             if ref_args.get(key) != run["args"].get(key)]
    lines = [f"against {label} ({ref.get('date', 'undated')}, CPU {ref.get('cpu', '?')}):"]
    if other:
        lines.append(f"  not judged (other settings: {', '.join(other)})")
    elif ref.get("cpu") != run["cpu"]:
        lines.append(f"  judged on this run's ratios against TRL, with the reference ratio from another CPU "
                     f"(this one: {run['cpu']}): a change beyond noise may be the CPU's as well as the code's")
    slower = []
    for key, now in run["ratios"].items():
        then = ref["ratios"].get(key)
        if not isinstance(then, (int, float)) or then <= 0:
            lines.append(f"  {key}: {now:.2f}x, none recorded")
            continue
        change = now / then - 1
        if other:
            verdict = f"{change:+.1%}"
        elif change < -noise:
            verdict = f"SLOWER by {-change:.1%}"
            slower.append(f"{key} by {-change:.1%}")
        elif change > noise:
            verdict = f"faster by {change:.1%}"
        else:
            verdict = f"{change:+.1%}, within noise ({noise:.0%})"
        cpu_now, cpu_then = run.get("cpu_ratios", {}).get(key), ref.get("cpu_ratios", {}).get(key)
        if cpu_now and cpu_then:  # shown, never judged (see benchmarks/README.md, "The guard")
            verdict += (f"   (CPU seconds: {cpu_now:.2f}x now, {cpu_then:.2f}x recorded, "
                        f"{cpu_now / cpu_then - 1:+.1%})")
        lines.append(f"  {key}: {now:.2f}x now, {then:.2f}x recorded: {verdict}")
    return lines, None if other else slower


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            info = f.read()
    except OSError:
        return "unknown"
    fields = dict(line.split(":", 1) for line in info.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    native_bf16 = "avx512_bf16" in info or "amx_bf16" in info
    # A virtual machine may only say "AMD EPYC": family and model tell the generation.
    return (f"{fields.get('model name', '?')} (family {fields.get('cpu family', '?')} "
            f"model {fields.get('model', '?')}, {os.cpu_count()} cores, "
            f"{'native' if native_bf16 else 'no native'} bf16)")


if __name__ == "__main__":
    sys.exit(main())
