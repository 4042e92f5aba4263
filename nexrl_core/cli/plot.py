"""``metrics.png`` of a run directory: training reward (and each domain's), validation scores and
the update (gradient norm of an RL run, loss of a supervised one) by step.

Written at the end of ``nexrl run`` and on demand by ``nexrl plot RUN_DIR``. ``nexrl plot RUN_DIR
RUN_DIR ...`` compares runs instead: one panel per metric, one line per run (:func:`plot_runs`). Needs
matplotlib (the ``plot`` extra: ``pip install 'nexrl-core[plot]'``); everything else here is plain Python.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import ConfigError, NexRLError
from ..runtime.run_log import METRICS_FILE, read_jsonl

PLOT_FILE = "metrics.png"
COMPARISON_FILE = "comparison.png"  # several runs' default: in the first run's folder
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


# ----------------------------------------------------------------------------- several runs


@dataclass(frozen=True)
class Line:
    """One run's values of a panel's metric: raw (step, value) points; ``smooth`` steps of running
    mean drawn over them (0: drawn as they are)."""

    run: str
    points: list[tuple[int, float]]
    smooth: int = 0


@dataclass(frozen=True)
class Panel:
    """One metric of a comparison: a line for each run that recorded it, in the runs' order."""

    metric: str
    ylabel: str
    lines: list[Line]


class RunProblems(ConfigError):
    """Run folders that cannot be compared; ``problems`` holds one line each (the CLI prints each)."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("; ".join(problems))


def _mergeable(keys_by_run: list[list[str]]) -> list[str]:
    """The union of each run's keys, in the order they first appear."""
    return list(dict.fromkeys(k for keys in keys_by_run for k in keys))


def run_labels(run_dirs: list[str]) -> list[str]:
    """Each run's legend name: its folder's name, or as many trailing path parts as tell it apart
    from the others' (``a/run``, ``b/run``); the same folder given twice gets `` (2)``."""
    parts = [os.path.normpath(os.path.abspath(d)).split(os.sep) for d in run_dirs]
    parts = [[p for p in ps if p] or [os.sep] for ps in parts]
    depth = [1] * len(parts)

    def label(i: int) -> str:
        return "/".join(parts[i][-depth[i]:])

    while True:
        groups: dict[str, list[int]] = {}
        for i in range(len(parts)):
            groups.setdefault(label(i), []).append(i)
        grow = [i for same in groups.values() if len(same) > 1 for i in same if depth[i] < len(parts[i])]
        if not grow:
            break
        for i in grow:
            depth[i] += 1
    labels: list[str] = []
    seen: dict[str, int] = {}
    for i in range(len(parts)):
        name = label(i)
        seen[name] = seen.get(name, 0) + 1
        labels.append(name if seen[name] == 1 else f"{name} ({seen[name]})")
    return labels


def read_runs(run_dirs: list[str]) -> list[tuple[str, dict[str, list[tuple[int, float]]]]]:
    """(legend name, :func:`series`) of each run, in the order given. A folder that is not there,
    has no metrics.jsonl or no metrics yet is one problem line naming it (all of them, one error)."""
    problems, found = [], []
    for run_dir in run_dirs:
        if not os.path.isdir(run_dir):
            problems.append(f"{run_dir}: no such run directory")
        elif not os.path.isfile(os.path.join(run_dir, METRICS_FILE)):
            problems.append(f"{run_dir}: no {METRICS_FILE} here (is it a run directory? `run_dir` in the recipe)")
        else:
            metrics = series(read_metrics(run_dir))
            if not metrics:
                problems.append(f"{os.path.join(run_dir, METRICS_FILE)}: no metrics recorded yet")
            found.append(metrics)
    if problems:
        raise RunProblems(problems)
    return list(zip(run_labels(run_dirs), found))


def comparison_panels(runs: list[tuple[str, dict[str, list[tuple[int, float]]]]]) -> list[Panel]:
    """The panels comparing ``runs`` ((name, :func:`series`) each): the union of what each run's own
    plot draws, one metric a panel (training reward, each domain's, each validation score, the
    gradient norm or loss), with a line for each run that recorded the metric."""
    metrics = [TRAIN_REWARD] if any(TRAIN_REWARD in found for _, found in runs) else []
    metrics += sorted(_mergeable([domain_reward_keys(found) for _, found in runs]))
    metrics += _mergeable([validation_keys(found) for _, found in runs])
    updates = {name: update_key(found) for name, found in runs}
    metrics += _mergeable([[key] for key in updates.values() if key is not None])
    panels = []
    for metric in metrics:
        update = metric in updates.values()  # a line for the runs whose own plot draws it (not an RL surrogate)
        reward = metric == TRAIN_REWARD or metric.endswith("/reward_mean")
        if metric == TRAIN_REWARD:
            ylabel = "training reward"
        elif reward:
            ylabel = f"{metric.split('/')[1]} training reward"
        elif metric.startswith("val/"):
            ylabel = "validation"
        else:
            ylabel = "gradient norm" if metric == GRAD_NORM else "loss"
        lines = [Line(name, found[metric], _SMOOTH if reward else 0) for name, found in runs
                 if metric in found and (not update or updates[name] == metric)]
        panels.append(Panel(metric, ylabel, lines))
    return panels


def comparison_figure(panels: list[Panel], title: str) -> Any:
    """The matplotlib figure of ``panels``: run i in colour ``C<i>`` on every panel; a smoothed
    line's raw values faint behind it. Each panel's labelled lines are its runs, in order."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed; must precede pyplot
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    colours: dict[str, str] = {}
    for panel in panels:
        for line in panel.lines:
            colours.setdefault(line.run, f"C{len(colours)}")
    fig, axes = plt.subplots(len(panels), 1, figsize=(8, 2.4 * len(panels) + 0.8), sharex=True, squeeze=False)
    for ax, panel in zip(axes[:, 0], panels):
        for line in panel.lines:
            steps, values = zip(*line.points)
            colour = colours[line.run]
            if line.smooth:
                ax.plot(steps, values, color=colour, alpha=0.25, linewidth=1)
                ax.plot(steps, _running_mean(list(values), line.smooth), color=colour, linewidth=2, label=line.run)
            else:
                ax.plot(steps, values, color=colour, linewidth=1.5, label=line.run,
                        marker="o" if panel.metric.startswith("val/") else None, markersize=4)
        window = max(ln.smooth for ln in panel.lines)
        ax.set_title(panel.metric + (f" (running mean, {window} steps)" if window else ""), fontsize=9)
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.legend(loc="best", fontsize=8)
    axes[-1, 0].set_xlabel("step")
    fig.suptitle(title)
    fig.tight_layout()
    return fig


def comparison_out(run_dirs: list[str]) -> str:
    """Where a comparison goes without ``-o``: ``comparison.png`` in the first run's folder."""
    return os.path.join(run_dirs[0], COMPARISON_FILE)


def plot_runs(run_dirs: list[str], out: str | None = None) -> str:
    """Draw the runs' metrics on shared axes (:func:`comparison_panels`) to ``out`` (default
    :func:`comparison_out`); returns the path."""
    try:
        import matplotlib

        matplotlib.use("Agg")  # no display needed; must precede pyplot
        import matplotlib.pyplot as plt
    except ImportError:
        raise MissingMatplotlib("the plot needs matplotlib: pip install 'nexrl-core[plot]'") from None
    runs = read_runs(run_dirs)
    panels = comparison_panels(runs)
    if not panels:
        raise ConfigError(f"none of {', '.join(run_dirs)} recorded {TRAIN_REWARD}, validation scores or a loss yet")
    names = [name for name, _ in runs]
    fig = comparison_figure(panels, " vs ".join(names) if len(names) <= 3 else f"{len(names)} runs")
    out = out or comparison_out(run_dirs)
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
