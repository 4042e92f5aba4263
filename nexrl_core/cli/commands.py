"""The `nexrl` command: run, validate, config, eval, plot, show, report, export, plugins, new, migrate.

Exit codes: 0 success; 2 bad input (a recipe, override, data file or plugin problem: nothing
ran), the same lines from ``validate`` and ``run``; 1 a run or evaluation that failed (a server
that does not start included); 130 interrupted; 141 the reader of stdout went away (``| head``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from ..errors import ConfigError, NexRLError, exit_code

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from ..config.schema import FailedSamplesSettings

EVAL_FILES = ("metrics.json", "samples.jsonl", "errors.jsonl", "eval.log", "eval.json")
_SIGPIPE_EXIT = 141  # what a shell reports for a command killed by SIGPIPE

OVERRIDE_HELP = """\
overrides (Hydra syntax, any number, before or after the options):
  key.sub=value        set an existing key         trainer.total_train_steps=50
  +key.sub=value       add a key the recipe lacks  +rollout_worker.evaluator.format_reward=0.1
  ~key.sub             delete a key                ~validate.data
  key=[a,b]  key={a: 1}  lists and mappings; quote values with spaces: 'experiment_name="my run"'
  group=option         choose a config group's option   weight=fully_async (weight/fully_async.yaml)
Relative paths written in a recipe are relative to the recipe's folder; paths given here, to
the current folder."""


class _Failed(NexRLError):
    """A run or evaluation that started and failed (exit 1)."""


def version_text() -> str:
    """``nexrl --version``: nexrl-core and every installed plugin distribution (read from metadata)."""
    import importlib.metadata as md

    from ..runtime.run_info import _version

    lines = [f"nexrl-core {_version('nexrl-core') or 'unknown'}"]
    seen = set()
    for ep in md.entry_points(group="nexrl"):
        dist = ep.dist.name if ep.dist is not None else ep.value.split(".")[0]
        if dist in seen or dist == "nexrl-core":
            continue
        seen.add(dist)
        lines.append(f"  {dist} {ep.dist.version if ep.dist is not None else '?'}")
    lines.append(f"  python {sys.version.split()[0]}")
    return "\n".join(lines)


class _VersionAction(argparse.Action):
    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any):
        super().__init__(option_strings, dest, nargs=0, help="print nexrl-core's and the plugins' versions")

    def __call__(self, parser: Any, namespace: Any, values: Any, option_string: str | None = None) -> None:
        print(version_text())
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    fmt = argparse.RawDescriptionHelpFormatter
    parser = argparse.ArgumentParser(prog="nexrl", description="nexrl: reinforcement learning for LLMs",
                                     epilog=OVERRIDE_HELP, formatter_class=fmt)
    parser.add_argument("--version", "-V", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def recipe_command(name: str, help_text: str, overrides_help: str = "key=value overrides") -> Any:
        p = sub.add_parser(name, help=help_text, description=help_text, epilog=OVERRIDE_HELP, formatter_class=fmt)
        p.add_argument("recipe", help="the recipe YAML file")
        p.add_argument("overrides", nargs="*", default=[], metavar="key=value", help=overrides_help)
        return p

    recipe_command("run", "train with a recipe")
    recipe_command("validate", "resolve a recipe and every component, run nothing; exit 0, or 2 and each problem")
    p_config = recipe_command("config", "print the resolved recipe (defaults, recipe and overrides merged; "
                                        "secrets redacted) as YAML")
    p_config.add_argument("--no-check", action="store_true", help="print even when the recipe has problems")
    p_config.add_argument("--sources", action="store_true",
                          help="mark each value with where it came from: default, recipe FILE or override")
    p_eval = recipe_command("eval", "evaluate a model (or checkpoint=PATH) on the recipe's validation set",
                            "key=value overrides; checkpoint=PATH evaluates a checkpoint")
    p_eval.add_argument("--samples-out", help="write per-sample results to this JSONL file")
    p_eval.add_argument("--out", help="folder for this evaluation's outputs: metrics.json, samples.jsonl, "
                                      "errors.jsonl (failed samples), eval.log")
    p_plan = recipe_command("plan", "the run's memory per device before it starts (weights, gradients, optimizer "
                                    "state, activations, KV cache), whether it fits, and what to change when it "
                                    "does not; exit 0 fits, 1 does not")
    p_plan.add_argument("--device-memory", metavar="SIZE",
                        help="what each device has, e.g. 24GiB or 80GB (default: what the machine reports)")
    p_plan.add_argument("--json", action="store_true", help="print the plan as JSON (bytes per item and device)")
    p_plot = sub.add_parser("plot", help="draw a run's training reward and validation metrics to a PNG, or "
                                         "compare several runs",
                            description="draw RUN_DIR/metrics.jsonl (training reward, validation, loss) to a PNG; "
                                        "with several RUN_DIRs, one panel per metric with a line for each run "
                                        "(named by its folder), written to the first run's folder as "
                                        "comparison.png unless -o is given "
                                        "(needs matplotlib: pip install 'nexrl-core[plot]')")
    p_plot.add_argument("run_dir", nargs="+", metavar="RUN_DIR",
                        help="a run directory (run_dir in the recipe); several to compare them")
    p_plot.add_argument("--out", "-o", help="the PNG to write (default RUN_DIR/metrics.png; with several runs "
                                            "FIRST_RUN_DIR/comparison.png)")
    p_show = sub.add_parser("show", help="print a run's latest samples: prompt, reply, reward, advantage, log-prob gap",
                            description="print the samples a run recorded (RUN_DIR/samples.jsonl: the first and last "
                                        "training step and every logger.samples_every steps), or those of a "
                                        "`nexrl eval --out` folder: by default the newest step's")
    p_show.add_argument("run_dir", help="a run directory (run_dir in the recipe), an eval --out folder, or a "
                                        "samples.jsonl file")
    p_show.add_argument("--last", "-n", type=int, metavar="N", help="the N newest samples instead")
    p_report = sub.add_parser("report", help="write a run's metric plots and samples to one self-contained HTML page",
                              description="write RUN_DIR/metrics.jsonl's plots and a filterable table of "
                                          "RUN_DIR/samples.jsonl to one HTML file that fetches nothing (opens "
                                          "offline, can be mailed)")
    p_report.add_argument("run_dir", help="a run directory (run_dir in the recipe) or an eval --out folder")
    p_report.add_argument("--out", "-o", help="the HTML file to write (default RUN_DIR/report.html)")
    p_export = sub.add_parser("export", help="write a checkpoint's model (no optimizer state) to a new folder",
                              description="write the model of a global_step_<N> checkpoint to OUT for inference "
                                          "(transformers' from_pretrained), without optimizer or RNG state")
    p_export.add_argument("checkpoint", help="a global_step_<N> folder, or the folder holding them "
                                             "(trainer.checkpoint_path): its newest")
    p_export.add_argument("out", help="the folder to create")
    p_export.add_argument("--dtype", choices=("float32", "bfloat16", "float16"),
                          help="cast floating-point weights (default: as trained)")
    p_export.add_argument("--merged", action="store_true",
                          help="of a LoRA checkpoint: the model with the adapter merged in (default: the adapter, "
                               "in PEFT's format)")
    p_export.add_argument("--force", action="store_true", help="replace OUT if it exists")
    p_plugins = sub.add_parser("plugins", help="list installed plugins; 'plugins check NAME' checks one")
    p_plugins.add_argument("--json", action="store_true", help="print the list as JSON (with failed plugins and "
                                                                "bad registrations)")
    plugin_commands = p_plugins.add_subparsers(dest="plugins_command")
    p_check = plugin_commands.add_parser(
        "check", help="conformance check of a plugin's evaluators (and its components' option declarations)")
    p_check.add_argument("name", help="distribution (nexrl-rewards), entry-point name (rewards) or evaluator name")
    p_check.add_argument("options", nargs="*", help="key=value constructor options of the one evaluator NAME")
    p_check.add_argument("--json", action="store_true", dest="check_json", help="print the reports as JSON")
    p_migrate = sub.add_parser(
        "migrate", help="rewrite a NexRL (or ROLL) recipe as a nexrl recipe",
        description="rewrite a NexRL (or ROLL) recipe as a nexrl recipe: list what was carried over and each key "
                    "that was not (with the reason), each NexRL value nexrl refuses and the nearest one written "
                    "instead, the NexRL imports to change in the Python files it names, and check the result as "
                    "nexrl validate does: exit 0 when it passes up to what only the machine that runs it "
                    "supplies (data files, model folders, keys: listed), 2 when it does not. With -o NEW.yaml, "
                    "the folders beside the recipe whose Python files import NexRL (a NexAU agent_workspace/, "
                    "whole) are copied to NEW_workspace/ next to NEW.yaml with those imports rewritten, and the "
                    "new recipe names the copies; the originals are not changed (--force replaces a copy that "
                    "migrate wrote before). With --code DIR, "
                    "the NexRL imports of the Python files under DIR are rewritten as nexrl's, in place: shown as "
                    "a diff, applied with --write. The table it follows: docs/migrating.md")
    p_migrate.add_argument("recipe", nargs="?", help="the NexRL or ROLL recipe YAML")
    p_migrate.add_argument("-o", "--out", help="the nexrl recipe to write (default: print it); the workspace "
                                                     "copies go to OUT's folder as <OUT name>_workspace/")
    p_migrate.add_argument("--force", action="store_true", help="replace OUT (and the workspace copy migrate wrote "
                                                                "beside it) if it exists")
    p_migrate.add_argument("--code", metavar="DIR", help="rewrite the NexRL imports of the Python files under DIR "
                                                         "(a unified diff on stdout; no file changes without --write)")
    p_migrate.add_argument("--write", action="store_true", help="with --code: apply the rewrite to the files")
    p_new = sub.add_parser("new", help="scaffold a plugin package: nexrl new evaluator|worker|trainer|dataloader|"
                                       "weight-sync NAME")
    p_new.add_argument("kind", choices=["evaluator", "worker", "trainer", "dataloader", "weight-sync"],
                       help="what the plugin provides")
    p_new.add_argument("name", help="its registered name, e.g. length_penalty (package nexrl-KIND-NAME)")
    p_new.add_argument("--dir", default=".", help="folder to create the package in (default: here)")
    p_new.add_argument("--license", default="Apache-2.0", help="SPDX license expression (default: Apache-2.0)")
    return parser


_INTERMIXED = ("run", "validate", "config", "eval", "plot", "export")
_RECIPE_COMMANDS = ("run", "validate", "config", "eval")


def parse_args(argv: list[str]) -> argparse.Namespace:
    """Options may come before, between or after a command's overrides."""
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    if argv and argv[0] in _RECIPE_COMMANDS and len(argv) == 1:
        sub.choices[argv[0]].error(f"a recipe is required: nexrl {argv[0]} RECIPE.yaml [key=value ...] "
                                   f"(e.g. recipes/quickstart.yaml)")
    if argv and not argv[0].startswith("-") and argv[0] not in sub.choices:
        import difflib

        near = difflib.get_close_matches(argv[0], list(sub.choices), n=1)
        hint = f"; did you mean '{near[0]}'?" if near else ""
        parser.error(f"unknown command '{argv[0]}'{hint} (commands: {', '.join(sub.choices)})")
    if argv and argv[0] in _INTERMIXED:  # commands with key=value overrides
        args = sub.choices[argv[0]].parse_intermixed_args(argv[1:])
        args.command = argv[0]
        return args
    return parser.parse_args(argv)  # --help, --version, a missing or unknown command


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        code = _main(argv)
        sys.stdout.flush()  # here, so a closed pipe is caught below and not at interpreter exit
        return code
    except BrokenPipeError:
        # ``nexrl plugins | head``: the reader has what it wanted; no traceback, no flush error at exit
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return _SIGPIPE_EXIT
    except Exception:  # a bug: its traceback, as Python prints it, less the secrets it may quote
        import traceback

        from ..redaction import scrub

        sys.stderr.write(scrub(traceback.format_exc()))
        return 1


def _main(argv: list[str]) -> int:
    args = parse_args(argv)
    if args.command not in ("plugins", "config", "new", "migrate", "show", "report"):
        from ..runtime.run_log import setup_logging

        setup_logging(None, "INFO")  # plugin-loading warnings in the same short format as the run's
    commands = {"run": _run, "validate": _validate, "config": _config, "eval": _eval, "plan": _plan, "plot": _plot,
                "show": _show, "report": _report, "export": _export, "plugins": _plugins, "new": _new, "migrate": _migrate}
    try:
        return commands[args.command](args)
    except NexRLError as exc:
        _print_problems(getattr(exc, "problems", None) or [str(exc)])
        return exit_code(exc)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _print_problems(problems: list[str]) -> None:
    from ..redaction import scrub

    for problem in problems:
        print(scrub(f"error: {problem}"), file=sys.stderr)


def _load(args: Any, sources: dict[str, str] | None = None) -> Any:
    from ..launch.recipe import load_recipe

    return load_recipe(args.recipe, list(args.overrides), sources=sources)


def _plan(args: Any) -> int:
    from .plan import plan_command

    return plan_command(args)


def _run(args: Any) -> int:
    from .run import run_command

    return run_command(args)


def _validate(args: Any) -> int:
    from ..launch.preflight import validate_recipe
    from ..plugins import get_plugin_manager

    cfg = _load(args)
    problems = validate_recipe(cfg, get_plugin_manager())
    if problems:
        _print_problems(problems)
        return 2
    from ..config.schema import RecipeSettings
    from ..launch import unused_launch_keys_note
    from ..launch.preflight import run_dir_plan, unkept_weights_warning

    settings = RecipeSettings.of(cfg)  # the recipe passed its checks: read as a run reads it
    for warning in (unused_launch_keys_note(settings), unkept_weights_warning(cfg, get_plugin_manager())):
        if warning:
            print(f"warning: {warning}", file=sys.stderr)  # as `nexrl run` says it
    from ..launch.recipe import network_plan

    if network_plan(cfg, get_plugin_manager()).private:
        print("note: ray: the run and its local cluster will run in a private network namespace (loopback only)",
              file=sys.stderr)
    plan = run_dir_plan(cfg)
    if plan:
        print(f"note: {plan}", file=sys.stderr)
    from ..launch.preflight import component_notes

    for note in component_notes(cfg, get_plugin_manager()):
        print(f"note: {note}", file=sys.stderr)
    epochs = cfg.trainer.get("num_train_epochs")
    if epochs is not None:  # check_files set the steps they give
        print(f"note: trainer.num_train_epochs={epochs:g}: {cfg.trainer.total_train_steps} training steps",
              file=sys.stderr)
    print(f"{args.recipe}: ok")
    return 0


def _config(args: Any) -> int:
    from ..launch.recipe import check_config
    from ..plugins import get_plugin_manager
    from ..runtime.run_info import redacted_yaml

    sources: dict[str, str] = {}
    cfg = _load(args, sources=sources)
    problems = check_config(cfg, get_plugin_manager())  # --no-check too: it learns which options are secret
    if problems and not args.no_check:
        _print_problems(problems + ["(nexrl config --no-check prints the recipe anyway)"])
        return 2
    sys.stdout.write(sourced_yaml(cfg, sources) if args.sources else redacted_yaml(cfg))
    return 0


def sourced_yaml(config: Mapping[str, Any], sources: Mapping[str, str]) -> str:
    """The resolved recipe as YAML with each value's origin as a trailing comment (``# default``,
    ``# recipe FILE``, ``# override 'key=value'``; see :func:`nexrl_core.launch.recipe.load_recipe`):
    still a recipe ``nexrl run`` accepts."""
    from ..launch.recipe import source_of
    from ..redaction import redact
    from ..runtime.run_info import plain_config

    lines: list[str] = []

    def walk(values: dict[str, Any], prefix: str, indent: str) -> None:
        for key, value in values.items():
            dotted = f"{prefix}.{key}" if prefix else str(key)
            if isinstance(value, dict) and value:
                lines.append(f"{indent}{_flow(key)}:")
                walk(value, dotted, indent + "  ")
            else:
                lines.append(f"{indent}{_flow(key)}: {_flow(value)}  # {source_of(sources, dotted)}")

    walk(redact(plain_config(config)), "", "")
    return "\n".join(lines) + "\n"


def _flow(value: Any) -> str:
    import yaml

    text = yaml.safe_dump(value, default_flow_style=True, width=1 << 20, allow_unicode=True).strip()
    return text.removesuffix("\n...").removesuffix("...").strip()


def _plot(args: Any) -> int:
    from .plot import comparison_out, plot_run, plot_runs

    if len(args.run_dir) > 1:
        out = plot_runs(args.run_dir, args.out)
        if args.out is None:
            print(f"note: {len(args.run_dir)} runs compared in {comparison_out(args.run_dir)} (the first run's "
                  f"folder; -o FILE.png to write it elsewhere)", file=sys.stderr)
        print(out)
        return 0
    run_dir = args.run_dir[0]
    if not os.path.isdir(run_dir):
        raise ConfigError(f"{run_dir}: no such run directory")
    print(plot_run(run_dir, args.out))
    return 0


def _show(args: Any) -> int:
    from .show import show

    if args.last is not None and args.last < 1:
        raise ConfigError(f"--last: {args.last}: give a number of samples >= 1")
    print(show(args.run_dir, args.last))
    return 0


def _report(args: Any) -> int:
    from .report import write_report

    print(write_report(args.run_dir, args.out))
    return 0


def _export(args: Any) -> int:
    from ..plugins import get_plugin_manager
    from .export import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, get_plugin_manager(), dtype=args.dtype, force=args.force,
                            merged=args.merged)
    print(out)
    return 0


def _eval(args: Any) -> int:
    from ..controller import NexRLController
    from ..redaction import scrub_values
    from ..runtime.execute import execute
    from ..runtime.run_log import setup_logging

    overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
    checkpoint = [o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")]
    if checkpoint:
        # ++: set or add (a backend whose recipe names no model_path, e.g. tinker, takes one too)
        overrides.append(f"++service.inference_service.model_path={checkpoint[-1]}")
    cfg = _load(argparse.Namespace(recipe=args.recipe, overrides=overrides))
    setup_logging(None, "WARNING")
    out = args.out
    samples_out = args.samples_out or (os.path.join(out, "samples.jsonl") if out else None)
    if args.samples_out:  # before any model is loaded: a file that cannot be written is known now
        _check_samples_out(args.samples_out)
    if out is not None:
        _prepare_eval_out(out, str(cfg.run_dir))
        setup_logging(out, "WARNING", fresh=True, log_file="eval.log")
    model = checkpoint[-1] if checkpoint else _served_model(cfg)
    print(f"eval: {args.recipe}: scoring validate.data with {model}", file=sys.stderr)  # stdout holds the JSON
    started = time.monotonic()
    controller = NexRLController(cfg, eval_only=True, eval_out=out)
    if checkpoint:
        # global_step_<N> holds weight version N: serve it as N, so samples carry the version that
        # produced them and seeded sampling matches the training-time validation of step N.
        from ..checkpoint import checkpoint_step

        step = checkpoint_step(checkpoint[-1])
        if step is not None:
            execute(controller.inference_client.set_model_version, step)
    metrics = controller.run_evaluation()
    fields = ("uid", "sample_index", "data_source", "domain", "prompt", "response", "reward", "score", "failed",
              "error", "model_version")
    samples = [{**{k: traj.get(k) for k in fields}, "failed": bool(traj.get("failed"))}
               for traj in controller.evaluation_samples]
    if samples_out:
        os.makedirs(os.path.dirname(os.path.abspath(samples_out)), exist_ok=True)
        with open(samples_out, "w", encoding="utf-8") as f:
            for row in samples:
                f.write(json.dumps(scrub_values(json.loads(json.dumps(row, default=str)))) + "\n")
    seconds = time.monotonic() - started
    print(f"eval: {len(samples)} samples scored in {seconds:.1f} s", file=sys.stderr)
    if out:
        with open(os.path.join(out, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, sort_keys=True, indent=1)
        with open(os.path.join(out, "eval.json"), "w", encoding="utf-8") as f:  # what was scored, and how
            json.dump({"recipe": os.path.abspath(args.recipe), "model": model,
                       "checkpoint": os.path.abspath(checkpoint[-1]) if checkpoint else None,
                       "overrides": [scrub_values(o) for o in overrides], "num_samples": len(samples),
                       "seconds": round(seconds, 3), "finished_at": time.strftime("%Y-%m-%dT%H:%M:%S%z")}, f,
                      indent=1)
    print(json.dumps(metrics, sort_keys=True))
    failures = [(str(t.get("error_cause") or "failed"), str(t.get("error") or ""))
                for t in controller.evaluation_samples if t.get("failed")]
    problem = _eval_problem(controller.settings.runtime_monitor.failed_samples, len(samples),
                            int(metrics.get("val/num_missing", 0)), failures)
    if problem:
        raise _Failed(problem)
    return 0


def _served_model(cfg: DictConfig) -> str:
    """What an evaluation's inference service serves, in words: its model path, else its backend."""
    section = cfg.service.inference_service
    return str(section.get("model_path") or section.get("model") or f"the {section.get('backend')} backend")


def _eval_problem(failed_samples: FailedSamplesSettings, total: int, missing: int,
                  failures: list[tuple[str, str]]) -> str | None:
    """Why an evaluation does not count (exit 1): samples are missing, or more of them failed than
    a training run accepts (``runtime_monitor.failed_samples``, the same threshold)."""
    from ..runtime.failure_monitor import most_common_error

    common = f"; most common error: {most_common_error(failures)}" if failures else ""
    if missing:
        return (f"{missing} of {total + missing} expected samples are missing (validate.data rows x "
                f"validate.n_samples): a rollout worker lost them; the metrics cover only the others")
    if not total or len(failures) == total:
        return f"no sample could be scored: {len(failures)} of {total} failed{common}"
    if failed_samples.enabled and len(failures) > failed_samples.max_fraction * total:
        return (f"{len(failures)} of {total} samples failed (more than runtime_monitor.failed_samples.max_fraction="
                f"{failed_samples.max_fraction:g}){common}")
    return None


def _check_samples_out(path: str) -> None:
    from ..launch.preflight import writable_dir_problem

    if os.path.isdir(path):
        raise ConfigError(f"--samples-out: '{path}' is a folder; give a file name "
                          f"(e.g. {os.path.join(path, 'samples.jsonl')})")
    problem = writable_dir_problem(os.path.dirname(os.path.abspath(path)), "--samples-out")
    if problem:
        raise ConfigError(problem)


def _prepare_eval_out(out: str, run_dir: str) -> None:
    from ..launch.preflight import writable_dir_problem

    problem = writable_dir_problem(out, "--out")
    if problem:
        raise ConfigError(problem)
    if os.path.abspath(out) == os.path.abspath(run_dir):
        raise ConfigError(f"--out: '{out}' is the training run's run_dir; give the evaluation its own folder "
                          f"(e.g. {os.path.join(run_dir, 'eval')})")
    os.makedirs(out, exist_ok=True)
    for name in EVAL_FILES:  # this evaluation's outputs replace the previous evaluation's
        path = os.path.join(out, name)
        if os.path.isfile(path):
            os.remove(path)


def _plugins(args: Any) -> int:
    from ..plugins import get_plugin_manager

    if getattr(args, "plugins_command", None) == "check":
        return _plugins_check(args)
    pm = get_plugin_manager()
    info = pm.describe()
    failures = [{"name": f.name, "distribution": f.distribution, "error": f.error} for f in pm.failures]
    if args.json:
        print(json.dumps({"plugins": info, "failed": failures, "bad_registrations": pm.bad_registrations}, indent=2))
        return 0
    for p in info:
        print(f"{p['distribution']} {p['version']} (plugin '{p['name']}')")
        print(f"  hooks: {', '.join(p['hooks'])}")
        for kind, names in p["components"].items():
            print(f"  {kind}: {', '.join(names)}")
    for f in failures:
        print(f"FAILED {f['distribution']} (plugin '{f['name']}'): {f['error']}")
    for message in pm.bad_registrations:
        print(f"BAD {message}")
    return 0


def _new(args: Any) -> int:
    from ..plugins import get_plugin_manager
    from .scaffold import KINDS, names, new_plugin

    spec = KINDS[args.kind]
    names(args.name, args.kind)  # a bad NAME fails before the plugins load
    root = new_plugin(args.kind, args.name, args.dir, args.license,
                      set(get_plugin_manager().components(spec.component)))
    n = names(args.name, args.kind)
    print(f"created {root}/ ({n['dist']}: {spec.words} '{n['name']}', class {n['cls']} in {n['package']}/plugin.py)\n"
          f"next:\n  cd {root}\n  pip install -e '.[test]'\n  pytest\n  nexrl run recipe.yaml")
    return 0


def _migrate(args: Any) -> int:
    from .migrate import command

    return command(args)


def _plugins_check(args: Any) -> int:
    from ..testing.conformance import check_plugin

    reports = check_plugin(args.name, options=_key_values(args.options))
    if args.check_json:
        print(json.dumps([r.to_dict() for r in reports], indent=2))
    else:
        print("\n".join(r.text() for r in reports))
    return 1 if any(r.problems for r in reports) else 0


def _key_values(items: list[str]) -> dict[str, Any]:
    """``a=1 b.c=x`` -> ``{"a": 1, "b": {"c": "x"}}`` (values read as YAML)."""
    import yaml

    out: dict[str, Any] = {}
    for item in items:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"'{item}': options are key=value")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            raise ConfigError(f"'{item}': the value is not YAML ({str(exc).splitlines()[0]})") from None
        node = out
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


if __name__ == "__main__":
    sys.exit(main())
