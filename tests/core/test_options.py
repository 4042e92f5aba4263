"""nexrl_core.config.options: declared options (types, ranges, choices, nested mappings, required keys),
options derived from an annotated constructor, inheritance, capabilities, and the
core schema every recipe key lives in."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, Optional

import pytest
import yaml

from nexrl_core import REQUIRED, BaseTrainer, Capabilities, EvaluationRunResult, Evaluator, Option, hookimpl
from nexrl_core.config.options import (
    check_options,
    component_options,
    describe_type,
    option_defaults,
    options_from_signature,
)
from nexrl_core.config.schema import CORE_OPTIONS, core_defaults
from nexrl_core.launch.recipe import check_config, load_recipe
from nexrl_core.runtime.inference import sampling_options

OPTS = {
    "steps": Option(10, int, "steps", ge=1),
    "lr": Option(1e-3, float, "learning rate", gt=0),
    "p": Option(1.0, float, "a probability", gt=0, le=1),
    "mode": Option("a", str, "mode", choices=("a", "b")),
    "names": Option([], list[str], "names"),
    "maybe": Option(None, int, "optional integer"),
    "must": Option(REQUIRED, str, "must be set"),
    "nested": Option(options={"x": Option(1, int, ge=0), "y": Option(True, bool)}),
    "gone": Option(removed="use 'steps'"),
    "odd": Option(1, int, check=lambda v: None if v % 2 else "must be odd"),
}


def problems(values: dict) -> list[str]:
    return check_options({"must": "ok", **values}, OPTS, "sec")


@pytest.mark.parametrize("values, expected", [
    ({"steps": 0}, "sec.steps: expected a positive integer, got 0"),
    ({"steps": 2.5}, "sec.steps: expected an integer, got a number (2.5)"),
    ({"steps": True}, "sec.steps: expected an integer, got a boolean (True)"),
    ({"lr": math.nan}, "sec.lr: expected a finite number, got nan"),
    ({"lr": -math.inf}, "sec.lr: expected a finite number, got -inf"),
    ({"lr": 0}, "sec.lr: expected a positive number, got 0"),
    ({"lr": "1e-5"}, "sec.lr: expected a number, got a string ('1e-5'); YAML reads a number like 1e-5 as text: "
                       "write 1.0e-5"),
    ({"p": 1.5}, "sec.p: expected a number > 0 and <= 1, got 1.5"),
    ({"mode": "B"}, "sec.mode: 'B' is not one of a, b; did you mean 'b'?"),
    ({"names": ["a", 1]}, "sec.names: expected a list of strings, got a list"),
    ({"names": "a"}, "sec.names: expected a list of strings, got a string ('a')"),
    ({"maybe": "x"}, "sec.maybe: expected an integer or null, got a string ('x')"),
    ({"steps": None}, "sec.steps: expected an integer, got null"),
    ({"must": None}, "sec.must: required (must be set)"),
    ({"nested": {"x": -1}}, "sec.nested.x: expected a non-negative integer, got -1"),
    ({"nested": {"z": 1}}, "sec.nested.z: unknown key"),
    ({"nested": [1]}, "sec.nested: expected a mapping, got a list"),
    ({"gone": 3}, "sec.gone: no longer a recipe key: use 'steps'"),
    ({"stesp": 3}, "sec.stesp: unknown key; did you mean 'sec.steps'?"),
    ({"odd": 2}, "sec.odd: must be odd"),
    ({"steps": "???"}, "sec.steps: a value is required here (the recipe has '???')"),
])
def test_each_problem_is_one_line_naming_the_key(values, expected):
    assert problems(values) == [expected]


def test_good_values_and_defaults():
    assert problems({"steps": 3, "lr": 1, "p": 1.0, "mode": "b", "names": ["x"], "maybe": None,
                     "nested": {"x": 0}, "odd": 3}) == []
    assert check_options({}, OPTS, "sec") == ["sec.must: required (must be set)"]
    defaults = option_defaults(OPTS)
    assert defaults["nested"] == {"x": 1, "y": True}
    assert "must" not in defaults and "gone" not in defaults
    assert check_options({"anything": 1}, None, "sec") == []  # None: any keys
    assert check_options("text", OPTS, "sec") == ["sec: expected a mapping, got a string ('text')"]


def test_types_in_words():
    assert describe_type(Option(None, Optional[int])) == "an integer or null"
    assert describe_type(Option(0, Literal["x", "y"])) == "one of 'x', 'y'"
    assert describe_type(Option([], list[dict])) == "a list of mappings"
    assert describe_type(Option("a", (str, list[str]))) == "a string or a list of strings"


def test_options_from_an_annotated_signature():
    class Judge(Evaluator):
        def __init__(self, threshold: float = 0.5, mode: Literal["strict", "lenient"] = "strict",
                     keys: list[str] | None = None, name: str = "x", untyped=3, *, required_key: int):
            pass

        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult()

    opts = options_from_signature(Judge.__init__)
    assert set(opts) == {"threshold", "mode", "keys", "name", "untyped", "required_key"}
    assert check_options({"threshold": "high", "mode": "loose", "keys": [1], "untyped": "3", "required_key": 1},
                         opts, "ev") == [
        "ev.threshold: expected a number, got a string ('high')",
        "ev.mode: 'loose' is not one of strict, lenient",
        "ev.keys: expected a list of strings or null, got a list",
        "ev.untyped: expected an integer, got a string ('3')",  # typed by its default
    ]
    assert check_options({}, opts, "ev") == ["ev.required_key: required"]

    class Open(Evaluator):
        def __init__(self, **kwargs):
            pass

    assert options_from_signature(Open.__init__) is None  # **kwargs: any key


def test_declarations_are_inherited():
    class Base(BaseTrainer):
        OPTIONS = {"a": Option(1, int, ge=0)}

    class Child(Base):
        OPTIONS = {"b": Option("x", str)}

    child = component_options(Child)
    assert set(child) == {"a", "b"} and component_options(BaseTrainer) is None
    assert check_options({"a": -1, "b": 2}, child, "trainer") == [
        "trainer.a: expected a non-negative integer, got -1", "trainer.b: expected a string, got an integer (2)"]


def test_every_core_key_has_help_and_a_default_that_passes_its_own_check():
    def walk(options, path=""):
        for key, opt in options.items():
            full = f"{path}.{key}" if path else key
            if opt.removed is not None:
                continue
            assert opt.help, f"{full} has no help text"
            yield full, opt
            if opt.options:
                yield from walk(opt.options, full)

    keys = dict(walk(CORE_OPTIONS))
    assert {"trainer.total_train_steps", "weight.backend", "runtime_monitor.failed_samples.max_fraction",
            "overwrite_run_dir", "validate.data.type"} <= set(keys)
    resolved = yaml.safe_load(yaml.safe_dump(core_defaults()).replace("${seed}", "42").replace(
        "${run_dir}", "runs/run").replace("${experiment_name}", "run"))
    # the trainer and the inference backend have no default: a recipe names them (mock ones too)
    problems = check_options(resolved, CORE_OPTIONS, "")
    assert sorted(p.split(": ")[:2] for p in problems) == [["service.inference_service.backend", "required (registered "
                                                            "inference backend (nexrl plugins lists them; mock"],
                                                           ["trainer.type", "required (registered trainer (nexrl plugins "
                                                                      "lists them; mock"]]


def test_sampling_keys_are_exactly_the_fields_of_sampling_params():
    from nexrl_core import SamplingParams

    fields = {f.name for f in dataclasses.fields(SamplingParams)} - {"seed"}
    assert {k for k, o in sampling_options().items() if o.removed is None} == fields
    assert "per request" in sampling_options()["seed"].removed  # named, not silently unknown
    # top_k is checked the same way: accepted iff SamplingParams carries it, and bounded then
    found = check_options({"top_k": 5}, sampling_options(), "rollout_worker.sampling")
    if "top_k" in fields:
        assert found == []
        assert check_options({"top_k": -5}, sampling_options(), "s") == [
            "s.top_k: expected an integer >= -1, got -5"]
    else:
        assert len(found) == 1 and found[0].startswith("rollout_worker.sampling.top_k: unknown key")


def test_a_sampling_key_the_recipe_sets_reaches_the_request(run_local):
    """Every declared sampling key is passed on (none accepted and dropped)."""
    controller, _ = run_local({
        "data": {"type": "inline", "rows": [{"prompt": "1 + 2", "answer": "3"}, {"prompt": "3 + 3", "answer": "6"}]},
        "rollout_worker": {"num_workers": 1, "sampling": {"max_tokens": 1, "temperature": 0.3, "top_p": 0.5,
                                                          "stop": ["x"]}},
        "trajectory_pool": {"batch_size": 2, "group_size": 1, "key_list": []},
        "trainer": {"type": "mock", "total_train_steps": 1},
        "service": {"inference_service": {"backend": "mock", "mode": "echo"}},
    })
    trajectories = [t for batch in controller.trainer.batches for t in batch]
    assert trajectories and all(len(t["response"]) == 1 for t in trajectories)
    for t in trajectories:  # what the backend received travels with each trajectory
        record = dict(t["sampling"])
        assert {k: record[k] for k in ("max_tokens", "temperature", "top_p", "stop")} == \
            {"max_tokens": 1, "temperature": 0.3, "top_p": 0.5, "stop": ["x"]}


# -- capabilities -------------------------------------------------------------------------------------

class _Producing(BaseTrainer):
    CAPABILITIES = Capabilities(provides={"trainer:blob"}, requires={"weight_sync:blob": "its weights must move"})

    def train(self, trajectories):
        return {}


class _Plugin:
    @hookimpl
    def nexrl_trainers(self):
        return {"producing": _Producing}

    @hookimpl
    def nexrl_weight_sync_backends(self):
        from nexrl_core import WeightSyncBackend

        class BlobSync(WeightSyncBackend):
            CAPABILITIES = Capabilities(provides={"weight_sync:blob"})

            def sync(self, trainer, inference_client, version):
                inference_client.set_model_version(version)

        return {"blob_sync": BlobSync}


def test_a_plugin_declares_what_its_components_need_and_validate_checks_it(core_pm, tmp_path):
    core_pm.register(_Plugin(), name="blob", distribution="nexrl-blob (in-process)")
    path = tmp_path / "r.yaml"
    path.write_text("data: {type: inline, rows: [{prompt: a}]}\ntrainer: {type: producing}\n"
                    "service: {inference_service: {backend: mock}}\n"
                    "trajectory_pool: {batch_size: 4, group_size: 4}\n")
    found = check_config(load_recipe(str(path)), core_pm)
    assert found == ["trainer.type: trainer 'producing' needs 'weight_sync:blob' (its weights must move), which "
                     "neither inference backend 'mock', weight-sync backend 'version_only' provides; it is provided "
                     "by weight.backend: blob_sync (nexrl-blob (in-process))"]
    assert check_config(load_recipe(str(path), ["weight.backend=blob_sync"]), core_pm) == []
    # nexrl eval builds no trainer: the combination is not its concern
    assert check_config(load_recipe(str(path)), core_pm, eval_only=True) == []


def test_filling_a_section_never_changes_a_declared_default():
    """A mutable default is handed out as a copy: a recipe section built from the defaults and then
    filled in (ray.resources.<role>) must not change the declaration (docs/recipe.md renders it)."""
    from nexrl_core.config.options import option_defaults
    from nexrl_core.config.schema import CORE_OPTIONS

    defaults = option_defaults(CORE_OPTIONS)
    defaults["ray"]["resources"]["trainer"] = {"num_gpus": 1}
    assert CORE_OPTIONS["ray"].options["resources"].default_value() == {}
