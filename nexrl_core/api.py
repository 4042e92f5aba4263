"""``nexrl_core.run(config)``: the controller as a library call, with what ``nexrl run`` does
around it (the core defaults, the checks of ``nexrl validate``, run.log and the run's records).

.. code-block:: python

    import nexrl_core

    summary = nexrl_core.run("recipes/quickstart.yaml", ["trainer.total_train_steps=2"])
    summary = nexrl_core.run({"data": {"type": "arithmetic"}, "trainer": {"type": "mock"}, ...})
    print(summary.global_step, summary.validation)

No signal handler, live display or footer: those are the command line's.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import Any

#: where a recipe given as a mapping is placed (its relative paths resolve against the current folder)
LIBRARY_RECIPE = "<nexrl_core.run>.yaml"


def run(config: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = (), *,
        plugin_manager: Any = None, listeners: Sequence[Any] = ()) -> Any:
    """Run a recipe to its end and return its :class:`~nexrl_core.RunSummary`.

    ``config``: a recipe file, or the recipe itself as a mapping (a dict or an OmegaConf
    DictConfig, as a Hydra ``main`` receives it). ``overrides``: ``key=value`` strings, as on the
    command line. A bad recipe raises :class:`~nexrl_core.ConfigError` listing every problem
    ``nexrl validate`` reports; a failed run raises :class:`~nexrl_core.RunFailed`. The run
    directory gets the same files as with ``nexrl run`` (metrics.jsonl, run.log, run.json, ...)."""
    from .controller import NexRLController
    from .errors import NexRLError, exit_code
    from .launch.preflight import require_runnable
    from .launch.recipe import load_recipe
    from .plugins import get_plugin_manager
    from .runtime.run_info import RunRecord, write_config
    from .runtime.run_log import prepare_run_dir, setup_logging

    if isinstance(config, Mapping):
        from omegaconf import DictConfig, OmegaConf

        raw = OmegaConf.to_container(config, resolve=False) if isinstance(config, DictConfig) else dict(config)
        recipe, cfg = LIBRARY_RECIPE, load_recipe(os.path.join(os.getcwd(), LIBRARY_RECIPE), list(overrides), raw=raw)
    else:
        recipe = os.fspath(config)
        cfg = load_recipe(recipe, list(overrides))
    pm = plugin_manager or get_plugin_manager()
    require_runnable(cfg, pm)  # before anything is written to run_dir
    prepare_run_dir(cfg)
    run_dir = str(cfg.run_dir)
    setup_logging(run_dir, str(cfg.logger.level), fresh=cfg.resume.mode == "disable")
    record = RunRecord(run_dir, recipe, list(overrides), argv=[f"nexrl_core.run({recipe})", *overrides],
                       plugin_manager=pm, config=cfg)
    record.write_start(keep_previous=cfg.resume.mode != "disable")
    write_config(run_dir, cfg)
    controller: Any = None
    try:
        controller = NexRLController(cfg, pm, listeners=list(listeners))
        summary = controller.run()
    except BaseException as exc:
        message = str(exc) if isinstance(exc, NexRLError) else f"{type(exc).__name__}: {exc}"
        record.finish("failed", exit_code(exc), controller.final_step() if controller is not None else None, message)
        raise
    record.finish(summary.stopped_by, 0, summary.global_step, None)
    return summary
