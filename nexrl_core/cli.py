"""The `nexrl` command: run, validate, eval, plugins."""

from __future__ import annotations

import argparse
import json
import signal
import sys
from typing import Any

from .errors import NexRLError


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
    p_plugins = sub.add_parser("plugins", help="list installed plugins")
    p_plugins.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    try:
        return {"run": _run, "validate": _validate, "eval": _eval, "plugins": _plugins}[args.command](args)
    except NexRLError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2 if args.command in ("validate",) else 1
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


def _load(args: Any) -> Any:
    from .config import load_recipe

    return load_recipe(args.recipe, list(args.overrides))


def _run(args: Any) -> int:
    from .controller import NexRLController
    from .run_log import setup_logging

    cfg = _load(args)
    setup_logging(str(cfg.run_dir), str(cfg.logger.level))

    def interrupt(_signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt  # while the run is being built: nothing to drain yet (exit 130)

    signal.signal(signal.SIGINT, interrupt)
    signal.signal(signal.SIGTERM, interrupt)
    controller = NexRLController(cfg)

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
    from .config import check_config
    from .plugins import get_plugin_manager

    cfg = _load(args)
    problems = check_config(cfg, get_plugin_manager())
    if problems:
        for problem in problems:
            print(f"- {problem}", file=sys.stderr)
        return 2
    print(f"{args.recipe}: ok")
    return 0


def _eval(args: Any) -> int:
    from .controller import NexRLController
    from .run_log import setup_logging
    from .runtime.execute import execute

    overrides = [o for o in args.overrides if not o.startswith("checkpoint=")]
    checkpoint = [o.split("=", 1)[1] for o in args.overrides if o.startswith("checkpoint=")]
    if checkpoint:
        overrides.append(f"service.inference_service.model_path={checkpoint[-1]}")
    cfg = _load(argparse.Namespace(recipe=args.recipe, overrides=overrides))
    setup_logging(None, "WARNING")
    controller = NexRLController(cfg, eval_only=True)
    if checkpoint:
        # global_step_<N> holds weight version N: serve it as N, so samples carry the version that
        # produced them and seeded sampling matches the training-time validation of step N.
        from .checkpoint import checkpoint_step

        step = checkpoint_step(checkpoint[-1])
        if step is not None:
            execute(controller.inference_client.set_model_version, step)
    metrics = controller.run_evaluation()
    if args.samples_out:
        with open(args.samples_out, "w", encoding="utf-8") as f:
            for traj in controller.evaluation_samples:
                f.write(json.dumps({k: traj.get(k) for k in ("uid", "sample_index", "data_source", "prompt",
                                                            "response", "reward", "score", "failed", "error",
                                                            "model_version")}, default=str) + "\n")
    print(json.dumps(metrics, sort_keys=True))
    return 0


def _plugins(args: Any) -> int:
    from .plugins import get_plugin_manager

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


if __name__ == "__main__":
    sys.exit(main())
