"""``metrics.png`` of a run directory: training reward (and each domain's), validation scores and
the update (gradient norm of an RL run, loss of a supervised one) by step.

Written at the end of ``nexrl run`` and on demand by ``nexrl plot RUN_DIR``. Needs matplotlib
(the ``plot`` extra: ``pip install 'nexrl-core[plot]'``); everything else here is plain Python.
"""

from __future__ import annotations

import os
from typing import Any

import yaml

from ..errors import ConfigError, NexRLError
from ..runtime.run_log import METRICS_FILE, read_jsonl

PLOT_FILE = "metrics.png"
TRAIN_REWARD = "train/reward_mean"
LOSS_KEYS = ("train/loss", "train/pg_loss")
GRAD_NORM = "train/grad_norm"
ADVANTAGES = "train/advantages_abs_mean"  # logged by policy-gradient trainers
_SMOOTH = 10  # steps of the training reward's running mean


class MissingMatplotlib(NexRLError):
    """The plot needs matplotlib, which is not installed."""


def read_metrics(run_dir: str) -> list[dict[str, Any]]:
    """The rows of ``run_dir/metrics.jsonl`` (a torn or foreign line is skipped)."""
    path = os.path.join(run_dir, METRICS_FILE)
    if not os.path.isfile(path):
        raise ConfigError(f"{run_dir}: no {METRICS_FILE} here (is it a run directory? `run_dir` in the recipe)")
    return [row for row in read_jsonl(path) if isinstance(row.get("step"), int)]


def series(rows: list[dict[str, Any]]) -> dict[str, list[tuple[int, float]]]:
    """metric -> [(step, value)] in step order; a step recorded twice keeps its last value."""
    by_key: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key in ("step", "time") or isinstance(value, bool) or not isinstance(value, (int, float)):
                continue
            by_key.setdefault(key, {})[row["step"]] = float(value)
    return {k: sorted(v.items()) for k, v in by_key.items()}


def validation_keys(found: dict[str, list[tuple[int, float]]]) -> list[str]:
    """The validation lines worth drawing on one 0..1 axis: the overall scores (``val/<score_key>``,
    not the sample counts) whose values are fractions, and, with several data sources, each
    source's reward (``val/<data_source>_reward``). metrics.jsonl keeps the rest."""
    names = {k.split("/", 1)[1] for k in found if k.startswith("val/")}
    names -= {n for n in names if n.startswith("num_")}
    sources = {n[:-len("_reward")] for n in names if n.endswith("_reward") and n != "reward"}
    per_source = {n for n in names for src in sources if n.startswith(src + "_")}
    overall = [n for n in names - per_source
               if all(-1e-9 <= v <= 1 + 1e-9 for _, v in found[f"val/{n}"])]
    keys = sorted(overall, key=lambda n: (n != "reward", n))
    if len(sources) > 1:
        keys += sorted(f"{src}_reward" for src in sources)
    return [f"val/{n}" for n in keys]


def domain_reward_keys(found: dict[str, list[tuple[int, float]]]) -> list[str]:
    """Each domain's training reward (``train/<domain>/reward_mean``, multi-domain runs), by name."""
    return sorted(k for k in found if k.startswith("train/") and k.endswith("/reward_mean") and k.count("/") == 2)


def update_key(found: dict[str, list[tuple[int, float]]]) -> str | None:
    """What the third panel draws. A policy-gradient surrogate's value is about 0 by construction
    (advantages are centred, the ratio starts at 1), so it says nothing about progress: RL runs
    show the gradient norm; supervised runs show their loss."""
    if ADVANTAGES in found and GRAD_NORM in found:
        return GRAD_NORM
    return next((k for k in LOSS_KEYS if k in found), None)


def _title(run_dir: str) -> str:
    """``experiment_name`` from the run's config.yaml, else the folder's name."""
    folder = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    try:
        with open(os.path.join(run_dir, "config.yaml"), encoding="utf-8") as f:
            name = (yaml.safe_load(f) or {}).get("experiment_name")
    except (OSError, AttributeError, yaml.YAMLError):
        return folder
    return f"{name} ({folder})" if name and name != folder else folder


def _running_mean(values: list[float], window: int) -> list[float]:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def plot_run(run_dir: str, out: str | None = None, title: str | None = None) -> str:
    """Draw the run's metrics to ``out`` (default ``run_dir/metrics.png``); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
        from matplotlib.ticker import MaxNLocator
    except ImportError:
        raise MissingMatplotlib("the plot needs matplotlib: pip install 'nexrl-core[plot]'") from None
    found = series(read_metrics(run_dir))
    if not found:
        raise ConfigError(f"{os.path.join(run_dir, METRICS_FILE)}: no metrics recorded yet")
    out = out or os.path.join(run_dir, PLOT_FILE)
    val_keys = validation_keys(found)
    third = update_key(found)
    panels = [p for p, present in (("reward", TRAIN_REWARD in found), ("val", bool(val_keys)),
                                   ("update", third is not None)) if present]
    if not panels:
        raise ConfigError(f"{os.path.join(run_dir, METRICS_FILE)}: neither {TRAIN_REWARD} nor validation metrics "
                          f"recorded yet")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.8 * len(panels) + 0.6), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        if panel == "reward":
            steps, values = zip(*found[TRAIN_REWARD])
            ax.plot(steps, values, color="tab:blue", alpha=0.35, linewidth=1, label="reward_mean")
            ax.plot(steps, _running_mean(list(values), _SMOOTH), color="tab:blue", linewidth=2,
                    label=f"running mean ({_SMOOTH} steps)")
            for i, key in enumerate(domain_reward_keys(found)):  # smoothed: a domain has fewer samples a step
                steps, values = zip(*found[key])
                ax.plot(steps, _running_mean(list(values), _SMOOTH), color=f"C{i + 1}", linewidth=1.5,
                        linestyle="--", label=f"{key.split('/')[1]} (running mean)")
            ax.set_ylabel("training reward")
        elif panel == "val":
            for key in val_keys:
                steps, values = zip(*found[key])
                ax.plot(steps, values, marker="o", markersize=4, linewidth=1.5, label=key)
            ax.set_ylabel("validation")
        elif third is not None:
            steps, values = zip(*found[third])
            ax.plot(steps, values, color="tab:red", linewidth=1.2, label=third)
            ax.set_ylabel("gradient norm" if third == GRAD_NORM else "loss")
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title or _title(run_dir))
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
