"""``nexrl new KIND NAME``: a ready-to-publish plugin package for an evaluator, a rollout worker,
a trainer, a data loader or a weight-sync backend.

The package installs with ``pip install -e .``, passes its own tests (``pytest``: its
registration through the entry point, its behaviour, a training run), passes ``nexrl plugins
check``, runs its example recipe (``nexrl run recipe.yaml``) and builds with ``python -m build``.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
from dataclasses import dataclass
from pathlib import Path
from string import Template

from ..errors import ConfigError

_NAME = re.compile(r"^[a-z][a-z0-9]*(?:[-_][a-z0-9]+)*$")


@dataclass(frozen=True)
class Kind:
    component: str  # the plugin manager's kind
    words: str      # in messages
    prefix: str     # of the distribution and package names
    suffix: str     # of the class name
    selects: str    # the recipe key that selects it


KINDS = {
    "evaluator": Kind("evaluator", "evaluator", "evaluator", "Evaluator", "rollout_worker.evaluator.type"),
    "worker": Kind("rollout_worker", "rollout worker", "worker", "RolloutWorker", "rollout_worker.type"),
    "trainer": Kind("trainer", "trainer", "trainer", "Trainer", "trainer.type"),
    "dataloader": Kind("dataloader", "data loader", "dataloader", "DataLoader", "data.type"),
    "weight-sync": Kind("weight_sync_backend", "weight-sync backend", "weight-sync", "WeightSync", "weight.backend"),
}


def names(name: str, kind: str = "evaluator") -> dict[str, str]:
    """Every name the package uses, from the NAME given to ``nexrl new KIND``."""
    spec = KINDS[kind]
    if not _NAME.match(name):
        article = "an" if spec.words[0] in "aeiou" else "a"
        raise ConfigError(f"'{name}': {article} {spec.words} name is lowercase letters and digits, words joined by "
                          f"- or _ (e.g. length_penalty), starting with a letter")
    snake = name.replace("-", "_")
    return {
        "name": snake,  # the recipe's type (backend) and the entry-point name
        "dist": f"nexrl-{spec.prefix}-{snake.replace('_', '-')}",
        "package": f"nexrl_{spec.prefix.replace('-', '_')}_{snake}",
        "cls": "".join(part.capitalize() for part in snake.split("_")) + spec.suffix,
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
    """Write ``<parent>/nexrl-evaluator-NAME/`` and return its path (:func:`new_plugin`)."""
    return new_plugin("evaluator", name, parent, license, registered)


def new_plugin(kind: str, name: str, parent: str | os.PathLike = ".", license: str = "Apache-2.0",
               registered: set[str] | None = None) -> Path:
    """Write ``<parent>/nexrl-KIND-NAME/`` and return its path.

    :param registered: names of that kind already taken (the installed plugins'): NAME must differ.
    """
    spec = KINDS[kind]
    n = names(name, kind)
    if registered is not None and n["name"] in registered:
        article = "an" if spec.words[0] in "aeiou" else "a"
        raise ConfigError(f"'{n['name']}': an installed plugin already registers {article} {spec.words} of that "
                          f"name (nexrl plugins lists them); two plugins with one name cannot be installed together")
    root = Path(parent) / n["dist"]
    if root.exists():
        raise ConfigError(f"{root}: already exists; choose another NAME or --dir, or remove it first")
    values = {**n, "core": _core_requirement(), "license": license, "words": spec.words, "selects": spec.selects}
    values["extra_deps"] = EXTRA_DEPS.get(kind, "")
    values["use"] = Template(USE.get(kind, "")).substitute(values)
    files = FILES if kind == "evaluator" else {**COMMON_FILES, **KIND_FILES[kind]}
    for relative, template in files.items():
        path = root / Template(relative).substitute(values)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(Template(template).substitute(values).lstrip("\n"), encoding="utf-8")
    return root


FILES: dict[str, str] = {}

# Shared by every kind (the evaluator too): the distribution and its package.
COMMON_FILES: dict[str, str] = {}

COMMON_FILES["pyproject.toml"] = '''
[build-system]
requires = ["setuptools>=77"]
build-backend = "setuptools.build_meta"

[project]
name = "$dist"
version = "0.1.0"
description = "nexrl $words plugin: $name"
readme = "README.md"
requires-python = ">=3.10"
license = "$license"
dependencies = ["$core"$extra_deps]

[project.optional-dependencies]
test = ["pytest>=8"]

# How nexrl finds the plugin: `$selects: $name` in a recipe.
[project.entry-points.nexrl]
$name = "$package.plugin"

[tool.setuptools]
packages = ["$package"]
'''

COMMON_FILES["$package/__init__.py"] = '''
"""nexrl $words plugin: $name (see plugin.py)."""

from .plugin import $cls

__all__ = ["$cls"]
'''

FILES["pyproject.toml"] = COMMON_FILES["pyproject.toml"]
FILES["$package/__init__.py"] = COMMON_FILES["$package/__init__.py"]

FILES["$package/plugin.py"] = '''
"""The $name evaluator, registered with nexrl through the entry point in pyproject.toml.

nexrl builds one instance per rollout worker thread, with the keys of the recipe's
`rollout_worker.evaluator` mapping (other than `type`) as constructor arguments, and calls
`evaluate(data, evaluation_target)` once per sampled reply.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from nexrl_core import BaseEvaluationTarget, EvaluationRunResult, Evaluator, Settings, hookimpl, setting


@dataclass(frozen=True, kw_only=True)
class ${cls}Settings(Settings):
    """The recipe keys this evaluator takes: `nexrl validate` checks them (type, range, typos), and
    your code reads them typed."""

    answer_key: str = setting("answer", "data field that holds the expected answer")
    case_sensitive: bool = setting(False, "whether 'Red' and 'red' differ")


class $cls(Evaluator):
    """Reward 1 when the reply contains the data item's answer. Edit `evaluate` to score your task."""

    SETTINGS = ${cls}Settings

    # Sample data: `nexrl plugins check $name` and tests/ check the evaluator on these (and on odd
    # replies: empty, very long, non-ASCII...). data: a row of the data file; reward: what it must get.
    EXAMPLES = [
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "2 + 3 = 5", "reward": 1.0},
        {"data": {"prompt": "What is 2 + 3?", "answer": 5}, "response": "It is 6.", "reward": 0.0},
        {"data": {"prompt": "Name a primary colour.", "answer": "Red"}, "response": "red", "reward": 1.0},
    ]

    def __init__(self, **options: object):
        # options: the recipe mapping's keys; checked and typed here (defaults filled in)
        self.settings = ${cls}Settings.of(options, "rollout_worker.evaluator")

    def evaluate(self, data: dict[str, Any], evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        # data: the data item (its prompt, answer and any other field of the row), shared by the
        # samples of a group: read it, do not change it. A reply you cannot parse should score 0;
        # raise only when the data item itself is unusable (the sample is then recorded as failed).
        answer = str(data.get(self.settings.answer_key, ""))
        reply = evaluation_target.final_answer
        if not self.settings.case_sensitive:
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


# -- the other kinds: files every package has, then each kind's own ----------------------------------

COMMON_FILES["README.md"] = '''
# $dist

A $words for nexrl (reinforcement learning for LLMs) recipes: `$cls` (see `$package/plugin.py`;
nexrl's docs/extending.md says what a $words must do and what nexrl fills in).

## Use

```bash
pip install $dist
```

Select it in a recipe (any recipe: nexrl's recipes/quickstart.yaml trains with it):

```yaml
$use
```

`nexrl plugins` lists it; `nexrl plugins check $name` checks its option declarations.

## Develop

```bash
pip install -e '.[test]'
pytest                     # registration, behaviour, a training run
nexrl run recipe.yaml      # its example recipe
```

## Publish

```bash
python -m pip install build twine
python -m build            # dist/*.whl and dist/*.tar.gz
twine upload dist/*
```

License: $license.
'''

COMMON_FILES[".gitignore"] = FILES[".gitignore"]

# The quickstart recipe's data, rollout and pool sections, and its services: the GRPO kinds' recipes share them.
_QUICKSTART_RUN = '''run_dir: runs/$name
seed: 7
data: {type: arithmetic, split: train, num_rows: 300, min_value: 0, max_value: 20}
rollout_worker:
  type: simple
  num_workers: 16
  sampling: {max_tokens: 16, temperature: 0.7}
  evaluator: {type: numeric_answer}
trajectory_pool: {batch_size: 16, group_size: 4, key_list: [uid]}
'''
_QUICKSTART_SERVICES = '''service:
  train_service: {model_path: smollm2-135m-instruct, lr: 1.0e-5, grad_clip: 1.0}
  inference_service: {backend: hf, model_path: smollm2-135m-instruct}
'''

_MOCK_RUN = '''
# Try it in a real nexrl run on nexrl's mock components (no model, a few seconds):
#   nexrl run recipe.yaml
# For real training select it in a recipe of a real model, e.g. nexrl's recipes/quickstart.yaml:
#   nexrl run recipes/quickstart.yaml $selects=$name
'''

KIND_FILES: dict[str, dict[str, str]] = {"worker": {}, "trainer": {}, "dataloader": {}, "weight-sync": {}}

# -- rollout worker ------------------------------------------------------------------------------------

KIND_FILES["worker"]["$package/plugin.py"] = '''
"""The $name rollout worker, registered with nexrl through the entry point in pyproject.toml.

nexrl builds `rollout_worker.num_workers` of them with the recipe's `rollout_worker` section and
their parts (the evaluator it names), and calls `step(task)` once per task, each worker in its own thread. `step` asks the model with
`self.complete(prompt)` (as often as the rollout needs) and hands each trajectory on with
`self._put_trajectory(...)`; `self.completion_trajectory(...)` builds one that carries every key a
trainer reads (docs/extending.md lists them).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nexrl_core import RolloutParts, Settings, SimpleRolloutWorker, hookimpl, setting


@dataclass(frozen=True, kw_only=True)
class ${cls}Settings(Settings):
    """The recipe keys this worker adds to the simple worker's: `nexrl validate` checks them (type,
    range, typos), and your code reads them typed."""

    instruction: str = setting("", "text put before every prompt")


class $cls(SimpleRolloutWorker):
    """One completion per task, scored by the recipe's evaluator, with an instruction put before
    every prompt. Edit `step` to shape your rollout."""

    SETTINGS = ${cls}Settings

    def __init__(self, config: Mapping[str, Any], parts: RolloutParts | None = None):
        super().__init__(config, parts)  # parts: the recipe's evaluator, built by nexrl
        self.settings = ${cls}Settings.own(self._config)  # the recipe's values, defaults filled in

    def step(self, task: dict[str, Any]) -> str | None:
        # task: the data item (a row of the data file plus uid, sample_index, ...). Read it, do not
        # change it: the samples of a group share it.
        text = task.get(self._prompt_key)
        if self.settings.instruction and isinstance(text, str):
            task = {**task, self._prompt_key: self.settings.instruction + text}
        prompt = self.build_prompt(task)  # chat messages (the recipe's system_prompt first)
        # the recipe's rollout_worker.sampling, this task's seed; pass {"max_tokens": ...} to change a key
        result = self.complete(prompt)
        return self._put_trajectory(self.completion_trajectory(task, prompt, result))


@hookimpl
def nexrl_rollout_workers():
    return {"$name": $cls}
'''

KIND_FILES["worker"]["tests/test_$name.py"] = '''
"""Tests of $dist: `pip install -e .[test]`, then `pytest`."""

import $package.plugin as plugin
from nexrl_core.testing import trajectory_problem
from $package import $cls


def test_installed_entry_point_registers_it(nexrl_plugins):
    pm = nexrl_plugins(entry_points=True)  # the installed plugins, as `nexrl run` finds them
    assert pm.resolve("rollout_worker", "$name", "rollout_worker.type") is $cls


def test_a_training_run_uses_it(nexrl_run):
    """Two steps on nexrl's mock components: every trajectory comes from $cls and carries what
    nexrl's self-hosted trainers read."""
    worker = {"type": "$name", "num_workers": 2, "instruction": "Answer with a number. ",
              "evaluator": {"type": "numeric_answer"}}
    result = nexrl_run({"rollout_worker": worker, "trainer": {"total_train_steps": 2}}, plugin)
    assert result.summary.global_step == 2 and result.errors == []
    for trajectory in result.trajectories:
        assert "Answer with a number. " in str(trajectory["prompt"])  # the chat message the model was sent
        assert trajectory_problem(trajectory, "self_hosted") is None
'''

KIND_FILES["worker"]["recipe.yaml"] = _MOCK_RUN + '''run_dir: runs/$name
data: {type: arithmetic, num_rows: 32}
rollout_worker:
  type: $name
  num_workers: 2
  instruction: "Answer with a number. "
  evaluator: {type: numeric_answer}
service:
  inference_service: {backend: mock, mode: sum}
trainer: {type: mock, total_train_steps: 4}
trajectory_pool: {batch_size: 8, group_size: 4}
'''

# -- trainer -------------------------------------------------------------------------------------------

KIND_FILES["trainer"]["$package/plugin.py"] = '''
"""The $name trainer, registered with nexrl through the entry point in pyproject.toml.

nexrl builds it with the whole recipe and its parts (the train service, the algorithm registry)
and calls `train(trajectories)` once per step. This one is
nexrl-grpo's self-hosted GRPO trainer (every `algorithm.*` key of it applies) with a change to the
advantages in `_prepare_batch`: the batch arrives as padded tensors (`responses`,
`response_mask`, `rewards`, ...), `_prepare_batch` sets `batch.values["advantages"]` and the
loss (`_loss_fn`) trains on them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from nexrl_grpo.trainers import SelfHostedGrpoTrainer

from nexrl_core import Batch, Settings, TrainerParts, hookimpl, setting


def scale_advantages(advantages: torch.Tensor, scale: float) -> torch.Tensor:
    """The algorithm change, as a plain function (tests call it without a model)."""
    return advantages * scale


@dataclass(frozen=True, kw_only=True)
class ${cls}Settings(Settings):
    """The `trainer` keys this trainer adds: `nexrl validate` checks them, and your code reads them typed."""

    advantage_scale: float = setting(1.0, "factor on every advantage", gt=0)


class $cls(SelfHostedGrpoTrainer):
    """GRPO with every advantage multiplied by `trainer.advantage_scale`. Edit `_prepare_batch`
    (advantages) or `_loss_fn` (the loss) for your algorithm."""

    SETTINGS = ${cls}Settings

    def __init__(self, config: Mapping[str, Any], parts: TrainerParts | None = None):
        super().__init__(config, parts)  # parts: the train service and algorithm registry, built by nexrl
        # read once (the GRPO trainer's own `settings` are its algorithm's)
        self.advantage_scale = ${cls}Settings.own(self._config, "trainer").advantage_scale

    def _prepare_batch(self, batch: Batch) -> tuple[Batch, dict[str, float]]:
        batch, metrics = super()._prepare_batch(batch)
        batch.values["advantages"] = scale_advantages(batch.values["advantages"], self.advantage_scale)
        metrics["train/advantage_scale"] = self.advantage_scale
        return batch, metrics


@hookimpl
def nexrl_trainers():
    return {"$name": $cls}
'''

KIND_FILES["trainer"]["tests/test_$name.py"] = '''
"""Tests of $dist: `pip install -e .[test]`, then `pytest`."""

import os

import torch

from nexrl_core.cli import main
from $package import $cls
from $package.plugin import scale_advantages

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_entry_point_registers_it(nexrl_plugins):
    pm = nexrl_plugins(entry_points=True)  # the installed plugins, as `nexrl run` finds them
    assert pm.resolve("trainer", "$name", "trainer.type") is $cls


def test_the_advantages_are_scaled():
    advantages = torch.tensor([[1.0, 1.0], [-0.5, -0.5]])
    assert torch.equal(scale_advantages(advantages, 2.0), torch.tensor([[2.0, 2.0], [-1.0, -1.0]]))


def test_its_recipe_is_valid(nexrl_plugins, capsys):
    """What `nexrl validate recipe.yaml` checks (every key, the model files aside)."""
    nexrl_plugins(entry_points=True)
    assert main(["validate", os.path.join(HERE, "recipe.yaml")]) == 0, capsys.readouterr().err
'''

KIND_FILES["trainer"]["recipe.yaml"] = '''
# The quickstart's GRPO run with this trainer (nexrl's recipes/quickstart.yaml; the model is the
# embedded SmolLM2-135M-Instruct):
#   nexrl run recipe.yaml
''' + _QUICKSTART_RUN + '''trainer:
  type: $name
  advantage_scale: 1.0
  total_train_steps: 30
algorithm: {type: grpo, loss_agg_mode: seq-mean-token-mean}
weight: {sync_mode: sync, backend: in_process}
''' + _QUICKSTART_SERVICES

# -- data loader ---------------------------------------------------------------------------------------

KIND_FILES["dataloader"]["$package/plugin.py"] = '''
"""The $name data loader, registered with nexrl through the entry point in pyproject.toml.

nexrl builds it with the recipe's `data` (or `validate.data`) section and calls `load_rows()`
once; the base class serves the rows as tasks (uid, sample_index, shuffling, epochs, resume).
"""

from __future__ import annotations

import csv
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from nexrl_core import BaseDataLoader, DataError, Settings, hookimpl, setting


@dataclass(frozen=True, kw_only=True)
class ${cls}Settings(Settings):
    """The recipe keys this loader takes: `nexrl validate` checks them, and your code reads them typed."""

    path: str = setting(help="CSV file with a header line", path=True)  # no default: the recipe must set it
    prompt_column: str = setting("prompt", "column that holds the prompt")


class $cls(BaseDataLoader):
    """Rows of a CSV file with a header line (each column a field of the row). Edit `load_rows`
    for your format."""

    SETTINGS = ${cls}Settings

    def __init__(self, config: Mapping[str, Any], is_validate: bool = False):
        # read before the base class reads the rows (it calls load_rows)
        section = self.own_section(config, is_validate)
        self.settings = ${cls}Settings.own(section, "validate.data" if is_validate else "data")
        super().__init__(section, is_validate)

    def describe(self) -> str:
        return self.settings.path

    def load_rows(self) -> list[dict[str, Any]]:
        path, column = self.settings.path, self.settings.prompt_column
        rows = []
        with open(path, newline="", encoding="utf-8") as f:
            for line, row in enumerate(csv.DictReader(f), start=2):
                if not row.get(column):
                    raise DataError(f"{path}:{line}: no value in column '{column}'")
                rows.append({**row, "prompt": row[column]})
        return rows


@hookimpl
def nexrl_dataloaders():
    return {"$name": $cls}
'''

KIND_FILES["dataloader"]["data.csv"] = '''
question,answer
What is 2 + 3?,5
What is 4 + 4?,8
What is 1 + 6?,7
What is 3 + 5?,8
What is 7 + 2?,9
What is 0 + 9?,9
What is 6 + 1?,7
What is 5 + 5?,10
'''

KIND_FILES["dataloader"]["tests/test_$name.py"] = '''
"""Tests of $dist: `pip install -e .[test]`, then `pytest`."""

import os

import pytest

import $package.plugin as plugin
from nexrl_core import DataError
from $package import $cls

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_installed_entry_point_registers_it(nexrl_plugins):
    pm = nexrl_plugins(entry_points=True)  # the installed plugins, as `nexrl run` finds them
    assert pm.resolve("dataloader", "$name", "data.type") is $cls


def test_a_training_run_reads_its_rows(nexrl_run):
    data = {"type": "$name", "path": os.path.join(HERE, "data.csv"), "prompt_column": "question"}
    result = nexrl_run({"data": data, "trainer": {"total_train_steps": 2}}, plugin)
    assert result.summary.global_step == 2 and result.errors == []
    for trajectory in result.trajectories:
        assert trajectory["task"]["prompt"] == trajectory["task"]["question"]


def test_a_bad_row_names_its_line(nexrl_run, tmp_path):
    bad = tmp_path / "bad.csv"
    bad.write_text("prompt,answer\\nWhat is 1 + 1?,2\\n,3\\n")
    with pytest.raises(DataError, match="bad.csv:3: no value in column 'prompt'"):
        nexrl_run({"data": {"type": "$name", "path": str(bad)}}, plugin)
'''

KIND_FILES["dataloader"]["recipe.yaml"] = _MOCK_RUN + '''run_dir: runs/$name
data: {type: $name, path: data.csv, prompt_column: question}
rollout_worker:
  num_workers: 2
  evaluator: {type: numeric_answer}
service:
  inference_service: {backend: mock, mode: sum}
trainer: {type: mock, total_train_steps: 4}
trajectory_pool: {batch_size: 8, group_size: 4}
'''

# -- weight-sync backend -------------------------------------------------------------------------------

KIND_FILES["weight-sync"]["$package/plugin.py"] = '''
"""The $name weight-sync backend, registered with nexrl through the entry point in pyproject.toml.

nexrl builds it with the recipe's `weight` section and calls `sync(trainer, inference_client,
version)` after a training step (`weight.model_update_frequency`), with the trajectory pool locked:
bring the trainer's weights to the inference service, then have it serve them as `version`.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loguru import logger

from nexrl_core import Capabilities, Settings, WeightSyncBackend, deferred, execute, hookimpl, setting


@dataclass(frozen=True, kw_only=True)
class ${cls}Settings(Settings):
    """The `weight` keys this backend takes: `nexrl validate` checks them, and your code reads them typed."""

    log_every: int = setting(1, "log every N-th push", ge=1)


class $cls(WeightSyncBackend):
    """Copies the trainer's tensors into an inference engine of the same process (nexrl-grpo's
    `hf` backend) and logs every N-th push. Edit `sync` to move them elsewhere (a file, a server)."""

    SETTINGS = ${cls}Settings
    # What it needs from the trainer and the inference backend, and what it gives: `nexrl validate`
    # refuses a recipe whose parts do not fit.
    CAPABILITIES = Capabilities(
        provides={"weight_sync:state_dict"},
        requires={"trainer:state_dict": "it copies the tensors a trainer in this process exports",
                  "inference:load_weights": "it loads them into an inference engine in this process"})

    def __init__(self, config: Mapping[str, Any]):
        super().__init__(config)  # self.config: the `weight` section, declared defaults filled
        self.settings = ${cls}Settings.own(self.config, "weight")
        self.pushes = 0

    def sync(self, trainer: Any, inference_client: Any, version: int) -> None:
        # deferred: the tensors go straight from the trainer to the engine, not through this process
        execute(inference_client.load_weights, deferred(trainer.export_weights), version)
        self.pushes += 1
        if self.pushes % self.settings.log_every == 0:
            logger.info(f"$name: serving weights v{version}")


@hookimpl
def nexrl_weight_sync_backends():
    return {"$name": $cls}
'''

KIND_FILES["weight-sync"]["tests/test_$name.py"] = '''
"""Tests of $dist: `pip install -e .[test]`, then `pytest`."""

import $package.plugin as plugin
from nexrl_core import Capabilities, hookimpl
from nexrl_core.testing import MockInferenceClient
from $package import $cls


class LoadingClient(MockInferenceClient):
    """nexrl's mock inference (it learns the sums by weight version) that also takes weights in
    process, as an engine does: the run below needs no model."""

    CAPABILITIES = Capabilities(provides={"inference:load_weights"})
    loaded: list = []

    def load_weights(self, state_dict, version):
        LoadingClient.loaded.append((dict(state_dict), version))
        self.set_model_version(version)


class Backends:
    @hookimpl
    def nexrl_inference_backends(self):
        return {"loading_mock": LoadingClient}


def test_installed_entry_point_registers_it(nexrl_plugins):
    pm = nexrl_plugins(entry_points=True)  # the installed plugins, as `nexrl run` finds them
    assert pm.resolve("weight_sync_backend", "$name", "weight.backend") is $cls


def test_a_training_run_serves_every_version(nexrl_run):
    """The mock model answers right only from a served version on: the rewards rise when every
    push reaches it."""
    LoadingClient.loaded.clear()
    recipe = {"weight": {"backend": "$name", "log_every": 2}, "trainer": {"total_train_steps": 4},
              "service": {"inference_service": {"backend": "loading_mock", "mode": "sum", "learn_steps": 2}}}
    result = nexrl_run(recipe, plugin, Backends())
    assert result.summary.global_step == 4 and result.errors == []
    assert [version for _, version in LoadingClient.loaded][-4:] == [1, 2, 3, 4]
    rewards = [row["train/reward_mean"] for row in result.metrics if "train/reward_mean" in row]
    assert rewards[0] < rewards[-1]
'''

KIND_FILES["weight-sync"]["recipe.yaml"] = '''
# The quickstart's GRPO run (nexrl's recipes/quickstart.yaml, the embedded SmolLM2-135M-Instruct)
# with this backend moving the weights into nexrl-grpo's in-process engine:
#   nexrl run recipe.yaml
''' + _QUICKSTART_RUN + '''trainer: {type: self_hosted_grpo, total_train_steps: 30}
algorithm: {type: grpo, loss_agg_mode: seq-mean-token-mean}
weight: {sync_mode: sync, backend: $name, log_every: 5}
''' + _QUICKSTART_SERVICES

USE = {
    "worker": "rollout_worker:\n  type: $name\n  instruction: \"Answer with a number. \"",
    "trainer": "trainer:\n  type: $name\n  advantage_scale: 1.0",
    "dataloader": "data:\n  type: $name\n  path: data.csv\n  prompt_column: question",
    "weight-sync": "weight:\n  backend: $name",
}
EXTRA_DEPS = {"trainer": ', "nexrl-grpo"'}
