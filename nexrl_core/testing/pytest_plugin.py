"""pytest fixtures of the plugin-author testing kit, registered by nexrl-core's ``pytest11`` entry
point (so every pytest session with nexrl-core installed has them). Kept import-light: nexrl_core
is imported when a fixture is used."""

from __future__ import annotations

from typing import Any

import pytest


@pytest.fixture
def nexrl_plugins():
    """``nexrl_plugins(*plugins, entry_points=False)`` -> PluginManager: the core's built-ins plus
    ``plugins`` (modules with ``@hookimpl`` functions) registered in-process, installed as the
    process's plugin manager until the test ends (``nexrl_core.cli.main`` and controllers use it)."""
    from nexrl_core.testing import use_plugins

    stack: list[Any] = []

    def install(*plugins: Any, entry_points: bool = False):
        context = use_plugins(*plugins, entry_points=entry_points)
        pm = context.__enter__()
        stack.append(context)
        return pm

    yield install
    while stack:
        stack.pop().__exit__(None, None, None)


@pytest.fixture
def nexrl_run(tmp_path):
    """``nexrl_run(recipe, *plugins, overrides=())`` -> RunResult: train ``recipe`` (merged onto the
    kit's mock recipe) with ``plugins`` registered, outputs in a fresh folder under ``tmp_path``."""
    from nexrl_core.testing import run_recipe

    count = iter(range(1_000_000))

    def run(recipe: dict, *plugins: Any, overrides=(), **kwargs: Any):
        return run_recipe(recipe, str(tmp_path / f"nexrl-run-{next(count)}"), *plugins, overrides=overrides, **kwargs)

    return run
