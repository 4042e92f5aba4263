"""Shared fixtures of the whole suite. Torch-free: core tests must never import torch."""

from __future__ import annotations

import os
import sys
import textwrap
from pathlib import Path

import pytest

from nexrl_core.testing import QUICK_MONITOR

REPO_ROOT = Path(__file__).resolve().parents[1]
BAD_INPUTS = REPO_ROOT / "tests" / "bad_inputs"


def _write_dist(root: Path, dist: str, entry_points: dict[str, str], modules: dict[str, str],
                version: str = "0.1.0") -> Path:
    """Lay out an installed distribution the way pip does: ``<dist>-<version>.dist-info/`` with
    ``METADATA`` and ``entry_points.txt`` (group ``nexrl``) next to its modules, under ``root``."""
    root.mkdir(parents=True, exist_ok=True)
    info = root / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    lines = "".join(f"{name} = {target}\n" for name, target in entry_points.items())
    (info / "entry_points.txt").write_text(f"[nexrl]\n{lines}")
    for name, source in modules.items():
        path = root / (name.replace(".", "/") + ".py")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(source))
    return root


@pytest.fixture
def write_dist():
    """``write_dist(root, dist, {ep_name: module}, {module: source})`` -> ``root`` (not yet on sys.path)."""
    return _write_dist


@pytest.fixture
def core_pm(monkeypatch):
    """A fresh PluginManager with only nexrl-core's built-ins, installed as the process default
    (what the CLI and a controller without an explicit manager use)."""
    import nexrl_core.plugins as plugins

    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    pm = plugins.PluginManager()
    monkeypatch.setattr(plugins, "_DEFAULT", pm)
    return pm


@pytest.fixture
def reset_loguru():
    """`nexrl run` re-points loguru at the (captured) stderr; point it back after the test."""
    yield
    from loguru import logger

    logger.remove()
    logger.add(lambda message: sys.stderr.write(message), level=os.environ.get("NEXRL_TEST_LOG_LEVEL", "WARNING"),
               diagnose=False)


FAST_MONITOR = QUICK_MONITOR  # the kit's (nexrl_core.testing)


@pytest.fixture(scope="session")
def fast_monitor():
    """Monitor settings that keep a local run's start and stop quick."""
    return FAST_MONITOR


@pytest.fixture
def run_local(tmp_path, core_pm, reset_loguru):
    """``run_local(recipe_dict, pm=None, overrides=())`` -> (controller, summary); ``pm`` defaults to
    ``core_pm``.

    Writes the recipe to ``tmp_path/recipe.yaml`` (run_dir defaults to ``tmp_path/run``), loads
    it exactly as ``nexrl run`` does and runs a real controller in local mode."""
    import yaml

    from nexrl_core.controller import NexRLController
    from nexrl_core.launch.recipe import load_recipe

    def run(recipe: dict, pm=None, overrides=(), name: str = "recipe.yaml"):
        recipe = {"run_dir": str(tmp_path / "run"), "runtime_monitor": FAST_MONITOR,
                  "logger": {"backend": ["console"], "level": "WARNING"}, **recipe}
        path = tmp_path / name
        path.write_text(yaml.safe_dump(recipe, sort_keys=False))
        cfg = load_recipe(str(path), list(overrides))
        controller = NexRLController(cfg, plugin_manager=pm or core_pm)
        return controller, controller.run()

    return run


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray cluster (2 CPUs, no dashboard) for every Ray test of the session, stopped at
    its end with a check that none of its processes is left. A Ray run in this process attaches
    to it (and only kills its own actors)."""
    pytest.importorskip("ray")
    from tests.support.ray_cluster import start_cluster, stop_cluster

    cluster = start_cluster(num_cpus=2)
    yield cluster
    stop_cluster(cluster)


def pytest_collection_modifyitems(config, items):
    """The minutes-long tests (``slow``, ``vllm``) first, in their order: pytest-xdist hands them to
    the first worker and the others steal the short tests around them, where at the end of the list
    they would leave one worker finishing them alone (and a module's vLLM server is started once)."""
    items.sort(key=lambda item: not (item.get_closest_marker("slow") or item.get_closest_marker("vllm")))
