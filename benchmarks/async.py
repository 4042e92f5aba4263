"""Sync against fully-async against fully-async with partial rollout, on one device (issue #47 item 5).

Two shapes, each trained by ``nexrl run`` inside this process, the modes alternated (the order
rotates with the seed, so slow spells of a shared machine hit every mode alike):

- ``quickstart``: ``recipes/quickstart.yaml`` as shipped (SmolLM2-135M, 16 samples of at most 16
  tokens a step).
- ``long_tail``: the same with ``sampling.max_tokens`` raised (``--long-tail-tokens``, 96): most
  replies stop after a few tokens, the rest run to the limit, so a sync step waits for the longest.

Modes:

- ``sync``: the recipe's ``weight.sync_mode: sync`` (rollouts of one batch, then the update).
- ``fully_async``: ``weight.sync_mode: fully-async``, ``staleness_threshold: 1``,
  ``rollouts_ahead: staleness``: the engine decodes the next batch while the trainer steps, the
  two splitting the CPU threads (``decode_threads: auto``).
- ``fully_async_partial``: the same with ``weight.partial_rollout: true`` (a push does not wait
  for the batch decoding).

Per run: steps/s and trained tokens/s from step 2 to the last (the first step pays the start-up),
the validation accuracy curve (greedy, 64 rows, before training and every 10 steps), and the
staleness and re-rolls the pool counted. Per shape and mode: the medians over the seeds, each
mode's speed over sync's, and whether its final accuracy lies within the seeds' spread of sync's.

    python benchmarks/async.py              # 30 steps x 3 seeds x 3 modes x 2 shapes: hours on 2 cores
    python benchmarks/async.py --quick      # 6 steps x 1 seed, validation at 0 and 6: ~10 min idle
    python benchmarks/async.py --dry-run    # a tiny random model, 2 steps: the plumbing (a test runs it)
    python benchmarks/async.py --steps 10 --seeds 1 --shapes long_tail \
        --variant lend fully_async_partial +service.inference_service.lend_idle_threads=true \
        --variant sync_1thread sync +service.train_service.num_threads=1 +service.inference_service.num_threads=1
        # one more mode per --variant, alternated with the others (here: the split with idle threads lent,
        # and each part alone on one thread, the figures an overlap on two cores is bounded by)
    python benchmarks/async.py --steps 8 --seeds 1 --shapes long_tail --modes sync fully_async_partial \
        --variant background_push fully_async_partial +weight.background_push=true
        # the push off the trainer's thread (weight.background_push): "push" is the trainer's share of a
        # push, "in the background" the time until the engine served it

Results: ``benchmarks/results/async.json`` (``--out``) and a table on stdout.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "quickstart.yaml"
MODES = ("sync", "fully_async", "fully_async_partial")
SHAPES = ("quickstart", "long_tail")
ASYNC = ["weight.sync_mode=fully-async", "weight.staleness_threshold=1", "+weight.rollouts_ahead=staleness"]
MODE_OVERRIDES = {
    "sync": [],
    "fully_async": ASYNC,
    "fully_async_partial": ASYNC + ["+weight.partial_rollout=true"],
}


def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as info:
            name = next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")), "")
    except OSError:
        name = ""
    return f"{name or platform.processor() or 'unknown CPU'}, {os.cpu_count()} cores"


def load_average() -> float:
    try:
        return os.getloadavg()[0]
    except OSError:
        return float("nan")


def tiny_model(folder: Path) -> str:
    """A random 2-layer Llama with SmolLM2's tokenizer (the dry run: the plumbing, not the numbers)."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from nexrl_torch.models import resolve_model_path

    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("smollm2-135m-instruct", None))
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         tie_word_embeddings=True)
    import torch

    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


def run_overrides(args: argparse.Namespace, shape: str, mode: str, seed: int, run_dir: Path) -> list[str]:
    out = [f"run_dir={run_dir}", f"seed={seed}", f"trainer.total_train_steps={args.steps}",
           f"weight.validate_freq={args.validate_freq}", "trainer.save_freq=0", "trainer.save_final=false",
           "overwrite_run_dir=true"]
    if shape == "long_tail":
        out.append(f"rollout_worker.sampling.max_tokens={args.long_tail_tokens}")
    if args.model:
        out += [f"service.train_service.model_path={args.model}", f"service.inference_service.model_path={args.model}",
                "validate.data.num_rows=8", "rollout_worker.sampling.max_tokens=8" if shape == "quickstart" else
                "rollout_worker.sampling.max_tokens=24"]
    return out + args.mode_overrides[mode]


def summarize(run_dir: Path) -> dict[str, Any]:
    """Speed over steps 2..N (the first pays the start-up), the validation curve, staleness, re-rolls."""
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "timing/train_s" in r]
    timed = steps[1:]
    span = steps[-1]["time"] - steps[0]["time"] if len(steps) > 1 else float("nan")
    tokens = sum(r.get("train/trained_tokens", 0.0) for r in timed)
    curve = {int(r["step"]): r["val/accuracy"] for r in rows if "val/accuracy" in r}
    return {
        "steps": len(steps),
        "steps_per_s": len(timed) / span if span > 0 else float("nan"),
        "trained_tokens_per_s": tokens / span if span > 0 else float("nan"),
        "response_length_mean": statistics.fmean(r.get("train/response_length_mean", 0.0) for r in steps),
        "truncated_frac_mean": statistics.fmean(r.get("train/truncated_frac", 0.0) for r in steps),
        "train_s_mean": statistics.fmean(r["timing/train_s"] for r in timed) if timed else float("nan"),
        "wait_batch_s_mean": statistics.fmean(r["timing/wait_batch_s"] for r in timed) if timed else float("nan"),
        "weight_sync_s_mean": statistics.fmean(r["timing/weight_sync_s"] for r in timed) if timed else float("nan"),
        # a background push (weight.background_push): from its start until the engine served it, off the trainer
        "push_apply_s_mean": statistics.fmean(r["weight/apply_s"] for r in timed if "weight/apply_s" in r)
        if any("weight/apply_s" in r for r in timed) else float("nan"),
        "staleness_max": max((r.get("train/token_staleness_max", 0.0) for r in steps), default=0.0),
        "stale_rerolled": steps[-1].get("pool/stale_rerolled", 0.0) if steps else 0.0,
        "val_accuracy": curve,
    }


def run_one(args: argparse.Namespace, shape: str, mode: str, seed: int, work: Path) -> dict[str, Any]:
    import torch

    from nexrl_core.cli import main

    run_dir = work / f"{shape}-{mode}-seed{seed}"
    load, started, cpu = load_average(), time.perf_counter(), time.process_time()
    threads = torch.get_num_threads()
    try:
        code = main(["run", str(RECIPE), *run_overrides(args, shape, mode, seed, run_dir)])
    finally:
        torch.set_num_threads(threads)  # a run's num_threads is process-wide: the next run starts as this one did
    if code != 0:
        raise SystemExit(f"{shape}/{mode}/seed {seed}: nexrl run exited {code} (see {run_dir}/run.log)")
    result = {"shape": shape, "mode": mode, "seed": seed, "load_before": load,
              "wall_s": time.perf_counter() - started, "cpu_s": time.process_time() - cpu, **summarize(run_dir)}
    print(f"  {shape:10s} {mode:20s} seed {seed}: {result['steps_per_s']:.3f} steps/s, "
          f"{result['trained_tokens_per_s']:.1f} trained tokens/s (train {result['train_s_mean']:.2f} s, wait "
          f"{result['wait_batch_s_mean']:.2f} s, push {result['weight_sync_s_mean']:.2f} s a step, in the background "
          f"{result['push_apply_s_mean']:.2f} s), val {result['val_accuracy']}, "
          f"token staleness <= {result['staleness_max']:.0f}, {result['stale_rerolled']:.0f} re-rolled stale "
          f"(load {load:.1f} before)", flush=True)
    return result


def compare(results: list[dict[str, Any]]) -> dict[str, Any]:
    """Per shape and mode: medians over the seeds, speed over sync's, final accuracy against sync's spread."""
    table: dict[str, Any] = {}
    for shape in sorted({r["shape"] for r in results}):
        modes = list(dict.fromkeys(r["mode"] for r in results))
        by_mode = {m: [r for r in results if r["shape"] == shape and r["mode"] == m] for m in modes}
        base = by_mode.get("sync") or []
        base_speed = statistics.median(r["trained_tokens_per_s"] for r in base) if base else None
        base_steps = statistics.median(r["steps_per_s"] for r in base) if base else None
        finals = [list(r["val_accuracy"].values())[-1] for r in base if r["val_accuracy"]]
        for mode, runs in by_mode.items():
            if not runs:
                continue
            speed = statistics.median(r["trained_tokens_per_s"] for r in runs)
            steps = statistics.median(r["steps_per_s"] for r in runs)
            final = [list(r["val_accuracy"].values())[-1] for r in runs if r["val_accuracy"]]
            within = None
            if finals and final:  # async learns no worse than sync beyond the seeds' spread
                within = statistics.mean(final) >= min(finals) - 1e-9
            table[f"{shape}/{mode}"] = {
                "steps_per_s": steps, "trained_tokens_per_s": speed,
                "tokens_per_s_vs_sync": speed / base_speed if base_speed else None,
                "steps_per_s_vs_sync": steps / base_steps if base_steps else None,
                "final_val_accuracy": final, "final_within_sync_spread": within,
            }
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--quick", action="store_true", help="6 steps, 1 seed, validation at 0 and 6")
    parser.add_argument("--dry-run", action="store_true", help="a tiny random model, 2 steps, 1 seed (the plumbing)")
    parser.add_argument("--steps", type=int, default=None, help="training steps a run (default 30)")
    parser.add_argument("--seeds", type=int, nargs="+", default=None, help="default 1 2 3")
    parser.add_argument("--shapes", nargs="+", choices=SHAPES, default=list(SHAPES))
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--long-tail-tokens", type=int, default=96, help="max_tokens of the long-tail shape")
    parser.add_argument("--out", default=None, help="results JSON (default benchmarks/results/async[_quick].json)")
    parser.add_argument("--variant", action="append", nargs="+", default=[], metavar="NAME BASE KEY=VALUE",
                        help="one more mode, alternated with the others: mode BASE (one of the modes) with these "
                             "recipe overrides, e.g. --variant lend fully_async_partial "
                             "+service.inference_service.lend_idle_threads=true")
    parser.add_argument("--work", default=None, help="folder for the runs (default: a temporary one)")
    args = parser.parse_args(argv)
    args.mode_overrides = {m: MODE_OVERRIDES[m] for m in args.modes}
    for name, base, *overrides in (v + [""] if len(v) == 1 else v for v in args.variant):
        if name in args.mode_overrides or base not in MODES or not all("=" in o for o in overrides):
            raise SystemExit(f"--variant: expected a new NAME, a BASE mode of {MODES} and KEY=VALUE overrides, "
                             f"got {[name, base, *overrides]}")
        args.mode_overrides[name] = MODE_OVERRIDES[base] + overrides
    args.modes = list(args.mode_overrides)
    args.model = None
    if args.dry_run:
        args.steps, args.seeds, args.validate_freq = args.steps or 2, args.seeds or [1], 2
    elif args.quick:
        args.steps, args.seeds, args.validate_freq = args.steps or 6, args.seeds or [1], 6
    else:
        args.steps, args.seeds, args.validate_freq = args.steps or 30, args.seeds or [1, 2, 3], 10
    kind = "dry_run" if args.dry_run else "quick" if args.quick else "full"
    out = Path(args.out) if args.out else ROOT / "benchmarks" / "results" / \
        {"full": "async.json", "quick": "async_quick.json", "dry_run": "async_dry_run.json"}[kind]
    with tempfile.TemporaryDirectory(prefix="nexrl-async-bench-") as scratch:
        work = Path(args.work) if args.work else Path(scratch)
        if args.dry_run:
            args.model = tiny_model(Path(scratch) / "tiny")
        print(f"benchmarks/async.py ({kind}): {cpu_name()}; load {load_average():.1f} before; "
              f"{args.steps} steps x seeds {args.seeds} x {args.modes} x {args.shapes}", flush=True)
        results = []
        for i, seed in enumerate(args.seeds):
            for shape in args.shapes:
                modes = args.modes[i % len(args.modes):] + args.modes[:i % len(args.modes)]  # rotate the order
                for mode in modes:
                    results.append(run_one(args, shape, mode, seed, work))
    table = compare(results)
    for key, row in table.items():
        ratio = row["tokens_per_s_vs_sync"]
        print(f"{key:36s} {row['steps_per_s']:.3f} steps/s  {row['trained_tokens_per_s']:8.1f} tok/s  "
              f"{'' if ratio is None else f'{ratio:.2f}x sync'}  final val {row['final_val_accuracy']}"
              f"{'' if row['final_within_sync_spread'] is None else '  within sync spread: ' + str(row['final_within_sync_spread'])}")
    record = {"kind": kind, "cpu": cpu_name(), "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
              "load_after": load_average(), "steps": args.steps, "seeds": args.seeds,
              "long_tail_tokens": args.long_tail_tokens, "overrides": args.mode_overrides, "runs": results, "table": table}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
