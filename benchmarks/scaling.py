"""Trained tokens/s of the train service as data-parallel ranks grow (``world_size`` 1, 2, ...).

Each system runs ``--steps`` updates (forward_backward + optim_step, GRPO's loss shape: per-token
log-probs of the responses, a token-mean surrogate) on the same synthetic batch, alternating in
blocks so background load hits every world size alike. Ranks split the batch's rows and sum their
gradients through FSDP2 (or DDP), gloo on the CPU, NCCL on GPUs. On the CPU the ranks share the
machine's cores (one torch thread per rank; one rank gets all of them), so a figure here says what
the data path and its collectives cost, not what more hardware buys.

    python benchmarks/scaling.py                       # SmolLM2-135M, 16 rows x (40 + 48) tokens, 1 and 2 ranks
    python benchmarks/scaling.py --worlds 1 2 --parallel ddp --steps 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def batch(rows: int, prompt: int, response: int) -> dict:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(10, 40000, (rows, prompt + response), generator=gen)
    mask = torch.ones_like(ids)
    return {"input_ids": ids, "attention_mask": mask, "position_ids": (mask.cumsum(-1) - 1),
            "responses": ids[:, prompt:], "response_mask": torch.ones(rows, response),
            "advantages": torch.randn(rows, response, generator=gen),
            "prompt_groups": torch.arange(rows) // 4}


def loss_fn(log_probs, mb):
    from nexrl_grpo.losses import agg_loss

    return agg_loss(-log_probs * mb["advantages"], mb["response_mask"], "token-mean",
                    batch_num_tokens=mb["batch_num_tokens"]), {}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2])
    p.add_argument("--parallel", default="fsdp", choices=("fsdp", "ddp"))
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--steps", type=int, default=2, help="updates per block")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--model", help="an HF folder (default: the quickstart's SmolLM2-135M-Instruct)")
    args = p.parse_args(argv)
    from loguru import logger

    logger.remove()
    from grpo_vs_trl import cpu_name, loadavg

    from nexrl_grpo.train_service import LocalTorchTrainService
    from nexrl_grpo.weights import resolve_model_path

    model = args.model or resolve_model_path("smollm2-135m-instruct")
    data = batch(args.rows, args.prompt, args.response)
    tokens = int(data["attention_mask"].sum())
    cores = os.cpu_count() or 1
    print(f"scaling: {model}; {args.rows} rows x ({args.prompt} + {args.response}) tokens; {args.parallel}; "
          f"CPU {cpu_name()}, {cores} cores; load avg {loadavg()}", flush=True)
    services = {}
    for world in args.worlds:
        torch.set_num_threads(max(1, cores // world))
        services[world] = LocalTorchTrainService({"model_path": model, "world_size": world, "parallel": args.parallel,
                                                  "lr": 1e-6, "seed": 0, "device": "cpu", "packing": False})
        services[world].forward_backward(data, loss_fn)  # warm-up
        services[world].optim_step()
    times: dict[int, list[float]] = {w: [] for w in args.worlds}
    try:
        for block in range(args.blocks):
            order = args.worlds[block % len(args.worlds):] + args.worlds[:block % len(args.worlds)]
            for world in order:
                torch.set_num_threads(max(1, cores // world))
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    services[world].forward_backward(data, loss_fn)
                    services[world].optim_step()
                times[world].append((time.perf_counter() - t0) / args.steps)
                print(f"block {block + 1} world {world}: {times[world][-1]:.2f} s/update", flush=True)
    finally:
        for svc in services.values():
            svc.close()
    base = statistics.median(times[args.worlds[0]])
    for world, t in times.items():
        s = statistics.median(t)
        print(f"world_size {world}: {s:.2f} s/update, {tokens / s:.0f} trained tokens/s, "
              f"{base / s:.2f}x world {args.worlds[0]}   (load avg {loadavg()})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
