"""Run outputs: metrics.jsonl, errors.jsonl, log file, and experiment-logger sinks."""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import threading
import time
from collections import deque
from typing import Any

from loguru import logger

from ..config.schema import RecipeSettings
from ..redaction import ScrubbedStream, scrub, scrub_values
from .logs import FailureLog, failure_location, failure_signature, format_traceback

METRICS_FILE = "metrics.jsonl"
ERRORS_FILE = "errors.jsonl"
SAMPLES_FILE = "samples.jsonl"
TEXTS_FILE = "texts.jsonl"  # experiment_logger_post(..., content=, title=)
LOG_FILE = "run.log"
#: metrics rows kept in memory for the driver's listeners (the progress display), which read them
#: through :meth:`RunRecorder.rows_since`; a listener that falls further behind skips the oldest
KEPT_ROWS = 1000


def _jsonable(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None if math.isnan(value) else (1e308 if value > 0 else -1e308)
    if hasattr(value, "item"):
        return value.item()
    return value


def _plain_json(value: Any) -> Any:
    """``value`` as JSON sees it (what ``default=str`` would write), so its strings can be scrubbed."""
    return json.loads(json.dumps(value, default=str))


class RunRecorder:
    """Owns the run directory's record files; safe to call from any thread.

    ``run_dir=None`` writes no file (metrics still reach the sinks). ``failure_monitor``
    (a :class:`~nexrl_core.runtime.failure_monitor.FailedSampleMonitor`) is told the outcome of every
    training step: its usable samples and the failed items recorded for it.
    """

    def __init__(self, run_dir: str | None, sinks: list[Any] | None = None, step_end_hook: Any = None,
                 failure_monitor: Any = None, sink_labels: list[str] | None = None,
                 sink_names: list[str] | None = None):
        self.run_dir = run_dir
        if run_dir is not None:
            os.makedirs(run_dir, exist_ok=True)
        self._sinks = list(sinks or [])
        self._sink_labels = list(sink_labels or [f"metrics sink {type(s).__name__}" for s in self._sinks])
        self._sink_names = list(sink_names or [type(s).__name__ for s in self._sinks])  # logger.backend's
        # a failing sink or nexrl_step_end hook is reported (once per distinct error) and training goes on
        self._hook_failures = FailureLog()
        self._step_end_hook = step_end_hook
        self._lock = threading.Lock()
        self._metrics_path = os.path.join(run_dir, METRICS_FILE) if run_dir is not None else None
        self._errors_path = os.path.join(run_dir, ERRORS_FILE) if run_dir is not None else None
        self.lost_items = 0
        self._samples_path = os.path.join(run_dir, SAMPLES_FILE) if run_dir is not None else None
        self.failure_monitor = failure_monitor
        self._step_failures: dict[int, list[tuple[str, str]]] = {}
        self._rows: deque[dict[str, Any]] = deque(maxlen=KEPT_ROWS)
        self._rows_written = 0

    # ActivityTracker.experiment_logger_post lands here.
    def post(self, backend: str = "metrics", data: dict[str, Any] | None = None, step: int | None = None,
             content: str | None = None, title: str | None = None, **kwargs: Any) -> None:
        """The seed's ``experiment_logger_post``: ``data`` (numbers) is a row of metrics.jsonl, and a
        text (``content``, with a ``title``) a line of texts.jsonl and run.log. Both reach the
        sink named ``backend`` (``metrics`` or ``all``: every sink of ``logger.backend``)."""
        sinks = self._sinks_for(backend)
        step = int(step) if step is not None else 0
        if content is not None or title is not None:
            self.log_text(str(title or ""), "" if content is None else str(content), step, sinks)
        if data:
            self.log_metrics(data, step, sinks)

    def _sinks_for(self, backend: str | None) -> list[tuple[Any, str]]:
        pairs = list(zip(self._sinks, self._sink_labels))
        if backend in (None, "metrics", "all"):
            return pairs
        chosen = [pair for pair, name in zip(pairs, self._sink_names) if name == backend]
        if not chosen:
            self._hook_failures.log(f"post-backend-{backend}", f"experiment_logger_post: backend {backend!r} is not "
                                    f"in logger.backend ({', '.join(self._sink_names) or 'none'}): what is posted "
                                    f"to it goes to the run's files only", None)
        return chosen

    def log_text(self, title: str, content: str, step: int, sinks: list[tuple[Any, str]] | None = None) -> None:
        """A text post: a line of texts.jsonl (``step``, ``time``, ``title``, ``content``), run.log,
        and each sink that has ``log_text(title, content, step)``."""
        row = scrub_values({"step": int(step), "time": time.time(), "title": title, "content": content})
        with self._lock:
            if self.run_dir is not None:
                with open(os.path.join(self.run_dir, TEXTS_FILE), "a", encoding="utf-8") as f:
                    f.write(json.dumps(row, sort_keys=True) + "\n")
        logger.info(f"step {step}: {row['title'] or 'text'}: {row['content']}")
        for sink, label in self._sinks if sinks is None else sinks:
            if callable(getattr(sink, "log_text", None)):
                try:
                    sink.log_text(row["title"], row["content"], int(step))
                except Exception as exc:
                    self._hook_failed(label, "log_text", exc,
                                      getattr(sys.modules.get(type(sink).__module__), "__file__", None))

    def log_metrics(self, data: dict[str, Any], step: int, sinks: list[tuple[Any, str]] | None = None) -> None:
        """One row of metrics.jsonl: ``step``, ``time`` (seconds since the epoch) and ``data``; the
        step-end hook runs on the trainer's row of each step (the one with ``train/num_trajectories``)."""
        row = {"step": int(step), "time": time.time(), **{k: _jsonable(v) for k, v in data.items()}}
        with self._lock:
            if self._metrics_path is not None:
                with open(self._metrics_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(scrub_values(row), sort_keys=True) + "\n")
            self._rows.append(row)
            self._rows_written += 1
            failures = self._step_failures.pop(int(step), []) if "train/num_trajectories" in data else None
        if failures is not None and self.failure_monitor is not None:
            self.failure_monitor.observe(int(data["train/num_trajectories"]), failures)
        for sink, label in zip(self._sinks, self._sink_labels) if sinks is None else sinks:
            try:
                sink.log(dict(data), int(step))
            except Exception as exc:
                self._hook_failed(label, "log", exc, getattr(sys.modules.get(type(sink).__module__), "__file__", None))
        if self._step_end_hook is not None and "train/num_trajectories" in data:
            try:
                failed = self._step_end_hook(step=int(step), metrics=dict(data)) or []
            except Exception as exc:
                failed = [("the step-end hook", exc, None)]
            for label, error, source in failed:
                self._hook_failed(label, "nexrl_step_end", error, source)

    def _hook_failed(self, label: str, call: str, exc: BaseException, source: str | None) -> None:
        where = failure_location(exc, os.path.dirname(os.path.abspath(source)) if source else None)
        self._hook_failures.log(failure_signature(f"{label}.{call}", str(exc), exc),
                                f"{label}: {call} raised {type(exc).__name__}: {exc}{f' ({where})' if where else ''};"
                                f" training goes on", format_traceback(exc))

    def rows_since(self, cursor: int) -> tuple[list[dict[str, Any]], int]:
        """Metrics rows recorded since ``cursor`` (0: from the start) and the cursor to pass next."""
        with self._lock:
            kept_from = self._rows_written - len(self._rows)
            rows = list(self._rows)[max(cursor - kept_from, 0):]
            return [dict(r) for r in rows], self._rows_written

    def record_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """Lines of samples.jsonl: generations of training step ``step`` (``logger.samples_every``)."""
        if self._samples_path is None or not samples:
            return
        stamp = time.time()
        lines = "".join(json.dumps(scrub_values(_plain_json({"step": int(step), "time": stamp, **s})),
                                   ensure_ascii=False) + "\n" for s in samples)
        with self._lock:
            with open(self._samples_path, "a", encoding="utf-8") as f:
                f.write(lines)

    def record_lost_item(self, task: dict[str, Any], cause: str, message: str, validating: bool = False,
                         step: int | None = None, detail: dict[str, Any] | None = None) -> None:
        """One line of errors.jsonl: an item that ended failed (see docs/reliability.md).

        ``step``: the training step that consumed the failed item, or for a validation
        sample the step (weight version) being validated. ``detail``: what else the row keeps
        (``response``: the reply that could not be scored, ``error_traceback``).
        """
        row = {"time": time.time(), "cause": cause, "message": message, "validation": bool(validating),
               "step": step, "uid": task.get("uid"), "sample_index": task.get("sample_index"),
               "seq": task.get("seq"), "item": {k: v for k, v in task.items() if k not in ("seq",)},
               **(detail or {})}
        with self._lock:
            self.lost_items += 1
            if not validating and step is not None:
                self._step_failures.setdefault(int(step), []).append((cause, message))
            if self._errors_path is not None:
                with open(self._errors_path, "a", encoding="utf-8") as f:
                    f.write(json.dumps(scrub_values(_plain_json(row))) + "\n")

    def truncate_after(self, step: int) -> None:
        """For a resume from ``step``: keep what that checkpoint already covers.

        metrics.jsonl, errors.jsonl and samples.jsonl alike: training rows up to ``step`` stay;
        validation rows of ``step`` itself are dropped because the resumed run
        validates that step again. A torn last line (the process was killed
        mid-write) is dropped too.
        """
        with self._lock:
            for path, keep in ((self._metrics_path, _keep_metric_row(step)),
                               (self._errors_path, _keep_error_row(step)),
                               (self._samples_path, lambda row: int(row.get("step", 0)) <= step)):
                if path is None or not os.path.exists(path):
                    continue
                with open(path, encoding="utf-8", errors="replace") as f:
                    rows = [line for line in f if line.strip()]
                kept = []
                for line in rows:
                    try:
                        row = json.loads(line)
                    except ValueError:
                        continue
                    if isinstance(row, dict) and keep(row):
                        kept.append(line if line.endswith("\n") else line + "\n")
                tmp = path + ".tmp"
                with open(tmp, "w", encoding="utf-8") as f:
                    f.writelines(kept)
                os.replace(tmp, path)
        for sink in self._sinks:  # a sink with its own history (TensorBoard) forgets the same steps
            truncate = getattr(sink, "truncate_after", None)
            if callable(truncate):
                truncate(step)

    def close(self) -> None:
        for sink in self._sinks:
            try:
                sink.close()
            except Exception as exc:  # a sink failing at exit must not hide the run's result
                logger.warning(f"closing {type(sink).__name__}: {exc}")


def read_jsonl(path: str) -> list[dict[str, Any]]:
    """The object rows of a JSONL run record, in file order (a torn or foreign line is skipped)."""
    rows = []
    with open(path, encoding="utf-8", errors="replace") as f:
        for line in f:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                rows.append(row)
    return rows


def _keep_metric_row(step: int):
    def keep(row: dict[str, Any]) -> bool:
        s = int(row.get("step", 0))
        return s < step or (s == step and not any(k.startswith("val/") for k in row))
    return keep


def _keep_error_row(step: int):
    def keep(row: dict[str, Any]) -> bool:
        if row.get("step") is None:  # written before rows carried a step: keep
            return True
        s = int(row["step"])
        return s < step or (s == step and not row.get("validation"))
    return keep


#: ``extra`` flag of the console sink's per-step metric lines: run.log keeps them, a console that
#: shows the progress display instead leaves them out
STEP_LINE = "nexrl_step_line"
CONSOLE_FORMAT = "<green>{time:HH:mm:ss}</green> <level>{level: <7}</level> {message}"
#: keywords of every loguru sink nexrl adds: a traceback never shows local variables (they may hold
#: secrets and prompts) nor the frames above the one that caught it
SINK_SAFETY = {"diagnose": False, "backtrace": False}


def setup_logging(run_dir: str | None, level: str = "INFO", fresh: bool = False, log_file: str = LOG_FILE,
                  console: Any = None, hide_step_lines: bool = False) -> None:
    """Log to stderr at ``level`` and, with ``run_dir``, to ``run_dir/run.log`` at DEBUG
    (``fresh``: start the file anew instead of appending, for a run that does not resume).

    ``console``: a loguru sink that replaces stderr (the rich progress display prints log lines
    above itself); ``hide_step_lines``: leave the console sink's step lines out of the console."""
    from .logs import route_std_logging

    route_std_logging()
    logger.remove()
    shown = (lambda record: not record["extra"].get(STEP_LINE)) if hide_step_lines else None
    # every sink scrubs secrets from the whole formatted line, tracebacks included
    if console is not None:
        # loguru's stubs take no **mapping of its keywords: SINK_SAFETY is checked where it is written
        logger.add(lambda message: console(scrub(message)), level=level, format=CONSOLE_FORMAT,  # type: ignore[call-overload]
                   colorize=True, filter=shown, **SINK_SAFETY)
    else:
        logger.add(ScrubbedStream(sys.stderr), level=level, format=CONSOLE_FORMAT, filter=shown,  # type: ignore[call-overload]
                   **SINK_SAFETY)
    if run_dir:
        os.makedirs(run_dir, exist_ok=True)
        log = open(os.path.join(run_dir, log_file), "w" if fresh else "a", encoding="utf-8")  # closed by the sink
        logger.add(ScrubbedStream(log, owned=True), level="DEBUG", enqueue=False, colorize=False,  # type: ignore[call-overload]
                   **SINK_SAFETY)


# -- run directories ---------------------------------------------------------------------------------

def writable_dir_problem(path: str, key: str) -> str | None:
    """Why ``path`` cannot be (made into) a folder a run writes to, or None. Tried for real: a
    folder is made and removed again in the deepest folder of ``path`` that exists (nothing else
    is created), since permissions do not tell (root ignores them; a read-only or virtual file
    system such as /proc refuses anyway)."""
    if os.path.exists(path) and not os.path.isdir(path):
        return f"{key}: '{path}' is a file, not a folder"
    target = probe = os.path.abspath(path)
    while not os.path.exists(probe):
        parent = os.path.dirname(probe)
        if parent == probe:
            break
        probe = parent
    if not os.path.isdir(probe):
        return f"{key}: cannot create '{path}': '{probe}' is a file"
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".nexrl-write-check-", dir=probe))
    except OSError as exc:
        reason = (exc.strerror or type(exc).__name__).lower()
        if probe == target:
            return f"{key}: cannot write to '{path}' ({reason})"
        return f"{key}: cannot create '{path}': '{probe}' does not take new folders ({reason})"
    return None


def earlier_run(run_dir: str, checkpoint_path: str | None = None) -> str:
    """What an earlier run left in ``run_dir`` (and its checkpoint folder), in words; '' when nothing."""
    from ..checkpoint import CHECKPOINT_RE, TMP_CHECKPOINT_RE

    found = []
    for name in (METRICS_FILE, ERRORS_FILE):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path) and os.path.getsize(path) > 0:
            found.append(name)
    if checkpoint_path and os.path.isdir(checkpoint_path):
        steps = [n for n in os.listdir(checkpoint_path) if CHECKPOINT_RE.match(n) or TMP_CHECKPOINT_RE.match(n)]
        if steps:
            found.append(f"{len(steps)} checkpoint folder{'s' if len(steps) != 1 else ''} in {checkpoint_path}")
    return ", ".join(found)


def prepare_run_dir(settings: RecipeSettings) -> list[str]:
    """A fresh run with ``overwrite_run_dir: true`` moves an earlier run aside (run_dir, and its
    checkpoint folder when that lies outside run_dir) to ``<path>.old-<time>``: never appended
    to, never deleted. Returns the paths it moved things to."""
    if settings.resume.mode != "disable" or not settings.overwrite_run_dir:
        return []
    run_dir, ckpt = settings.run_dir, settings.trainer.checkpoint_path or None
    if not earlier_run(run_dir, ckpt):
        return []
    stamp = time.strftime("%Y%m%d-%H%M%S")
    moved = []
    for path in [run_dir] + ([ckpt] if ckpt and not _inside(ckpt, run_dir) else []):
        if not os.path.exists(path):
            continue
        target = f"{os.path.normpath(path)}.old-{stamp}"
        n = 1
        while os.path.exists(target):
            target = f"{os.path.normpath(path)}.old-{stamp}-{n}"
            n += 1
        os.replace(path, target)
        moved.append(target)
        logger.warning(f"overwrite_run_dir: moved the earlier run's {path} to {target}")
    return moved


def _inside(path: str, folder: str) -> bool:
    path, folder = os.path.abspath(path), os.path.abspath(folder)
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)
