"""Register plugins in-process and run a recipe on the core's mock components."""

from __future__ import annotations

import copy
import functools
import importlib.metadata as md
import json
import os
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import yaml

from .. import plugins as _plugins
from ..plugins import PluginManager

#: ``runtime_monitor`` settings that keep a small run's start, health checks and stop quick.
QUICK_MONITOR: dict[str, Any] = {"stop_timeout": 10, "health_check": {"check_interval": 0.5, "timeout": 2.0},
                                 "exception_handling": {"check_interval": 0.05}}

#: A recipe that runs in about a second on the core's own components: generated additions,
#: the mock inference service (it answers "A + B" prompts, correctly once trained a little)
#: and the mock trainer (it trains nothing). ``run_recipe`` merges a test's recipe onto it.
MOCK_RECIPE: dict[str, Any] = {
    "data": {"type": "arithmetic", "num_rows": 16, "max_value": 9},
    "rollout_worker": {"num_workers": 2, "evaluator": {"type": "numeric_answer"}},
    "service": {"inference_service": {"backend": "mock", "mode": "sum", "learn_steps": 2}},
    "trainer": {"type": "mock", "total_train_steps": 1},
    "trajectory_pool": {"batch_size": 4, "group_size": 2},
    "logger": {"backend": ["console"], "level": "WARNING"},
    "runtime_monitor": QUICK_MONITOR,
}


def make_recipe(base: Mapping[str, Any] | None = MOCK_RECIPE, /, **sections: Any) -> dict[str, Any]:
    """A recipe (plain dicts, a copy): ``base`` (:data:`MOCK_RECIPE`; None: nothing) with each keyword
    section merged in as :func:`run_recipe` merges: key by key, except that a mapping naming its
    component (``type`` / ``backend``) replaces the base's, and any other value replaces it.
    ``make_recipe(trainer={"total_train_steps": 3}, rollout_worker={"evaluator": {"type": "exact_match"}})``."""
    return copy.deepcopy(_merge(dict(base or {}), sections))


def write_recipe(recipe: Mapping[str, Any], path: str | os.PathLike[str]) -> str:
    """``recipe`` written as YAML to ``path`` (what ``nexrl run`` and ``load_recipe`` read); the path."""
    with open(path, "w", encoding="utf-8") as f:
        yaml.safe_dump(dict(recipe), f, sort_keys=False)
    return str(path)


def plugin_manager(*plugins: Any, entry_points: bool = False) -> PluginManager:
    """A plugin manager with the core's built-ins and ``plugins`` (modules, or objects with
    ``@hookimpl`` methods) registered in-process.

    :param entry_points: also load the installed plugins (``NEXRL_LOAD_PLUGINS`` applies). A
        plugin passed here that is also installed (an editable install of the package under
        test) is registered once.
    """
    pm = PluginManager(load_entrypoints=entry_points)
    for plugin in plugins:
        name = getattr(plugin, "__name__", None) or type(plugin).__name__
        dist, version = _distribution_of(plugin)
        pm.register(plugin, name=name, distribution=dist, version=version)
    return pm


def _distribution_of(plugin: Any) -> tuple[str, str]:
    """The installed distribution whose ``nexrl`` entry point names ``plugin``'s module (or that
    ships its top-level package), if any."""
    module = str(getattr(plugin, "__name__", type(plugin).__module__))
    try:
        for ep in md.entry_points(group=_plugins.ENTRY_POINT_GROUP):
            if ep.value.split(":")[0] == module and ep.dist is not None:
                return ep.dist.name, ep.dist.version
        dists = _packages_distributions(tuple((p, _mtime(p)) for p in sys.path)).get(module.split(".")[0]) or []
        return (dists[0], md.version(dists[0])) if dists else ("(in-process)", "")
    except Exception:  # broken metadata must not break a test
        return "(in-process)", ""


@functools.lru_cache(maxsize=8)
def _packages_distributions(path: tuple[tuple[str, int], ...]) -> Mapping[str, list[str]]:
    """``importlib.metadata.packages_distributions()`` for ``path`` (``sys.path`` with each folder's
    modification time, which an installed distribution changes): it reads the file list of every
    installed distribution (~0.2 s in a large environment), so once, not once per plugin."""
    return md.packages_distributions()


def _mtime(folder: str) -> int:
    try:
        return os.stat(folder or ".").st_mtime_ns
    except OSError:
        return 0


@contextmanager
def use_plugins(*plugins: Any, entry_points: bool = False) -> Iterator[PluginManager]:
    """Within the block, :func:`plugin_manager` of ``plugins`` is the process's plugin manager: the
    one ``nexrl run`` / ``validate`` / ``eval`` (``nexrl_core.cli.main``) and a controller without
    an explicit manager use."""
    pm = plugin_manager(*plugins, entry_points=entry_points)
    previous = _plugins._DEFAULT
    _plugins._DEFAULT = pm
    try:
        yield pm
    finally:
        _plugins._DEFAULT = previous


@dataclass
class RunResult:
    """What :func:`run_recipe` hands back."""

    summary: Any  #: :class:`nexrl_core.RunSummary` (global_step, stopped_by, validation)
    run_dir: str
    metrics: list[dict[str, Any]] = field(default_factory=list)  #: rows of metrics.jsonl
    errors: list[dict[str, Any]] = field(default_factory=list)  #: rows of errors.jsonl (failed samples)
    trajectories: list[dict[str, Any]] = field(default_factory=list)  #: what the mock trainer trained on
    controller: Any = None

    @property
    def rewards(self) -> list[float]:
        return [float(t["reward"]) for t in self.trajectories]


def run_recipe(recipe: Mapping[str, Any], run_dir: str, *plugins: Any, overrides: list[str] | tuple[str, ...] = (),
               base: Mapping[str, Any] | None = MOCK_RECIPE) -> RunResult:
    """Train with ``recipe`` merged onto ``base`` (:data:`MOCK_RECIPE`; None: nothing), loaded and
    checked exactly as ``nexrl run`` loads it, with ``plugins`` registered in-process.

    The recipe is written to ``run_dir/../<name>.recipe.yaml``; outputs go to ``run_dir``.
    """
    from ..controller import NexRLController
    from ..launch.recipe import load_recipe

    merged = make_recipe(base, run_dir=str(run_dir), **dict(recipe))
    path = os.path.join(os.path.dirname(os.path.abspath(run_dir)), f"{os.path.basename(run_dir)}.recipe.yaml")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    write_recipe(merged, path)
    pm = plugin_manager(*plugins)
    cfg = load_recipe(path, list(overrides))
    controller = NexRLController(cfg, plugin_manager=pm)
    summary = controller.run()
    batches = getattr(controller.trainer, "batches", [])
    return RunResult(summary, str(run_dir), _rows(os.path.join(run_dir, "metrics.jsonl")),
                     _rows(os.path.join(run_dir, "errors.jsonl")), [t for b in batches for t in b], controller)


def _merge(base: dict[str, Any], top: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, Mapping) and isinstance(out.get(key), Mapping) and not {"type", "backend"} & set(value):
            out[key] = _merge(dict(out[key]), value)
        else:
            out[key] = value  # a section that names its component (type/backend) replaces the base's
    return out


def _rows(path: str) -> list[dict[str, Any]]:
    if not os.path.exists(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]
