"""``nexrl new evaluator NAME``: a ready-to-publish evaluator plugin package.

The package installs with ``pip install -e .``, passes its own tests (``pytest``: the
conformance check, its registration through the entry point, a training run on nexrl's mock
components), runs its example recipe (``nexrl run recipe.yaml``) and builds with
``python -m build``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
from pathlib import Path
from string import Template

from ..errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


def names(name: str) -> dict[str, str]:
    """Every name the package uses, from the NAME given to ``nexrl new evaluator``."""
    if not _NAME.match(name):
        raise ConfigError(f"'{name}': an evaluator name is lowercase letters and digits, words joined by - or _ "
                          f"(e.g. length_penalty), starting with a letter")
    snake = name.replace("-", "_")
    return {
        "name": snake,  # rollout_worker.evaluator.type and the entry-point name
        "dist": f"nexrl-evaluator-{snake.replace('_', '-')}",
        "package": f"nexrl_evaluator_{snake}",
        "cls": "".join(part.capitalize() for part in snake.split("_")) + "Evaluator",
    }


def _core_requirement() -> str:
    """``nexrl-core>=X.Y,<X.Y+1`` for 0.x (minor versions may break), ``<X+1`` after 1.0."""
    try:
        version = md.version("nexrl-core")
    except md.PackageNotFoundError:
        return "nexrl-core"
    parts = [int(p) for p in re.findall(r"\d+", version)[:2]] + [0, 0]
    major, minor = parts[0], parts[1]
    upper = f"{major}.{minor + 1}" if major == 0 else f"{major + 1}"
    return f"nexrl-core>={major}.{minor},<{upper}"


def new_evaluator(name: str, parent: str | os.PathLike = ".", license: str = "Apache-2.0",
                  registered: set[str] | None = None) -> Path:
    """Write ``<parent>/nexrl-evaluator-NAME/`` and return its path.

    :param registered: evaluator names already taken (the installed plugins'): NAME must differ.
    """
    n = names(name)
    if registered is not None and n["name"] in registered:
        raise ConfigError(f"'{n['name']}': an installed plugin already registers an evaluator of that name "
                          f"(nexrl plugins lists them); two plugins with one name cannot be installed together")
    root = Path(parent) / n["dist"]
    if root.exists():
        raise ConfigError(f"{root}: already exists; choose another NAME or --dir, or remove it first")
    values = {**n, "core": _core_requirement(), "license": license}
    for relative, template in FILES.items():
        path = root / Template(relative).substitute(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(template).substitute(values).lstrip("\n"), encoding="utf-8")
    return root


FILES: dict[str, str] = {}

FILES["pyproject.toml"] = '''
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "nexrl evaluator plugin: $name"
readme = "README.md"
requires-python = ">=3.10"
license = "$license"
dependencies = ["$core"]

[project.optional-dependencies]
test = ["pytest>=8"]

# How nexrl finds the plugin: `rollout_worker.evaluator.type: $name` in a recipe.
[project.entry-points.nexrl]
$name = "$package.plugin"

[tool.setuptools]
packages = ["$package"]
'''

FILES["$package/__init__.py"] = '''
"""nexrl evaluator plugin: $name (see plugin.py)."""

from .plugin import $cls

__all__ = ["$cls"]
'''

FILES["$package/plugin.py"] = '''
"""The $name evaluator, registered with nexrl through the entry point in pyproject.toml.

nexrl builds one instance per rollout worker thread, with the keys of the recipe's
`rollout_worker.evaluator` mapping (other than `type`) as constructor arguments, and calls
`evaluate(data, evaluation_target)` once per sampled reply.
"""

from __future__ import annotations

from typing import Any

from nexrl_core import BaseEvaluationTarget, EvaluationRunResult, Evaluator, Option, hookimpl


class $cls(Evaluator):
    """Reward 1 when the reply contains the data item's answer. Edit `evaluate` to score your task."""

    # The recipe keys this evaluator takes: `nexrl validate` checks them (type, range, typos).
    OPTIONS = {
        "answer_key": Option("answer", str, "data field that holds the expected answer"),
        "case_sensitive": Option(False, bool, "whether 'Red' and 'red' differ"),
    }

    # Sample data: `nexrl plugins check $name` and tests/ check the evaluator on these (and on odd
    # replies: empty, very long, non-ASCII...). data: a row of the data file; reward: what it must get.
    EXAMPLES = [
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "2 + 3 = 5", "reward": 1.0},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "It is 6.", "reward": 0.0},
        {"data": {"prompt": "Name a primary colour.", "answer": "Red"}, "response": "red", "reward": 1.0},
    ]

    def __init__(self, answer_key: str = "answer", case_sensitive: bool = False):
        self.answer_key = answer_key
        self.case_sensitive = case_sensitive

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        # data: the data item (its prompt, answer and any other field of the row), shared by the
        # samples of a group: read it, do not change it. A reply you cannot parse should score 0;
        # raise only when the data item itself is unusable (the sample is then recorded as failed).
        answer = str(data.get(self.answer_key, ""))
        reply = evaluation_target.final_answer
        if not self.case_sensitive:
            answer, reply = answer.lower(), reply.lower()
        hit = bool(answer) and answer in reply
        return EvaluationRunResult(reward=float(hit), ground_truth=answer,
                                   metrics={"hit": float(hit), "reply_chars": float(len(reply))})


@hookimpl
def nexrl_evaluators():
    return {"$name": $cls}
'''

FILES["tests/test_$name.py"] = '''
"""Tests of $dist: `pip install -e .[test]`, then `pytest`."""

import $package.plugin as plugin
from nexrl_core.testing import check_evaluator
from $package import $cls


def test_conformance():
    """What `nexrl plugins check $name` checks: valid results on EXAMPLES and on odd replies."""
    report = check_evaluator($cls)
    assert report.ok, report.text()


def test_installed_entry_point_registers_it(nexrl_plugins):
    pm = nexrl_plugins(entry_points=True)  # the installed plugins, as `nexrl run` finds them
    assert pm.resolve("evaluator", "$name", "rollout_worker.evaluator.type") is $cls


def test_a_training_run_uses_it(nexrl_run):
    """Two steps on nexrl's mock components (no model): every sample is scored by $cls."""
    result = nexrl_run({"rollout_worker": {"evaluator": {"type": "$name"}}, "trainer": {"total_train_steps": 2}},
                       plugin)
    assert result.summary.global_step == 2 and result.errors == []
    for trajectory in result.trajectories:
        expected = str(trajectory["task"]["answer"]) in trajectory["response"]
        assert trajectory["reward"] == float(expected) == trajectory["score"]["hit"]
'''

FILES["recipe.yaml"] = '''
# Try the evaluator in a real nexrl run, on nexrl's mock components (no model, a few seconds):
#   nexrl run recipe.yaml
# For real training, take a recipe of your trainer (e.g. nexrl's recipes/quickstart.yaml) and set
# rollout_worker.evaluator as below.
run_dir: runs/$name
data: {type: arithmetic, num_rows: 32}
rollout_worker:
  num_workers: 2
  evaluator:
    type: $name
    answer_key: answer
service:
  inference_service: {backend: mock, mode: sum}
trainer: {type: mock, total_train_steps: 4}
trajectory_pool: {batch_size: 8, group_size: 4}
'''

FILES["README.md"] = '''
# $dist

A reward for nexrl (reinforcement learning for LLMs) recipes:
`$cls` scores each sampled reply (see `$package/plugin.py`).

## Use

```bash
pip install $dist
```

```yaml
rollout_worker:
  evaluator:
    type: $name
    answer_key: answer      # data field that holds the expected answer
    case_sensitive: false
```

`nexrl plugins` lists it; `nexrl plugins check $name` checks it on its examples.

## Develop

```bash
pip install -e '.[test]'
pytest                     # conformance, registration, a training run on mock components
nexrl run recipe.yaml      # the same run from the command line
```

## Publish

```bash
python -m pip install build twine
python -m build            # dist/*.whl and dist/*.tar.gz
twine upload dist/*
```

License: $license.
'''

FILES[".gitignore"] = '''
__pycache__/
*.egg-info/
build/
dist/
runs/
'''
