"""``nexrl plan`` for LoRA with FSDP2 on 2 ranks, against the measured peaks of such a run.

A random model of Qwen3's shape, smaller (``SHAPE``: 8 layers of Qwen3-0.6B's width and its 151,936
words, 281M parameters; nothing is downloaded), trained for 2 GRPO steps through the ordinary
``nexrl run recipes/quickstart.yaml`` with rank-16 adapters, ``world_size: 2`` and
``parallel: fsdp`` (gloo on the CPU: rank 0 in the run's process beside the in-process engine, rank
1 a process of its own), as benchmarks/qwen3_shape_lora.py runs it with one rank. Per process: its
peak RSS (VmHWM), and ``nexrl plan``'s prediction for it: rank 0's process is the plan's ``cpu``
total (its share of the train service, the engine, the runtime), rank 1's the train service's
items and the runtime. Target: each within 20%.

    python benchmarks/lora_fsdp_plan.py [--out benchmarks/results/lora_fsdp_plan]
    python benchmarks/lora_fsdp_plan.py --plan-only   # the plan again for the recorded peaks
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))

import qwen3_shape_lora as bench  # noqa: E402
from _peaks import run_with_peaks  # noqa: E402

SHAPE = {**bench.QWEN3_0_6B, "num_hidden_layers": 8}
CONFIG = "lora_fsdp2"
OVERRIDES = ["service.train_service.lr=2e-4", "+service.train_service.lora.rank=16",
             "+service.train_service.lora.alpha=32", "service.train_service.world_size=2",
             "service.train_service.parallel=fsdp"]
TARGET_PLAN_ERROR = bench.TARGET_PLAN_ERROR


def build_model(folder: Path, weights: bool = True) -> int:
    bench.QWEN3_0_6B, saved = SHAPE, bench.QWEN3_0_6B
    try:
        return bench.build_model(folder, weights)
    finally:
        bench.QWEN3_0_6B = saved


def overrides(model_dir: Path, work: Path, world_size: int = 2) -> list[str]:
    bench.CONFIGS[CONFIG] = OVERRIDES if world_size == 2 else OVERRIDES[:3]  # 1: the same run on one rank
    return bench.overrides_of(CONFIG, model_dir, work)


def planned(model_dir: Path, work: Path, world_size: int = 2) -> dict[str, int]:
    """The plan's bytes for rank 0's process (its ``cpu`` total) and rank 1's (train service + runtime)."""
    from nexrl_core.cli import main as nexrl

    # `nexrl plan` as a user runs it, in this process (each plan builds the model on the meta device only)
    text, cwd = io.StringIO(), os.getcwd()
    os.environ.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    try:
        os.chdir(REPO)
        with contextlib.redirect_stdout(text):
            code = nexrl(["plan", "recipes/quickstart.yaml", *overrides(model_dir, work, world_size), "--json"])
    finally:
        os.chdir(cwd)
    if code not in (0, 1):
        raise SystemExit(f"nexrl plan exited {code}")
    cpu = json.loads(text.getvalue())["devices"]["cpu"]
    rank1 = sum(i["bytes"] for i in cpu["items"] if i["role"] in ("train service", "process"))
    return {"rank0": int(cpu["total"]), "rank1": rank1} if world_size == 2 else {"rank0": int(cpu["total"])}


def run_once(model_dir: Path, work: Path, world_size: int = 2) -> dict:
    run_dir = work / f"run-{time.monotonic_ns()}"
    started = time.monotonic()
    peaks = run_with_peaks([*bench.CLI, "run", "recipes/quickstart.yaml", f"run_dir={run_dir}",
                            *overrides(model_dir, work, world_size)], REPO, bench.ENV)
    if peaks.returncode != 0:
        raise SystemExit(f"nexrl run exited {peaks.returncode}\n{peaks.output[-4000:]}")
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in steps if "train/loss" in r]
    assert [r["step"] for r in steps] == [1, 2], steps
    peak = {"rank0": round(peaks.main / 1e9, 2)}
    if world_size == 2:  # the rank: the largest process the run spawned (Python's resource tracker is small)
        peak["rank1"] = round(peaks.largest_child() / 1e9, 2)
    return {"config": CONFIG, "world_size": world_size, "peak_rss_gb": peak,
            "run_s": round(time.monotonic() - started, 1),
            "grad_norm": [round(r["train/grad_norm"], 4) for r in steps], "load": list(peaks.load)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "lora_fsdp_plan"))
    parser.add_argument("--world-sizes", default="2,1", help="runs, alternated: 2 (FSDP2) and 1 (the same on one "
                                                             "rank, for reference)")
    parser.add_argument("--plan-only", action="store_true", help="recompute the plan for the recorded peaks")
    args = parser.parse_args()
    out = Path(args.out)
    with tempfile.TemporaryDirectory(prefix="lora-fsdp-plan-") as tmp:
        work = Path(tmp)
        if args.plan_only:
            recorded = json.loads(out.with_suffix(".json").read_text())
            params = build_model(work / "model", weights=False)
            machine, runs = recorded["machine"], recorded["runs"]
        else:
            params = build_model(work / "model")
            machine = f"{bench.cpu_name()}, {os.cpu_count()} cores"
            runs = [run_once(work / "model", work, int(w)) for w in args.world_sizes.split(",")]
        for run in runs:
            run["plan_gb"] = {k: round(v / 1e9, 2) for k, v in planned(work / "model", work,
                                                                        run["world_size"]).items()}
    lines = [f"Qwen3 shape, 8 layers ({params / 1e6:.0f}M parameters, random weights), LoRA rank 16, 2 GRPO steps "
             f"of the quickstart; world_size 2: FSDP2 (gloo); {machine}; torch {__import__('torch').__version__}",
             f"{'run':<18} {'peak RSS':>9}  nexrl plan (target within {TARGET_PLAN_ERROR:.0%} of the peak)"]
    for run in runs:
        for rank, peak in run["peak_rss_gb"].items():
            error = run["plan_gb"][rank] / peak - 1
            lines.append(f"{'world ' + str(run['world_size']) + ' ' + rank:<18} {peak:>7.2f}GB  "
                         f"{run['plan_gb'][rank]:>6.2f}GB {error:+6.1%} "
                         f"{'met' if abs(error) <= TARGET_PLAN_ERROR else 'MISSED'}")
    print("\n".join(lines))
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".txt").write_text("\n".join(lines) + "\n")
    out.with_suffix(".json").write_text(json.dumps({"machine": machine, "parameters": params, "runs": runs},
                                                   indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
