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
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .launch.prologue import StartedRun


def run(config: str | os.PathLike[str] | Mapping[str, Any], overrides: Sequence[str] = (), *,
        plugin_manager: Any = None, listeners: Sequence[Any] = ()) -> Any:
    """Run a recipe to its end and return its :class:`~nexrl_core.RunSummary`.

    ``config``: a recipe file, or the recipe itself as a mapping (a dict or an OmegaConf
    DictConfig, as a Hydra ``main`` receives it). ``overrides``: ``key=value`` strings, as on the
    command line. A bad recipe raises :class:`~nexrl_core.ConfigError` listing every problem
    ``nexrl validate`` reports; a failed run raises :class:`~nexrl_core.RunFailed`. The run
    directory gets the same files as with ``nexrl run`` (metrics.jsonl, run.log, run.json, ...)."""
    from .launch.prologue import LIBRARY_RECIPE, library_argv, load_mapping, start_run
    from .launch.recipe import load_recipe
    from .plugins import get_plugin_manager

    if isinstance(config, Mapping):
        recipe, cfg = LIBRARY_RECIPE, load_mapping(config, overrides)
    else:
        recipe = os.fspath(config)
        cfg = load_recipe(recipe, list(overrides))
    started = start_run(cfg, plugin_manager or get_plugin_manager(), recipe, list(overrides),
                        argv=library_argv(recipe, list(overrides)))
    try:
        summary = run_started(started, listeners)
    except BaseException as exc:
        started.finish(error=exc)
        raise
    started.finish(summary)
    return summary


def run_started(started: StartedRun, listeners: Sequence[Any] = (), *, on_controller: Any = None,
                on_restart: Any = None) -> Any:
    """The controller over a started run (:func:`nexrl_core.launch.prologue.start_run`) to its end;
    after a failure, with ``resume.on_failure: restart``, again from the newest checkpoint, as often
    as ``resume.max_restarts`` allows. ``on_controller(controller)``: called with each attempt's
    controller once it is built (``nexrl run`` installs its signal handlers there);
    ``on_restart(error, delay)``: before the wait for the next attempt."""
    import time

    from .controller import NexRLController, RunFailed

    while True:
        started.controller = NexRLController(started.cfg, started.pm, listeners=list(listeners),
                                             settings=started.settings)
        if on_controller is not None:
            on_controller(started.controller)
        try:
            return started.controller.run()
        except RunFailed as exc:
            if not started.restarts.allowed():
                raise
            delay = started.restart(started.controller.final_step(), str(exc))
            if on_restart is not None:
                on_restart(str(exc), delay)
            time.sleep(delay)
