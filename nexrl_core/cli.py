"""The `nexrl` command: run, validate, eval, plugins.

Exit codes: 0 success; 2 bad input (a recipe, override, data file or plugin problem: nothing
ran), the same lines from ``validate`` and ``run``; 1 a run or evaluation that failed (a server
that does not start included); 130 interrupted.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
from typing import Any

from .errors import ConfigError, DataError, NexRLError, PluginError

EVAL_FILES = ("metrics.json", "samples.jsonl", "errors.jsonl", "eval.log")


class _Failed(NexRLError):
    """A run or evaluation that started and failed (exit 1)."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nexrl", description="nexrl: reinforcement learning for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)
    p_run = sub.add_parser("run", help="train with a recipe")
    p_run.add_argument("recipe")
    p_run.add_argument("overrides", nargs="*", help="Hydra-style key=value overrides")
    p_val = sub.add_parser("validate", help="resolve a recipe and every component, run nothing")
    p_val.add_argument("recipe")
    p_val.add_argument("overrides", nargs="*")
    p_eval = sub.add_parser("eval", help="evaluate a model (or checkpoint=PATH) on the recipe's validation set")
    p_eval.add_argument("recipe")
    p_eval.add_argument("overrides", nargs="*", help="key=value overrides; checkpoint=PATH evaluates a checkpoint")
    p_eval.add_argument("--samples-out", help="write per-sample results to this JSONL file")
    p_eval.add_argument("--out", help="folder for this evaluation's outputs: metrics.json, samples.jsonl, "
                                      "errors.jsonl (failed samples), eval.log")
    p_plugins = sub.add_parser("plugins", help="list installed plugins; 'plugins check NAME' checks one")
    p_plugins.add_argument("--json", action="store_true")
    plugin_commands = p_plugins.add_subparsers(dest="plugins_command")
    p_check = plugin_commands.add_parser(
        "check", help="conformance check of a plugin's evaluators (and its components' option declarations)")
    p_check.add_argument("name", help="distribution (nexrl-rewards), entry-point name (rewards) or evaluator name")
    p_check.add_argument("options", nargs="*", help="key=value constructor options of the one evaluator NAME")
    p_check.add_argument("--json", action="store_true", dest="check_json")
    p_new = sub.add_parser("new", help="scaffold a plugin package: nexrl new evaluator NAME")
    p_new.add_argument("kind", choices=["evaluator"], help="what the plugin provides")
    p_new.add_argument("name", help="its registered name, e.g. length_penalty (package nexrl-evaluator-NAME)")
    p_new.add_argument("--dir", default=".", help="folder to create the package in (default: here)")
    p_new.add_argument("--license", default="Apache-2.0", help="SPDX license expression (default: Apache-2.0)")
    args = parser.parse_args(argv)
    if args.command not in ("plugins", "new"):
        from .run_log import setup_logging

        setup_logging(None, "INFO")  # plugin-loading warnings in the same short format as the run's
    try:
        return {"run": _run, "validate": _validate, "eval": _eval, "plugins": _plugins, "new": _new}[args.command](args)
    except NexRLError as exc:
        _print_problems(getattr(exc, "problems", None) or [str(exc)])
        return 2 if isinstance(exc, (ConfigError, DataError, PluginError)) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _print_problems(problems: list[str]) -> None:
    for problem in problems:
        print(f"error: {problem}", file=sys.stderr)


def _load(args: Any) -> Any:
    from .config import load_recipe

    return load_recipe(args.recipe, list(args.overrides))


def _run(args: Any) -> int:
    from .controller import NexRLController
    from .plugins import get_plugin_manager
    from .preflight import require_runnable
    from .run_log import prepare_run_dir, setup_logging

    cfg = _load(args)
    pm = get_plugin_manager()
    require_runnable(cfg, pm)  # before anything is written to run_dir
    prepare_run_dir(cfg)
    setup_logging(str(cfg.run_dir), str(cfg.logger.level), fresh=cfg.resume.mode == "disable")

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # while the run is being built: nothing to drain yet (exit 130)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    controller = NexRLController(cfg, pm)

    def on_signal(signum: int, _frame: Any) -> None:
        # SIGINT/SIGTERM: stop cleanly (workers drained, trainer.save_on_stop honoured), exit 130
        controller.request_stop(signal.Signals(signum).name)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    summary = controller.run()
    print(json.dumps({"global_step": summary.global_step, "stopped_by": summary.stopped_by,
                      "run_dir": str(cfg.run_dir), "validation": summary.validation}, default=float))
    return 130 if summary.stopped_by == "signal" else 0


def _validate(args: Any) -> int:
    from .plugins import get_plugin_manager
    from .preflight import validate_recipe

    cfg = _load(args)
    problems = validate_recipe(cfg, get_plugin_manager())
    if problems:
        _print_problems(problems)
        return 2
    print(f"{args.recipe}: ok")
    return 0


def _eval(args: Any) -> int:
    from .controller import NexRLController
    from .failure_monitor import most_common_error
    from .run_log import setup_logging
    from .runtime.execute import execute

    overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
    checkpoint = [o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")]
    if checkpoint:
        overrides.append(f"service.inference_service.model_path={checkpoint[-1]}")
    cfg = _load(argparse.Namespace(recipe=args.recipe, overrides=overrides))
    setup_logging(None, "WARNING")
    out = args.out
    if out is not None:
        _prepare_eval_out(out, str(cfg.run_dir))
        setup_logging(out, "WARNING", fresh=True, log_file="eval.log")
    controller = NexRLController(cfg, eval_only=True, eval_out=out)
    if checkpoint:
        # global_step_<N> holds weight version N: serve it as N, so samples carry the version that
        # produced them and seeded sampling matches the training-time validation of step N.
        from .checkpoint import checkpoint_step

        step = checkpoint_step(checkpoint[-1])
        if step is not None:
            execute(controller.inference_client.set_model_version, step)
    metrics = controller.run_evaluation()
    fields = ("uid", "sample_index", "data_source", "domain", "prompt", "response", "reward", "score", "failed",
              "error", "model_version")
    samples = [{k: traj.get(k) for k in fields}
               for traj in controller.evaluation_samples]
    samples_out = args.samples_out or (os.path.join(out, "samples.jsonl") if out else None)
    if samples_out:
        with open(samples_out, "w", encoding="utf-8") as f:
            for row in samples:
                f.write(json.dumps(row, default=str) + "\n")
    if out:
        with open(os.path.join(out, "metrics.json"), "w", encoding="utf-8") as f:
            json.dump(metrics, f, sort_keys=True, indent=1)
    print(json.dumps(metrics, sort_keys=True))
    failures = [(str(t.get("error_cause") or "failed"), str(t.get("error") or ""))
                for t in controller.evaluation_samples if t.get("failed")]
    if not samples or len(failures) == len(samples):
        raise _Failed(f"no sample could be scored: {len(failures)} of {len(samples)} failed"
                      f"{'; most common error: ' + most_common_error(failures) if failures else ''}")
    return 0


def _prepare_eval_out(out: str, run_dir: str) -> None:
    from .errors import ConfigError
    from .preflight import writable_dir_problem

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
    from .plugins import get_plugin_manager

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
    from .plugins import get_plugin_manager
    from .scaffold import new_evaluator, names

    names(args.name)  # a bad NAME fails before the plugins load
    root = new_evaluator(args.name, args.dir, args.license, set(get_plugin_manager().components("evaluator")))
    n = names(args.name)
    print(f"created {root}/ ({n['dist']}: evaluator '{n['name']}', class {n['cls']} in {n['package']}/plugin.py)\n"
          f"next:\n  cd {root}\n  pip install -e '.[test]'\n  pytest\n  nexrl run recipe.yaml")
    return 0


def _plugins_check(args: Any) -> int:
    from .testing.conformance import check_plugin

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
