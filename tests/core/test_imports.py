"""Plugins import only nexrl_core's public names (``from nexrl_core import X`` with X in
``nexrl_core.__all__``), never its private modules, so the core's insides can move."""

from __future__ import annotations

import ast
from pathlib import Path

import nexrl_core
import nexrl_core.testing

REPO = Path(__file__).resolve().parents[2]
# The public import paths of the core and their public names: nexrl_core, and the testing kit
# for plugin authors (docs/plugins.md).
PUBLIC_MODULES = {"nexrl_core": nexrl_core.__all__, "nexrl_core.testing": nexrl_core.testing.__all__}


def private_imports(source: str, filename: str = "<source>") -> list[str]:
    """``file:line: what`` for every import of a private part of nexrl_core in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "nexrl_core" and alias.name not in PUBLIC_MODULES:
                    found.append(f"{filename}:{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "nexrl_core":
            if node.module not in PUBLIC_MODULES:
                found.append(f"{filename}:{node.lineno}: from {node.module} import ...")
                continue
            for alias in node.names:  # `from nexrl_core import inference` would reach a private module
                if alias.name not in PUBLIC_MODULES[node.module]:
                    found.append(f"{filename}:{node.lineno}: {alias.name} is not in {node.module}.__all__")
    return found


def test_the_checker_finds_every_private_import():
    source = ("import nexrl_core\nfrom nexrl_core import BaseTrainer, execute\nimport nexrl_core.runtime.inference\n"
              "from nexrl_core.runtime.execute import execute\nfrom nexrl_core import inference\n"
              "def f():\n    from nexrl_core.builtins.mock import MockTrainer\n"
              "from nexrl_core.testing import check_evaluator, kit\nimport nexrl_core.testing\n")
    assert private_imports(source, "x.py") == [
        "x.py:3: import nexrl_core.runtime.inference",
        "x.py:4: from nexrl_core.runtime.execute import ...",
        "x.py:5: inference is not in nexrl_core.__all__",
        "x.py:8: kit is not in nexrl_core.testing.__all__",
        "x.py:7: from nexrl_core.builtins.mock import ...",  # nested: ast.walk visits it last
    ]


def test_plugins_import_only_public_names():
    files = sorted((REPO / "plugins").rglob("*.py"))
    assert files, "no plugin sources found"
    problems = [p for f in files for p in private_imports(f.read_text(encoding="utf-8"), str(f.relative_to(REPO)))]
    assert problems == [], "plugins must import from nexrl_core's public names only:\n" + "\n".join(problems)


def test_every_public_name_resolves():
    for module in (nexrl_core, nexrl_core.testing):
        for name in module.__all__:
            assert getattr(module, name, None) is not None, f"{module.__name__}.{name}"


def test_every_core_folder_is_a_package():
    """pyproject ships nexrl_core's packages; a folder without __init__.py would be left out of the wheel."""
    folders = {p.parent for p in (REPO / "nexrl_core").rglob("*.py") if "__pycache__" not in p.parts}
    missing = sorted(str(f.relative_to(REPO)) for f in folders if not (f / "__init__.py").exists())
    assert missing == []


def _imports_ray(path: Path) -> list[int]:
    lines = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
            [node.module or ""] if isinstance(node, ast.ImportFrom) and node.level == 0 else []
        if any(n == "ray" or n.startswith("ray.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_the_ray_launch_mode_imports_ray():
    """Ray has one home: nexrl_core/launch/ray/ (DESIGN: the launch mode has one home)."""
    home = REPO / "nexrl_core" / "launch" / "ray"
    files = sorted((REPO / "nexrl_core").rglob("*.py")) + sorted((REPO / "plugins").rglob("*.py"))
    outside = [f"{f.relative_to(REPO)}:{line}" for f in files if home not in f.parents for line in _imports_ray(f)]
    assert outside == []
    assert _imports_ray(home / "manager.py")  # the checker does see an import of ray


def test_the_core_imports_and_validates_a_ray_recipe_without_ray(tmp_path):
    """Without the extra, nexrl_core (its launch package and the ray settings included) imports,
    and validate names what to install."""
    import subprocess
    import sys

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("launch_mode: ray\ndata: {type: inline, rows: [{prompt: a, answer: b}]}\n"
                      "trajectory_pool: {batch_size: 2, group_size: 2}\n")
    code = ("import sys; sys.modules['ray'] = None\n"  # `import ray` now fails, as without the extra
            "import nexrl_core, nexrl_core.launch, nexrl_core.launch.ray, nexrl_core.controller\n"
            "from nexrl_core.cli import main\n"
            f"sys.exit(main(['validate', {str(recipe)!r}]))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                         env={**__import__("os").environ, "NEXRL_LOAD_PLUGINS": ""})
    assert out.returncode == 2, out.stderr
    assert "launch_mode: 'ray' needs Ray, an optional extra: pip install 'nexrl-core[ray]'" in out.stderr
    assert "Traceback" not in out.stderr


def test_a_broken_builtin_does_not_break_import_nexrl_core():
    """Built-ins are plugins: one that fails to import is reported by the plugin manager, the other
    built-ins still register, and ``import nexrl_core`` (every public name but the broken one) works."""
    import json
    import subprocess
    import sys

    code = (
        "import importlib.abc, json, sys\n"
        "class Broken(importlib.abc.MetaPathFinder):\n"
        "    def find_spec(self, name, path, target=None):\n"
        "        if name == 'nexrl_core.builtins.workers':\n"
        "            raise RuntimeError('broken on purpose')\n"
        "sys.meta_path.insert(0, Broken())\n"
        "import nexrl_core\n"
        "from nexrl_core import BaseRolloutWorker, FileDataLoader, NexRLController\n"
        "pm = nexrl_core.PluginManager(load_entrypoints=False)\n"
        "try:\n"
        "    nexrl_core.SimpleRolloutWorker\n"
        "    lazy = 'imported'\n"
        "except RuntimeError as exc:\n"
        "    lazy = str(exc)\n"
        "print(json.dumps({'failures': [[f.name, f.error] for f in pm.failures], 'lazy': lazy,\n"
        "                  'loaders': sorted(pm.components('dataloader')),\n"
        "                  'workers': sorted(pm.components('rollout_worker'))}))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=str(REPO),
                          env={**__import__("os").environ, "NEXRL_LOAD_PLUGINS": ""})
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["failures"] == [["core.workers", "RuntimeError: broken on purpose"]]
    assert out["lazy"] == "broken on purpose"
    assert "file" in out["loaders"]  # the other built-ins registered
    assert "simple" not in out["workers"]
