"""nexrl-rewards as an installed third-party plugin: its entry point, its registered names, its
declared options, and that it uses only nexrl-core's public names."""

from __future__ import annotations

import ast
import inspect
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import nexrl_core
import nexrl_rewards
from nexrl_core.plugins import PluginManager

NAMES = {"math_rule", "code_sandbox", "llm_judge", "instruction_following"}
PACKAGE = Path(nexrl_rewards.__file__).parent


def _nexrl() -> list[str]:
    exe = shutil.which("nexrl", path=os.path.dirname(sys.executable))
    return [exe] if exe else [sys.executable, "-m", "nexrl_core.cli"]


@pytest.fixture(scope="module")
def listing():
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "nexrl-rewards"}
    done = subprocess.run(_nexrl() + ["plugins", "--json"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_nexrl_plugins_lists_the_four_evaluators(listing):
    ours = [p for p in listing["plugins"] if p["distribution"] == "nexrl-rewards"]
    assert len(ours) == 1 and ours[0]["name"] == "rewards"
    assert set(ours[0]["components"]["evaluator"]) == NAMES
    assert ours[0]["hooks"] == ["nexrl_evaluators"]
    assert listing["failed"] == [] and listing["bad_registrations"] == []


def test_the_names_resolve_through_the_plugin_manager(monkeypatch):
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-rewards")
    registered = PluginManager().components("evaluator")
    for name in NAMES:
        assert registered[name].distribution == "nexrl-rewards"


@pytest.mark.parametrize("name", sorted(NAMES))
def test_every_option_is_a_typed_keyword_argument(name, monkeypatch):
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-rewards")
    cls = PluginManager().components("evaluator")[name].cls
    params = [p for p in inspect.signature(cls.__init__).parameters.values() if p.name != "self"]
    assert params
    for p in params:
        assert p.kind == p.POSITIONAL_OR_KEYWORD, p
        assert p.annotation is not inspect.Parameter.empty, f"{name}.{p.name} has no type annotation"
        assert p.default is not inspect.Parameter.empty, p  # a missing option is a ConfigError, not a TypeError
    documented = (Path(__file__).resolve().parents[2] / "docs" / "rewards.md").read_text()
    section = documented.split(f"## `{name}`", 1)[1].split("\n## ", 1)[0]
    for p in params:
        assert f"| `{p.name}` |" in section, f"docs/rewards.md does not document {name}.{p.name}"


def test_the_plugin_imports_only_public_core_names():
    public = set(nexrl_core.__all__)
    for source in PACKAGE.glob("*.py"):
        for node in ast.walk(ast.parse(source.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("nexrl_core"):
                assert node.module == "nexrl_core", f"{source.name} imports {node.module}"
                assert {a.name for a in node.names} <= public, source.name
            if isinstance(node, ast.Import):
                assert not any(a.name.startswith("nexrl_core.") for a in node.names), source.name


def test_validate_names_a_misspelled_evaluator_option(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout_worker:\n  evaluator:\n    type: code_sandbox\n    timout_s: 3\n"
                      "data:\n  type: inline\n  rows: [{prompt: hi}]\n")
    env = {**os.environ, "NEXRL_LOAD_PLUGINS": "nexrl-rewards"}
    done = subprocess.run(_nexrl() + ["validate", str(recipe)], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2
    assert "rollout_worker.evaluator" in done.stderr and "timout_s" in done.stderr and "timeout_s" in done.stderr
