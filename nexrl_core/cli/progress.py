"""``nexrl run``'s view of a run on stderr: a header, one update per training step, a footer.

Two renderings of the same information: ``rich`` (a live bar and status line for a terminal)
and ``plain`` (one line per step and per validation, no control codes: CI logs, files). The
display is a metrics listener of the controller (``log(metrics, step)``): it is handed the rows
the run already recorded, in the driver process, so it never touches the data path. Step time,
ETA and throughput come from the rows' ``time`` stamps.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, TextIO

from ..config.schema import installed
from ..redaction import scrub

MODES = ("rich", "plain", "off")
VAL_KEY = "val/reward"  # every validation reports it (docs/evaluation.md)
_RECENT = 20  # step intervals the speed and ETA are averaged over
_REWARD_WINDOW = 10


def choose_mode(setting: str, stream: TextIO) -> str:
    """``logger.progress`` -> rich | plain | off (auto: rich on a terminal when rich is installed,
    plain elsewhere)."""
    if setting != "auto":
        return setting
    try:
        tty = stream.isatty()
    except (AttributeError, ValueError):
        tty = False
    return "rich" if tty and os.environ.get("TERM") != "dumb" and installed("rich") else "plain"


def format_duration(seconds: float | None) -> str:
    if seconds is None or seconds != seconds or seconds < 0:
        return "?"
    seconds = int(round(seconds))
    h, rest = divmod(seconds, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def _rate(value: float | None, unit: str) -> str:
    if value is None:
        return f"? {unit}"
    return f"{value:,.0f} {unit}" if value >= 100 else f"{value:.3g} {unit}"


# A training step's parts, as the trainer measures them: waiting for the batch (its generation, in sync
# mode), the update, the last weight sync.
STEP_SPLIT = ("timing/wait_batch_s", "timing/train_s", "timing/weight_sync_s")


class StepStats:
    """What the display shows, folded from metrics rows (pure bookkeeping, no output)."""

    def __init__(self, total_steps: int, start_step: int = 0):
        self.total = int(total_steps)
        self.start_step = int(start_step)
        self.step = int(start_step)
        self.started = time.time()
        self.last_row_time: float | None = None
        self.intervals: deque[float] = deque(maxlen=_RECENT)
        self.step_time: float | None = None
        self.samples_per_s: float | None = None
        self.tokens_per_s: float | None = None
        self.reward: float | None = None
        self.rewards: deque[float] = deque(maxlen=_REWARD_WINDOW)
        self.val: float | None = None
        self.val_step: int | None = None
        self.val_metrics: dict[str, float] = {}
        self.staleness_mean: float | None = None
        self.staleness_max: float | None = None
        self.failed_total = 0
        self.failed_last = 0
        self.split: tuple[float, float, float] | None = None  # generate (waiting for the batch), train, weight sync
        self.memory: tuple[float, float] | None = None  # device GiB: allocated, peak of the step
        self.flat_groups: float | None = None  # share of the step's rows in groups whose rewards all tied
        self.no_signal = False  # the step could not move the weights (every group tied, or nothing trained)

    def add(self, metrics: dict[str, Any], step: int) -> str | None:
        """Fold one row in; returns its kind: 'train', 'val' or None (neither)."""
        if "train/num_trajectories" in metrics:
            self._train(metrics, step)
            return "train"
        if any(k.startswith("val/") for k in metrics):
            self.val_metrics = {k: float(v) for k, v in metrics.items()
                                if k.startswith("val/") and isinstance(v, (int, float))}
            self.val = self.val_metrics.get(VAL_KEY)
            self.val_step = step
            return "val"
        return None

    def _train(self, m: dict[str, Any], step: int) -> None:
        now = float(m.get("time") or time.time())
        if self.last_row_time is not None:
            interval = now - self.last_row_time
        else:  # the first step seen: what the trainer measured of it
            interval = sum(float(m.get(k, 0.0) or 0.0) for k in STEP_SPLIT)
        self.last_row_time = now
        self.step = step
        if interval > 0:
            self.intervals.append(interval)
            self.step_time = interval
            samples = float(m.get("train/num_trajectories", 0)) + float(m.get("train/num_failed", 0))
            self.samples_per_s = samples / interval
            tokens = m.get("train/num_response_tokens")
            self.tokens_per_s = float(tokens) / interval if tokens is not None else None
        if "train/reward_mean" in m:
            self.reward = float(m["train/reward_mean"])
            self.rewards.append(self.reward)
        if "train/staleness_mean" in m:
            self.staleness_mean = float(m["train/staleness_mean"])
            self.staleness_max = float(m.get("train/staleness_max", self.staleness_mean))
        self.failed_last = int(m.get("train/num_failed", 0) or 0)
        self.failed_total += self.failed_last
        if "timing/train_s" in m:
            self.split = tuple(float(m.get(k, 0.0) or 0.0) for k in STEP_SPLIT)  # type: ignore[assignment]
        flat = m.get("train/rows_in_flat_groups")
        self.flat_groups = float(flat) if flat is not None else None
        grad_norm = m.get("train/grad_norm")
        self.no_signal = bool(m.get("train/update_skipped")) or flat == 1.0 or (grad_norm is not None
                                                                                and float(grad_norm) == 0.0)
        if "train/memory_peak_gib" in m:
            self.memory = (float(m.get("train/memory_allocated_gib", 0.0)), float(m["train/memory_peak_gib"]))

    @property
    def mean_step_time(self) -> float | None:
        return sum(self.intervals) / len(self.intervals) if self.intervals else None

    @property
    def eta(self) -> float | None:
        mean = self.mean_step_time
        return None if mean is None else max(self.total - self.step, 0) * mean

    @property
    def reward_avg(self) -> float | None:
        return sum(self.rewards) / len(self.rewards) if self.rewards else None

    @property
    def elapsed(self) -> float:
        return time.time() - self.started

    def fields(self) -> list[tuple[str, str]]:
        """(label, value) pairs of the status line, in display order."""
        out = [("step time", f"{self.step_time:.2f} s" if self.step_time is not None else "?"),
               ("eta", format_duration(self.eta)),
               ("throughput", f"{_rate(self.samples_per_s, 'samples/s')}"
                              + (f", {_rate(self.tokens_per_s, 'tok/s')}" if self.tokens_per_s is not None else "")),
               ("reward", "?" if self.reward is None else
                f"{self.reward:.3f} (avg{len(self.rewards)} {self.reward_avg:.3f})"),
               ("val", "-" if self.val is None else f"{self.val:.3f} @{self.val_step}"),
               ("staleness", "-" if self.staleness_mean is None else
                f"{self.staleness_mean:.2f} (max {self.staleness_max:.0f})"),
               ("failed", f"{self.failed_total}" + (f" (+{self.failed_last})" if self.failed_last else ""))]
        if self.flat_groups is not None or self.no_signal:
            parts = [] if self.flat_groups is None else [f"{self.flat_groups:.0%}"]
            parts += ["(no learning signal this step: grad norm 0)"] if self.no_signal else []
            out.append(("flat groups", " ".join(parts)))
        if self.split is not None:
            out.append(("split", "gen {:.2f} s / train {:.2f} s / sync {:.2f} s".format(*self.split)))
        if self.memory is not None:
            out.append(("gpu memory", "{:.1f} GiB (peak {:.1f})".format(*self.memory)))
        return out


class RunProgress:
    """The display; ``mode`` is rich, plain or off. Thread-safe: log lines and the SIGINT notice
    may arrive from other threads while the display updates. (Never print to the rich console
    while holding ``_lock``: the live refresh holds rich's lock and then takes ``_lock``.)"""

    def __init__(self, mode: str, total_steps: int, start_step: int = 0, stream: TextIO | None = None):
        if mode not in MODES:
            raise ValueError(f"progress mode {mode!r} is not one of {', '.join(MODES)}")
        self.mode = mode
        self.stream = stream if stream is not None else sys.stderr
        self.stats = StepStats(total_steps, start_step)
        self.status = "starting"
        self._lock = threading.RLock()
        self._live: Any = None
        self._console: Any = None
        if mode == "rich":
            from rich.console import Console

            self._console = Console(file=self.stream, highlight=False, soft_wrap=False)

    # -- output ---------------------------------------------------------------------------------
    def _write(self, text: str) -> None:
        with self._lock:
            try:
                self.stream.write(text + "\n")
                self.stream.flush()
            except (OSError, ValueError):  # a closed stream must not stop the run
                pass

    def print_block(self, title: str, lines: Sequence[tuple[str, str]]) -> None:
        """A titled block of ``label  value`` lines (the header and the footer), secrets scrubbed."""
        if self.mode == "off":
            return
        title, lines = scrub(title), [(label, scrub(value)) for label, value in lines]
        if self.mode == "rich":
            from rich.table import Table
            from rich.text import Text

            grid = Table.grid(padding=(0, 2))
            grid.add_column(style="bold cyan", no_wrap=True)
            grid.add_column(overflow="fold")
            for label, value in lines:
                grid.add_row(label, Text(value))
            self._console.print(Text(title, style="bold"))
            self._console.print(grid)
            return
        width = max((len(label) for label, _ in lines), default=0)
        self._write("\n".join([title] + [f"  {label.ljust(width)}  {value}" for label, value in lines]))

    def notice(self, text: str, style: str = "bold yellow") -> None:
        """A message that must be seen at once (the SIGINT acknowledgement), secrets scrubbed."""
        text = scrub(text)
        if self.mode == "rich":
            from rich.text import Text

            self._console.print(Text(text, style=style))
        else:  # plain, and off too: a stop is acknowledged whatever the display
            self._write(text)

    def log_sink(self, message: Any) -> None:
        """A loguru sink for the console: in rich mode the lines go above the live display."""
        text = str(message).rstrip("\n")
        if self.mode == "rich":
            from rich.text import Text

            self._console.print(Text.from_ansi(text), soft_wrap=True)
        else:
            self._write(text)

    # -- the live part ------------------------------------------------------------------------
    def start(self, status: str = "starting") -> None:
        self.status = status
        if self.mode == "rich" and self._live is None:
            from rich.live import Live

            self._live = Live(get_renderable=self._render, console=self._console, refresh_per_second=4,
                              transient=False, redirect_stdout=False, redirect_stderr=False)
            self._live.start()

    def set_status(self, status: str) -> None:
        self.status = status

    def log(self, metrics: dict[str, Any], step: int) -> None:
        """Listener interface: one metrics row of the run."""
        with self._lock:
            kind = self.stats.add(metrics, step)
            if kind == "train":
                self.status = "training"
        if self.mode == "plain" and kind is not None:
            self._write(self.step_line() if kind == "train" else self.val_line())
        elif self.mode == "rich" and kind == "val":
            self.notice(self.val_line(), style="green")

    def step_line(self) -> str:
        s = self.stats
        pct = 100.0 * s.step / s.total if s.total else 0.0
        parts = [f"step {s.step}/{s.total} ({pct:.0f}%)"] + [f"{label} {value}" for label, value in s.fields()]
        return " | ".join(parts)

    def val_line(self) -> str:
        s = self.stats
        shown = {k: v for k, v in s.val_metrics.items() if not k.split("/", 1)[1].startswith("num_")}
        keys = sorted(shown, key=lambda k: (k != VAL_KEY, k))
        text = " ".join(f"{k}={shown[k]:.4g}" for k in keys[:8]) + (f" (+{len(keys) - 8} more)" if len(keys) > 8 else "")
        counts = s.val_metrics
        return (f"validation @ step {s.val_step}: {text} ({int(counts.get('val/num_samples', 0))} samples, "
                f"{int(counts.get('val/num_failed', 0))} failed)")

    def _render(self) -> Any:
        from rich.console import Group
        from rich.progress_bar import ProgressBar
        from rich.table import Table
        from rich.text import Text

        with self._lock:
            s = self.stats
            bar = Table.grid(padding=(0, 1))
            bar.add_row(Text(self.status, style="bold"),
                        ProgressBar(total=max(s.total, 1), completed=s.step, width=36),
                        Text(f"{s.step}/{s.total}", style="bold"),
                        Text(f"{100.0 * s.step / s.total if s.total else 0:.0f}%"),
                        Text(f"elapsed {format_duration(s.elapsed)}", style="dim"),
                        Text(f"eta {format_duration(s.eta)}", style="cyan"))
            line = Text()
            for _i, (label, value) in enumerate(s.fields()):
                if label == "eta":
                    continue
                if line:
                    line.append("  ")
                line.append(f"{label} ", style="dim")
                line.append(value, style="red" if label == "failed" and s.failed_total else "")
            return Group(bar, line)

    def close(self) -> None:
        """Stop the live display (its last frame stays on screen)."""
        with self._lock:
            live, self._live = self._live, None
        if live is not None:
            live.stop()
