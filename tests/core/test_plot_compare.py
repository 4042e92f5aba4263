"""`nexrl plot RUN_DIR RUN_DIR ...`: several runs on shared axes, one panel per metric and one line
per run. Real run folders (metrics.jsonl rows as a run writes them: step, time, metrics), the real
`nexrl` command, and the matplotlib figure the panels are drawn into."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nexrl_core.cli.plot import (
    comparison_figure,
    comparison_panels,
    plot_runs,
    read_runs,
    run_labels,
)
from nexrl_core.errors import ConfigError

pytest.importorskip("matplotlib")

REPO = Path(__file__).resolve().parents[2]


def nexrl(cwd: Path, *args) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "nexrl"
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "nexrl_core.cli"]
    env = dict(os.environ, NEXRL_LOAD_PLUGINS="", HOME=str(cwd), PYTHONPATH=str(REPO))
    return subprocess.run([*cmd, *map(str, args)], capture_output=True, text=True, env=env, cwd=cwd, timeout=120)


def write_run(folder: Path, rows: list[dict]) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder / "metrics.jsonl", "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            f.write(json.dumps({"step": row["step"], "time": 1.7e9 + i, **{k: v for k, v in row.items()
                                                                          if k != "step"}}) + "\n")
    return folder


def rl_rows(scale: float, accuracy: bool) -> list[dict]:
    """An RL run: training reward, advantages and gradient norm each step; validation every 2."""
    rows: list[dict] = []
    for step in range(1, 7):
        rows.append({"step": step, "train/reward_mean": scale * step / 10, "train/loss": 1e-9,
                     "train/grad_norm": 3.0 - scale * step / 10, "train/advantages_abs_mean": 0.5})
        if step % 2 == 0:
            val = {"val/reward": scale * step / 12, "val/num_samples": 64.0}
            if accuracy:
                val["val/accuracy"] = step / 12
            rows.append({"step": step, **val})
    return rows


@pytest.fixture
def two_runs(tmp_path):
    full = write_run(tmp_path / "full", rl_rows(1.0, accuracy=True))
    lora = write_run(tmp_path / "lora", rl_rows(0.5, accuracy=False))
    return full, lora


def test_two_runs_share_each_metrics_axes_one_line_per_run(tmp_path, two_runs):
    full, lora = two_runs
    out = tmp_path / "figs" / "full_vs_lora.png"
    plot = nexrl(tmp_path, "plot", full, lora, "-o", out)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(out) and plot.stderr == ""  # -o given: no note
    assert out.read_bytes()[:4] == b"\x89PNG"
    assert not (full / "comparison.png").exists() and not (full / "metrics.png").exists()

    panels = comparison_panels(read_runs([str(full), str(lora)]))
    # the union of the runs' metrics; val/accuracy only in `full`, so only its line there
    assert [p.metric for p in panels] == ["train/reward_mean", "val/reward", "val/accuracy", "train/grad_norm"]
    assert {p.metric: [ln.run for ln in p.lines] for p in panels} == {
        "train/reward_mean": ["full", "lora"], "val/reward": ["full", "lora"], "val/accuracy": ["full"],
        "train/grad_norm": ["full", "lora"]}
    by_metric = {p.metric: {ln.run: ln for ln in p.lines} for p in panels}
    assert by_metric["train/reward_mean"]["lora"].points == [(s, 0.5 * s / 10) for s in range(1, 7)]
    assert by_metric["train/reward_mean"]["lora"].smooth == 10
    assert by_metric["val/reward"]["full"].points == [(s, s / 12) for s in (2, 4, 6)]
    assert by_metric["val/accuracy"]["full"].points == [(s, s / 12) for s in (2, 4, 6)]
    assert by_metric["train/grad_norm"]["full"].points == [(s, 3.0 - s / 10) for s in range(1, 7)]

    # what is drawn: each panel's legend names its runs; each labelled line holds that run's values,
    # in the same colour on every panel
    import matplotlib.pyplot as plt

    fig = comparison_figure(panels, "full vs lora")
    try:
        assert len(fig.axes) == len(panels)
        colours: dict[str, set] = {}
        for ax, panel in zip(fig.axes, panels):
            assert [t.get_text() for t in ax.get_legend().get_texts()] == [ln.run for ln in panel.lines]
            drawn = [line for line in ax.get_lines() if not line.get_label().startswith("_")]
            assert [line.get_label() for line in drawn] == [ln.run for ln in panel.lines]
            for line, want in zip(drawn, panel.lines):
                assert list(line.get_xdata()) == [s for s, _ in want.points]
                colours.setdefault(want.run, set()).add(line.get_color())
                if not want.smooth:
                    assert list(line.get_ydata()) == [v for _, v in want.points]
        assert all(len(c) == 1 for c in colours.values()) and colours["full"] != colours["lora"]
        # the reward panel's line is the running mean; the first value is the first step's
        reward = [ln for ln in fig.axes[0].get_lines() if ln.get_label() == "full"][0]
        assert reward.get_ydata()[0] == pytest.approx(0.1)
        assert reward.get_ydata()[1] == pytest.approx((0.1 + 0.2) / 2)
    finally:
        plt.close(fig)


def test_without_o_the_comparison_goes_to_the_first_runs_folder_and_says_so(tmp_path, two_runs):
    full, lora = two_runs
    plot = nexrl(tmp_path, "plot", full, lora)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(full / "comparison.png")
    assert (full / "comparison.png").read_bytes()[:4] == b"\x89PNG"
    assert plot.stderr.strip().splitlines() == [
        f"note: 2 runs compared in {full / 'comparison.png'} (the first run's folder; -o FILE.png to write it "
        f"elsewhere)"]
    assert not (lora / "comparison.png").exists()
    assert "comparison.png" in nexrl(tmp_path, "plot", "--help").stdout  # the default is in the help


def test_one_run_is_drawn_as_before(tmp_path, two_runs):
    full, _ = two_runs
    plot = nexrl(tmp_path, "plot", full)
    assert plot.returncode == 0, plot.stderr
    assert plot.stdout.strip() == str(full / "metrics.png") and plot.stderr == ""
    assert not (full / "comparison.png").exists()


def test_a_folder_without_metrics_is_one_error_line_naming_it(tmp_path, two_runs):
    full, _ = two_runs
    (tmp_path / "empty").mkdir()
    plot = nexrl(tmp_path, "plot", full, tmp_path / "empty", "-o", tmp_path / "out.png")
    assert plot.returncode == 2
    assert plot.stderr.splitlines() == [f"error: {tmp_path / 'empty'}: no metrics.jsonl here (is it a run "
                                        f"directory? `run_dir` in the recipe)"]
    assert "Traceback" not in plot.stderr and plot.stdout == ""
    assert not (tmp_path / "out.png").exists()
    # each bad folder its own line; a folder that is not there says so
    both = nexrl(tmp_path, "plot", tmp_path / "nowhere", full, tmp_path / "empty")
    assert both.returncode == 2
    assert both.stderr.splitlines() == [
        f"error: {tmp_path / 'nowhere'}: no such run directory",
        f"error: {tmp_path / 'empty'}: no metrics.jsonl here (is it a run directory? `run_dir` in the recipe)"]
    assert not (full / "comparison.png").exists()
    with pytest.raises(ConfigError, match="empty: no metrics.jsonl here"):
        plot_runs([str(full), str(tmp_path / "empty")], str(tmp_path / "out.png"))


def test_runs_with_the_same_folder_name_are_told_apart_in_the_legend(tmp_path):
    lr_a = write_run(tmp_path / "lr1e-5" / "run", rl_rows(1.0, accuracy=False))
    lr_b = write_run(tmp_path / "lr3e-6" / "run", rl_rows(0.5, accuracy=False))
    assert [name for name, _ in read_runs([str(lr_a), str(lr_b)])] == ["lr1e-5/run", "lr3e-6/run"]
    out = tmp_path / "lr.png"
    plot = nexrl(tmp_path, "plot", lr_a, lr_b, "-o", out)
    assert plot.returncode == 0, plot.stderr
    assert out.read_bytes()[:4] == b"\x89PNG"

    import matplotlib.pyplot as plt

    fig = comparison_figure(comparison_panels(read_runs([str(lr_a), str(lr_b)])), "lr")
    try:
        for ax in fig.axes:
            assert [t.get_text() for t in ax.get_legend().get_texts()] == ["lr1e-5/run", "lr3e-6/run"]
    finally:
        plt.close(fig)
    # as many parent folders as it takes; a unique name stays short; the same folder twice is numbered
    assert run_labels(["/x/a/run", "/y/a/run", "/z/other"]) == ["x/a/run", "y/a/run", "other"]
    assert run_labels(["/w/run", "/w/run/"]) == ["w/run", "w/run (2)"]
    assert run_labels(["full", "lora"]) == ["full", "lora"]


def test_an_rl_run_and_a_supervised_run_each_have_their_update_panel(tmp_path):
    rl = write_run(tmp_path / "grpo", rl_rows(1.0, accuracy=False))
    sft = write_run(tmp_path / "sft", [{"step": s, "train/loss": 2.0 / s} for s in range(1, 5)])
    panels = comparison_panels(read_runs([str(rl), str(sft)]))
    assert [(p.metric, [ln.run for ln in p.lines]) for p in panels] == [
        ("train/reward_mean", ["grpo"]), ("val/reward", ["grpo"]), ("train/grad_norm", ["grpo"]),
        ("train/loss", ["sft"])]
    assert panels[-1].lines[0].points == [(s, 2.0 / s) for s in range(1, 5)]
    out = plot_runs([str(rl), str(sft)], str(tmp_path / "mixed.png"))
    assert Path(out).read_bytes()[:4] == b"\x89PNG"
