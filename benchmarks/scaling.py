"""Trained tokens/s of the train service as data-parallel ranks grow (``world_size`` 1, 2, ...).

Each system runs ``--steps`` updates (forward_backward + optim_step, GRPO's loss shape: per-token
log-probs of the responses, a token-mean surrogate) on the same synthetic batch, alternating in
blocks so background load hits every world size alike. Ranks split the batch's rows and sum their
gradients through FSDP2 (or DDP), gloo on the CPU, NCCL on GPUs. On the CPU the ranks share the
machine's cores (one torch thread per rank; one rank gets all of them), so a figure here says what
the data path and its collectives cost, not what more hardware buys.

    python benchmarks/scaling.py                       # SmolLM2-135M, 16 rows x (40 + 48) tokens, 1 and 2 ranks
    python benchmarks/scaling.py --systems 1 2:ddp --steps 3
    python benchmarks/scaling.py --systems 1 1:fsdp --device cuda   # the FSDP2 wrapper's cost on one GPU

A system is ``N`` (N ranks; FSDP2 when N > 1) or ``N:fsdp`` / ``N:ddp``; ``1`` alone is the plain
one-process service.
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
    p.add_argument("--systems", nargs="+", default=["1", "2"], help="N or N:fsdp / N:ddp each")
    p.add_argument("--device", default="cpu")
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--prompt", type=int, default=40)
    p.add_argument("--response", type=int, default=48)
    p.add_argument("--steps", type=int, default=2, help="updates per block")
    p.add_argument("--blocks", type=int, default=2)
    p.add_argument("--model", help="an HF folder (default: the quickstart's SmolLM2-135M-Instruct)")
    p.add_argument("--micro-batch", type=int, default=0, help="rows per forward/backward (0: all --rows at once)")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args(argv)
    from loguru import logger

    logger.remove()
    from grpo_vs_trl import cpu_name, loadavg

    from nexrl_torch.models import resolve_model_path
    from nexrl_torch.train.service import LocalTorchTrainService

    model = args.model or resolve_model_path("smollm2-135m-instruct")
    data = batch(args.rows, args.prompt, args.response)
    tokens = int(data["attention_mask"].sum())
    cores = os.cpu_count() or 1
    gpu = f"; GPU {torch.cuda.get_device_name(0)}" if args.device != "cpu" else ""
    print(f"scaling: {model}; {args.rows} rows x ({args.prompt} + {args.response}) tokens; CPU {cpu_name()}, "
          f"{cores} cores{gpu}; load avg {loadavg()}", flush=True)
    services, worlds = {}, {}
    for system in args.systems:
        world, _, parallel = system.partition(":")
        worlds[system] = int(world)
        torch.set_num_threads(max(1, cores // int(world)))
        # The synthetic rows are all one length: packing would only reorder the same work.
        services[system] = LocalTorchTrainService({
            "model_path": model, "world_size": int(world), "parallel": parallel or "auto", "lr": 1e-6, "seed": 0,
            "device": args.device, "packing": False, "micro_batch_size": args.micro_batch or None})
        services[system].forward_backward(data, loss_fn)  # warm-up
        services[system].optim_step()
    times: dict[str, list[float]] = {system: [] for system in args.systems}
    try:
        for block in range(args.blocks):
            order = args.systems[block % len(args.systems):] + args.systems[:block % len(args.systems)]
            for system in order:
                torch.set_num_threads(max(1, cores // worlds[system]))
                t0 = time.perf_counter()
                for _ in range(args.steps):
                    services[system].forward_backward(data, loss_fn)
                    services[system].optim_step()
                if args.device != "cpu":
                    torch.cuda.synchronize()
                times[system].append((time.perf_counter() - t0) / args.steps)
                print(f"block {block + 1} {system}: {times[system][-1]:.3f} s/update", flush=True)
    finally:
        for svc in services.values():
            svc.close()
    base = statistics.median(times[args.systems[0]])
    result = {}
    for system, t in times.items():
        s = statistics.median(t)
        result[system] = {"s_per_update": s, "tokens_per_s": tokens / s, "speedup": base / s}
        print(f"{system:>7}: {s:.3f} s/update, {tokens / s:.0f} trained tokens/s, {base / s:.2f}x {args.systems[0]}"
              f"   (load avg {loadavg()})")
    if args.json:
        import json

        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "cpu": cpu_name(), "results": result, "times": times}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
