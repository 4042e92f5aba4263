"""nexrl alone at grpo_vs_trl's configuration: seconds per training step and where they go.

The quickstart recipe with grpo_vs_trl's nexrl overrides (4 prompts x 4 samples, <= 48 new tokens,
T = 1.0, weight.rollout_limit batch, no validation, no checkpoints), run through
``NexRLController``. A step's time runs from one weight push to the next (its generation, its
training, its push); inside it the engine's ``_generate``, the train service's ``forward_backward``
and ``optim_step`` and the push are timed, with the process's CPU seconds and minor page faults.
Step 1 (warm-up) is left out.

Written to run against an older checkout too, for A/B runs of two commits on one machine
(alternate them, run for run)::

    python benchmarks/step_time.py --steps 6 --json /tmp/new.json
    git worktree add /tmp/old <commit>
    PYTHONPATH=/tmp/old$(printf ':/tmp/old/plugins/%s' nexrl_grpo nexrl_torch nexrl_torch_kernels nexrl_rewards) \
        python benchmarks/step_time.py --tree /tmp/old --json /tmp/old.json

(every plugin folder the quickstart imports, so that none of this checkout's editable installs is picked up.)

Overrides after the options go to the recipe (``+service.train_service.keep_freed_memory=false``).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import threading
import time
from statistics import median
from typing import Any

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=6, help="training steps (the first is warm-up)")
    p.add_argument("--tree", default=REPO, help="the checkout whose code runs (put it first on PYTHONPATH)")
    p.add_argument("--dtype", default="float32", help="train service and engine dtype (where the tree has the key)")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--json", help="also write the per-step figures here")
    p.add_argument("overrides", nargs="*", help="more recipe overrides key=value")
    args = p.parse_args(argv)

    import torch
    from loguru import logger

    logger.remove()
    logger.add(sys.stderr, level="WARNING", diagnose=False, backtrace=False)
    if args.threads:
        torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()
    from omegaconf import OmegaConf

    import nexrl_core
    import nexrl_grpo
    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe
    from nexrl_torch.rollout import engine
    from nexrl_torch.train import service as train_service

    tree = os.path.abspath(args.tree)
    for module in (nexrl_core, nexrl_grpo):
        if not os.path.abspath(module.__file__).startswith(tree):
            print(f"{module.__name__} comes from {module.__file__}, not {tree}: put the tree first on PYTHONPATH")
            return 2
    spans: dict[str, list[tuple[float, float]]] = {}
    lock = threading.Lock()

    def timed(cls: Any, name: str, key: str) -> None:
        original = getattr(cls, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return original(*a, **k)
            finally:
                with lock:
                    spans.setdefault(key, []).append((t0, time.perf_counter()))

        setattr(cls, name, wrapper)

    timed(engine.HFInferenceEngine, "_generate", "generate")
    timed(train_service.LocalTorchTrainService, "forward_backward", "forward_backward")
    timed(train_service.LocalTorchTrainService, "optim_step", "optim_step")

    quickstart = os.path.join(tree, "recipes", "quickstart.yaml")
    with tempfile.TemporaryDirectory(prefix="nexrl-step-time-") as tmp:
        overrides = [
            f"run_dir={tmp}/run", f"seed={args.seed}", f"trainer.total_train_steps={args.steps}",
            "trainer.save_freq=0", "trainer.save_final=false", "validate.validate_before_train=false", "weight.validate_freq=0",
            "logger.backend=[]", "trajectory_pool.batch_size=16", "trajectory_pool.group_size=4",
            "rollout_worker.num_workers=16", "rollout_worker.sampling.max_tokens=48",
            "rollout_worker.sampling.temperature=1.0", "service.train_service.grad_clip=1.0",
            "weight.rollout_limit=batch", "algorithm.clip_ratio_low=0.2", "algorithm.clip_ratio_high=0.2",
            "algorithm.loss_agg_mode=seq-mean-token-mean",
        ]
        base = load_recipe(quickstart)
        for key in ("service.train_service.dtype", "service.inference_service.dtype"):
            if OmegaConf.select(base, key, default=None) is not None:
                overrides.append(f"{key}={args.dtype}")
        controller = NexRLController(load_recipe(quickstart, overrides + args.overrides))
        sync = controller.weight_sync_controller
        push = sync.train_worker_notify_weight_update
        marks: list[tuple[float, float, int]] = []  # step end: wall, process CPU, minor faults

        def step_end(*a: Any, **k: Any) -> Any:
            cpu = os.times()
            marks.append((time.perf_counter(), cpu.user + cpu.system, resource.getrusage(resource.RUSAGE_SELF).ru_minflt))
            t0 = time.perf_counter()
            try:
                return push(*a, **k)
            finally:
                with lock:
                    spans.setdefault("push", []).append((t0, time.perf_counter()))

        sync.train_worker_notify_weight_update = step_end
        controller.run()
        with open(os.path.join(tmp, "run", "metrics.jsonl")) as f:
            rows = sorted((json.loads(line) for line in f if line.strip()), key=lambda r: r["step"])
    tokens = [r.get("train/response_length_mean", 0.0) * 16 for r in rows if "train/reward_mean" in r]
    steps = []
    for k in range(1, len(marks)):
        (w0, c0, f0), (w1, c1, f1) = marks[k - 1], marks[k]
        phases = {name: round(sum(max(0.0, min(b, w1) - max(a, w0)) for a, b in s), 3) for name, s in spans.items()}
        steps.append({"step": k + 1, "s": round(w1 - w0, 3), "cpu_s": round(c1 - c0, 3), "minor_faults": f1 - f0,
                      "response_tokens": tokens[k] if k < len(tokens) else None, **phases})
    for s in steps:
        print(json.dumps(s))
    load = " ".join(f"{x:.2f}" for x in os.getloadavg())
    print(f"{tree}: median {median(s['s'] for s in steps):.2f} s/step over steps 2..{len(steps) + 1} "
          f"(torch threads {torch.get_num_threads()}, load avg {load})")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"tree": tree, "overrides": args.overrides, "load": load, "steps": steps}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
