"""``nexrl run``: check the recipe, record the run, train with a progress display, and say at
the end where everything is and how to go on (resume, plot, export)."""

from __future__ import annotations

import json
import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING, Any

from ..errors import NexRLError, exit_code

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from ..config.schema import RecipeSettings

_RESUME_KEYS = ("resume.mode", "resume.resume_path", "overwrite_run_dir")


def override_key(text: str) -> str:
    """``trainer.save_freq`` of ``+trainer.save_freq=3`` / ``~trainer.save_freq``."""
    return text.lstrip("+~").split("=", 1)[0]


def run_command_line(recipe: str, overrides: list[str], drop: tuple[str, ...] = (), add: tuple[str, ...] = ()) -> str:
    """A ``nexrl run`` command line: the recipe and the overrides given, less those whose key is in
    ``drop``, plus ``add`` (shell-quoted, ready to paste; a secret shows as ``***``)."""
    from ..redaction import redact_command

    kept = [o for o in overrides if override_key(o) not in drop]
    return shlex.join(["nexrl", "run", recipe, *redact_command(kept), *add])


def _secret_note(overrides: list[str]) -> list[tuple[str, str]]:
    """A footer line when a command it shows hides a secret given on the command line."""
    from ..redaction import redact_command

    if redact_command(overrides) == list(overrides):
        return []
    return [("secrets", "shown as ***: give them again, or set them from the environment "
                        "('key=${oc.env:VARIABLE}') so no command line holds them")]


def resume_command(recipe: str, overrides: list[str]) -> str:
    return run_command_line(recipe, overrides, _RESUME_KEYS, ("resume.mode=auto",))


def continue_command(recipe: str, overrides: list[str], more: str) -> str:
    """Train a finished run further: resume with ``more`` (``key=value``: more steps or epochs)."""
    return run_command_line(recipe, overrides, _RESUME_KEYS + (override_key(more),), ("resume.mode=auto", more))


def _model(cfg: DictConfig) -> str:
    inference = cfg.service.inference_service.get("model_path")
    train = cfg.service.train_service.get("model_path")
    names = [str(m) for m in dict.fromkeys([train, inference]) if m]
    return " / ".join(names) if names else "(the inference backend's own)"


def header_lines(settings: RecipeSettings, cfg: DictConfig, recipe: str, overrides: list[str], pm: Any,
                 resume_from: str | None) -> list[tuple[str, str]]:
    """``cfg``: the recipe, for the model the services' own keys name."""
    from ..redaction import redact_command
    from ..runtime.run_info import versions

    v = versions(pm)
    plugins = ", ".join(f"{d} {ver}" for d, ver in sorted(v.get("plugins", {}).items())) or "none"
    evaluator = settings.rollout_worker.evaluator.type if settings.rollout_worker.evaluator is not None else "none"
    weight, trainer, pool = settings.weight, settings.trainer, settings.trajectory_pool
    epochs = trainer.num_train_epochs
    schedule = [f"{trainer.total_train_steps} steps of {pool.batch_size} samples "
                f"({pool.group_size} per prompt{f', {epochs:g} epochs' if epochs else ''})",
                f"{weight.sync_mode} mode"]
    if weight.validate_freq and settings.validate.data is not None:
        schedule.append(f"validate every {weight.validate_freq}")
    if trainer.save_freq:
        schedule.append(f"checkpoint every {trainer.save_freq}")
    elif trainer.save_final:
        schedule.append("checkpoint at the end")
    lines = [
        ("recipe", " ".join([recipe, *redact_command(overrides)])),
        ("run_dir", f"{settings.run_dir}  (config.yaml, run.json, metrics.jsonl, samples.jsonl, errors.jsonl, "
                    f"run.log)"),
        ("model", _model(cfg)),
        ("components", f"trainer {trainer.type} · inference {settings.service.inference_service.backend} · "
                       f"weight sync {weight.backend} · evaluator {evaluator} · data {settings.data.type}"),
        ("launch", f"{settings.launch_mode} · {settings.rollout_worker.num_workers} rollout workers · "
                   f"seed {settings.seed}"),
        ("schedule", " · ".join(schedule)),
        ("versions", f"nexrl-core {v.get('nexrl-core')} · plugins: {plugins}"),
        ("start", f"resuming from {resume_from}" if resume_from else "a fresh run"),
    ]
    return lines


class _Outcome:
    def __init__(self) -> None:
        self.status = "error"  # finished | signal | error | interrupted
        self.code = 1
        self.step: int | None = None
        self.error: str | None = None


def footer(settings: RecipeSettings, cfg: DictConfig, recipe: str, overrides: list[str], outcome: _Outcome,
           elapsed: str, plot: tuple[str | None, str | None],
           exportable: bool = False) -> tuple[str, list[tuple[str, str]]]:
    """The footer's title and lines; ``exportable``: the trainer implements ``export_checkpoint``."""
    from ..checkpoint import find_latest_checkpoint
    from ..launch.preflight import keeps_no_checkpoint, train_on_override
    from ..runtime.run_log import ERRORS_FILE, METRICS_FILE, SAMPLES_FILE

    run_dir = settings.run_dir
    total = settings.trainer.total_train_steps
    step = outcome.step if outcome.step is not None else 0
    if outcome.status == "finished":
        title = f"finished: {step}/{total} steps in {elapsed}"
    elif outcome.status in ("signal", "interrupted"):
        title = f"stopped at step {step}/{total} after {elapsed}"
    else:  # the error itself follows (the `error:` line, or a bug's traceback): said once
        title = f"failed at step {step}/{total} after {elapsed}"
    root = settings.trainer.checkpoint_path
    latest = find_latest_checkpoint(root) if root else None
    lines: list[tuple[str, str]] = []
    if root and latest:
        count = sum(1 for n in os.listdir(root) if n.startswith("global_step_"))
        lines.append(("checkpoints", f"{latest}  ({count} in {root})"))
    else:
        lines.append(("checkpoints", "none saved (trainer.save_freq: 0, trainer.save_final: false)"
                      if keeps_no_checkpoint(cfg) else "none saved yet"))
    files = [os.path.join(run_dir, METRICS_FILE)]
    for name in (SAMPLES_FILE, ERRORS_FILE):
        path = os.path.join(run_dir, name)
        if os.path.isfile(path) and os.path.getsize(path):
            files.append(path if name != ERRORS_FILE else f"{path} ({_count_lines(path)} failed items)")
    lines.append(("metrics", " · ".join(files)))
    lines.append(("log", os.path.join(run_dir, "run.log")))
    plot_path, plot_problem = plot
    lines.append(("plot", plot_path or plot_problem or "not written"))
    has_samples = os.path.isfile(os.path.join(run_dir, SAMPLES_FILE))
    if has_samples:
        lines.append(("samples", shlex.join(["nexrl", "show", run_dir])))
    if plot_path or has_samples:  # else the report would have nothing to show
        lines.append(("report", shlex.join(["nexrl", "report", run_dir])))
    if latest and exportable:
        lines.append(("export", shlex.join(["nexrl", "export", latest, os.path.join(run_dir, "model")])))
    if outcome.status == "finished":
        if latest:
            lines.append(("train on", continue_command(recipe, overrides, train_on_override(cfg))))
    elif outcome.code != 2:
        lines.append(("resume", resume_command(recipe, overrides) if latest else
                      "no checkpoint to resume from: a rerun starts at step 0 (set trainer.save_freq, or "
                      "trainer.save_on_stop=true to save when stopped)"))
    if outcome.code != 2 and (latest or outcome.status != "finished"):
        lines += _secret_note(overrides)
    return title, lines


def _count_lines(path: str) -> int:
    with open(path, "rb") as f:
        return sum(1 for line in f if line.strip())


def stop_notice(settings: RecipeSettings, recipe: str, overrides: list[str], signame: str) -> str:
    """What a Ctrl-C (SIGINT) or SIGTERM is acknowledged with, at once."""
    from ..checkpoint import find_latest_checkpoint

    root = settings.trainer.checkpoint_path
    latest = find_latest_checkpoint(root) if root else None
    if settings.trainer.save_on_stop:
        then = "then saving a checkpoint (trainer.save_on_stop)"
    elif latest:
        then = f"the newest checkpoint is {os.path.basename(latest)}"
    else:
        then = "no checkpoint has been saved (trainer.save_freq, trainer.save_on_stop), so a rerun starts at step 0"
    return (f"{signame} received: stopping after the work in flight; {then}.\n"
            f"  resume with: {resume_command(recipe, overrides)}")


def run_command(args: Any) -> int:
    from ..api import run_started
    from ..config.schema import RecipeSettings
    from ..controller import RunFailed
    from ..launch.preflight import component_notes, require_runnable, resume_checkpoint, unkept_weights_warning
    from ..launch.prologue import start_run
    from ..launch.ray import network
    from ..launch.recipe import load_recipe, network_plan
    from ..plugins import get_plugin_manager
    from .progress import RunProgress, choose_mode, format_duration

    # nexrl's own display reports progress: Hugging Face's per-file bars (read before transformers is
    # imported) would break the live display and fill CI logs; HF_HUB_DISABLE_PROGRESS_BARS=0 keeps them
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    recipe, overrides = args.recipe, list(args.overrides)
    cfg = load_recipe(recipe, overrides)
    pm = get_plugin_manager()
    require_runnable(cfg, pm)  # before anything is written to run_dir
    unkept = unkept_weights_warning(cfg, pm)
    if unkept:
        print(f"warning: {unkept}", file=sys.stderr)  # as nexrl validate says it
    for note in component_notes(cfg, pm):
        print(f"note: {note}", file=sys.stderr)
    if network_plan(cfg, pm).private and not network.inside():  # the whole run, Ray's driver included
        return network.rerun_inside(["run", recipe, *overrides])
    settings = RecipeSettings.of(cfg)  # the run's one reading of its checked recipe (start_run takes it)
    resume_from = resume_checkpoint(cfg)
    start_step = _checkpoint_global_step(resume_from)
    mode = choose_mode(settings.logger.progress, sys.stderr)
    progress = RunProgress(mode, settings.trainer.total_train_steps, start_step)
    started = start_run(cfg, pm, recipe, overrides, console=progress.log_sink if mode == "rich" else None,
                        hide_step_lines=mode != "off", checked=settings)
    run_dir, record = started.run_dir, started.record
    progress.print_block(f"nexrl run · {settings.experiment_name}",
                         header_lines(settings, cfg, recipe, overrides, pm, resume_from))
    outcome = _Outcome()
    controller: Any = None

    interrupted: list[int] = []  # signals while the run was being built (or waiting to restart)

    def interrupt(signum: int, _frame: Any) -> None:
        # while the run is being built: nothing to drain yet (exit 130). The first signal stops the
        # build, which then releases what it started (its actors, a cluster it started: seconds);
        # a second is acknowledged, a third stops at once (run.json is written either way).
        name = signal.Signals(signum).name
        interrupted.append(signum)
        if len(interrupted) == 1:
            progress.notice(stop_notice(started.settings, recipe, overrides, name))
        elif len(interrupted) == 2:
            progress.notice(f"{name} again: still releasing the run's actors (once more to stop at once)")
            return
        raise KeyboardInterrupt

    def finishing(signum: int, _frame: Any) -> None:
        # the run is over: run.json and the footer are being written (a moment); not left half done
        progress.notice(f"{signal.Signals(signum).name}: the run has stopped; writing its records")

    def on_signal(signum: int, _frame: Any) -> None:
        # SIGINT/SIGTERM: stop cleanly (workers drained, trainer.save_on_stop honoured), exit 130
        name = signal.Signals(signum).name
        if controller.stop_requested():
            progress.notice(f"{name} again: still stopping (waiting up to runtime_monitor.stop_timeout="
                            f"{started.settings.runtime_monitor.stop_timeout}s for the work in flight)")
        else:
            progress.notice(stop_notice(started.settings, recipe, overrides, name))
        controller.request_stop(name)

    def running(built: Any) -> None:
        nonlocal controller
        controller = built
        signal.signal(signal.SIGINT, on_signal)
        signal.signal(signal.SIGTERM, on_signal)
        progress.start("running")  # once built: model loading prints its own progress bars

    def restarting(error: str, delay: float) -> None:
        signal.signal(signal.SIGINT, interrupt)  # a signal while waiting to restart ends the run
        signal.signal(signal.SIGTERM, interrupt)
        progress.notice(f"{started.restarts.describe()}: {error}\n  restarting from the newest checkpoint in "
                        f"{delay:g}s (resume.on_failure: restart)")

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    summary = None
    try:
        summary = run_started(started, [progress], on_controller=running, on_restart=restarting)
        outcome.status, outcome.step = summary.stopped_by, summary.global_step
        outcome.code = 130 if summary.stopped_by == "signal" else 0
    except RunFailed as exc:
        outcome.error, outcome.code = str(exc), exit_code(exc)
        outcome.step = started.final_step(start_step)
        raise
    except NexRLError as exc:
        outcome.error, outcome.code = str(exc), exit_code(exc)
        raise
    except KeyboardInterrupt:
        outcome.status, outcome.code = "interrupted", 130
        raise
    except Exception as exc:  # a bug: its traceback follows; the footer and run.json still say what happened
        outcome.error = f"{type(exc).__name__}: {exc}"
        raise
    finally:
        signal.signal(signal.SIGINT, finishing)
        signal.signal(signal.SIGTERM, finishing)
        try:
            progress.close()
            if outcome.step is None:
                outcome.step = progress.stats.step
            elapsed = format_duration(record.elapsed())
        finally:  # first: a run.json left saying "running" would describe a run that is over
            record.finish(outcome.status, outcome.code, outcome.step, outcome.error)
        try:
            plot = _plot(run_dir) if outcome.code != 2 else (None, None)
            title, lines = footer(started.settings, cfg, recipe, overrides, outcome, elapsed, plot,
                                  _exportable(pm, settings.trainer.type))
            progress.print_block(title, lines)
        finally:
            signal.signal(signal.SIGINT, signal.default_int_handler)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print(json.dumps({"global_step": summary.global_step, "stopped_by": summary.stopped_by,
                      "run_dir": run_dir, "validation": summary.validation}, default=float))
    return outcome.code


def _exportable(pm: Any, trainer: str) -> bool:
    from ..trainer import BaseTrainer

    cls = pm.components("trainer").get(trainer)
    own = getattr(getattr(cls, "cls", None), "export_checkpoint", None)
    base = vars(BaseTrainer)["export_checkpoint"].__func__  # the classmethod's function
    return own is not None and getattr(own, "__func__", None) is not base


def _checkpoint_global_step(path: str | None) -> int:
    if not path:
        return 0
    from ..checkpoint import read_core_state

    return int(read_core_state(path)["global_step"])


def _plot(run_dir: str) -> tuple[str | None, str | None]:
    """metrics.png at the end of a run: (path, None), or (None, why not). Never raises."""
    from .plot import PLOT_FILE, MissingMatplotlib, plot_run

    try:
        return plot_run(run_dir, os.path.join(run_dir, PLOT_FILE)), None
    except MissingMatplotlib as exc:
        return None, str(exc)
    except Exception as exc:  # a plot must never turn a finished run into a failed one
        return None, f"not written: {type(exc).__name__}: {exc}"
