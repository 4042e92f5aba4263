"""Every name a benchmark script imports from nexrl's packages exists, including the imports inside
functions that only a GPU (or vLLM) run reaches: a script broken by a moved name fails here on the
CPU, not after a GPU machine has started."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
SCRIPTS = sorted(BENCHMARKS.glob("*.py"))


def nexrl_imports(source: str) -> list[tuple[int, str, str | None]]:
    """(line, module, name) of every import of a nexrl package in ``source``, at any depth; name is
    None for ``import module``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, None) for alias in node.names if alias.name.startswith("nexrl")]
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("nexrl"):
            found += [(node.lineno, str(node.module), alias.name) for alias in node.names]
    return sorted(found)


def unresolved(source: str, where: str) -> list[str]:
    """``where:line: what`` for each nexrl import of ``source`` that names nothing. A module that
    needs a dependency not installed here (vLLM, Tinker) is not judged."""
    problems = []
    for line, module_name, name in nexrl_imports(source):
        try:
            module = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name and exc.name.split(".")[0].startswith("nexrl"):
                problems.append(f"{where}:{line}: no module {module_name}")
            continue
        if name is None or hasattr(module, name):
            continue
        try:
            importlib.import_module(f"{module_name}.{name}")
        except ModuleNotFoundError:
            problems.append(f"{where}:{line}: {module_name} has no {name}")
    return problems


def test_the_checker_finds_a_missing_name_at_any_depth():
    source = ("import json\nfrom nexrl_torch.models import SMOLLM2\n"
              "def main():\n    from nexrl_torch.rollout.weights import SMOLLM2, HFInferenceBackend\n"
              "    import nexrl_torch.nowhere\n    from nexrl_core import cli, NotAName\n")
    assert unresolved(source, "x.py") == ["x.py:4: nexrl_torch.rollout.weights has no SMOLLM2",
                                          "x.py:5: no module nexrl_torch.nowhere",
                                          "x.py:6: nexrl_core has no NotAName"]


@pytest.mark.parametrize("script", SCRIPTS, ids=[p.name for p in SCRIPTS])
def test_every_nexrl_name_a_benchmark_imports_exists(script):
    assert unresolved(script.read_text(encoding="utf-8"), f"benchmarks/{script.name}") == []
