"""Reward curves of several advantage estimators on the quickstart task, side by side.

Each estimator trains ``recipes/quickstart.yaml`` (SmolLM2-135M-Instruct, two-number additions,
GRPO's PPO-clip loss, lr 1e-5) for ``--steps`` steps with ``algorithm.type`` switched, nothing
else changed: same seed, so the same prompts in the same order, and step 1 samples from the same
initial model. Each run is ``nexrl run recipes/quickstart.yaml <overrides>`` in its own process,
with checkpoints and validation off. ``gae`` trains its critic alongside (``algorithm.critic``);
its learning rate is ``--critic-lr`` (10x the policy's, as PPO setups usually pick), and
``reinforce_plus_plus`` puts the KL to the initial model in the reward (its default).

Writes ``<out>/rewards.csv`` (one column per estimator: ``train/reward_mean`` per step),
``<out>/rewards.png`` when matplotlib is installed, and prints a table. A finished estimator's
``metrics.jsonl`` is reused unless ``--force``, so an interrupted comparison resumes.

    python benchmarks/compare_estimators.py                      # grpo rloo reinforce_plus_plus gae, 12 steps
    python benchmarks/compare_estimators.py --steps 4 --estimators grpo gae   # quick look

The machine's load average is printed with the table: wall times on a shared machine move with it.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import shutil
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
QUICKSTART = REPO / "recipes" / "quickstart.yaml"
DEFAULT_ESTIMATORS = ("grpo", "rloo", "reinforce_plus_plus", "gae")


def loadavg() -> str:
    try:
        return " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "n/a"


def overrides(estimator: str, run_dir: Path, args: argparse.Namespace) -> list[str]:
    out = [f"run_dir={run_dir}", "overwrite_run_dir=true", f"trainer.total_train_steps={args.steps}",
           "trainer.save_freq=0", "trainer.save_final=false", "validate.validate_before_train=false", "weight.validate_freq=0",
           "logger.level=WARNING", f"algorithm.type={estimator}", f"data.num_rows={args.rows}"]
    if estimator == "gae":
        out.append(f"+algorithm.critic.lr={args.critic_lr}")
    return out


def nexrl_command() -> list[str]:
    script = Path(sys.executable).with_name("nexrl")
    return [str(script)] if script.is_file() else [shutil.which("nexrl") or "nexrl"]


def read_rewards(metrics: Path) -> dict[int, dict]:
    rows = {}
    for line in metrics.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            if "train/reward_mean" in row:
                rows[int(row["step"])] = row
    return rows


def run_estimator(estimator: str, args: argparse.Namespace) -> tuple[dict[int, dict], float | None]:
    run_dir = args.out / estimator
    metrics = run_dir / "metrics.jsonl"
    if not args.force and metrics.is_file() and len(read_rewards(metrics)) >= args.steps:
        print(f"{estimator}: reusing {metrics}", flush=True)
        return read_rewards(metrics), None
    cmd = nexrl_command() + ["run", str(QUICKSTART), *overrides(estimator, run_dir, args)]
    print(f"{estimator}: {' '.join(cmd[1:])}  (load avg {loadavg()})", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    t0 = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{estimator}: nexrl run failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    print(f"{estimator}: {args.steps} steps in {wall:.0f}s", flush=True)
    return read_rewards(metrics), wall


def write_csv(path: Path, curves: dict[str, dict[int, dict]], steps: int) -> None:
    with path.open("w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["step", *curves])
        for step in range(1, steps + 1):
            writer.writerow([step, *(f"{rows[step]['train/reward_mean']:.4f}" if step in rows else ""
                                     for rows in curves.values())])


def write_png(path: Path, curves: dict[str, dict[int, dict]], title: str) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, rows in curves.items():
        steps = sorted(rows)
        ax.plot(steps, [rows[s]["train/reward_mean"] for s in steps], marker="o", label=name)
    ax.set_xlabel("training step")
    ax.set_ylabel("train/reward_mean (16 samples)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


def mean(values: list[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


def table(curves: dict[str, dict[int, dict]], walls: dict[str, float | None], steps: int) -> str:
    third = max(steps // 3, 1)
    lines = [f"{'estimator':<20} {'first ' + str(third):>8} {'last ' + str(third):>8} {'mean':>6} "
             f"{'s/step':>7}  reward per step"]
    for name, rows in curves.items():
        rewards = [rows[s]["train/reward_mean"] for s in sorted(rows)]
        step_s = mean([rows[s].get("timing/train_s", 0.0) + rows[s].get("timing/wait_batch_s", 0.0)
                       for s in sorted(rows)])
        lines.append(f"{name:<20} {mean(rewards[:third]):>8.3f} {mean(rewards[-third:]):>8.3f} {mean(rewards):>6.3f} "
                     f"{step_s:>7.1f}  " + " ".join(f"{r:.2f}" for r in rewards))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--estimators", nargs="+", default=list(DEFAULT_ESTIMATORS))
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--rows", type=int, default=300, help="data.num_rows of the generated task")
    parser.add_argument("--critic-lr", type=float, default=1e-4, help="algorithm.critic.lr of gae")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "compare_estimators")
    parser.add_argument("--force", action="store_true", help="rerun estimators that already have results")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    started = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    print(f"compare_estimators  {started}  quickstart x {args.steps} steps  load avg {loadavg()}", flush=True)
    curves, walls = {}, {}
    for estimator in args.estimators:
        curves[estimator], walls[estimator] = run_estimator(estimator, args)
    write_csv(args.out / "rewards.csv", curves, args.steps)
    title = (f"quickstart (SmolLM2-135M, 4 prompts x 4 samples/step), {args.steps} steps, "
             f"lr 1e-5, gae critic lr {args.critic_lr:g}")
    png = write_png(args.out / "rewards.png", curves, title)
    print()
    print(table(curves, walls, args.steps))
    print(f"\nload avg at the end {loadavg()}; wrote {args.out / 'rewards.csv'}"
          + (f" and {args.out / 'rewards.png'}" if png else " (matplotlib not installed: no PNG)"))


if __name__ == "__main__":
    main()
