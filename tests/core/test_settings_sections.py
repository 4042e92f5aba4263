"""Typed settings for sections with inner structure (nexrl_core.Settings): a mapping whose keys are
declared elsewhere (``options=``), entries the user names (``values=``), entries that select a
component, free-form data (PlainData) and a recipe key that is a Python keyword (``key=``); and the
core's built-in components declare their keys this way."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import pytest

from nexrl_core import ConfigError, Option, Settings, setting
from nexrl_core.builtins.dataloaders import MultiDomainDataLoader
from nexrl_core.builtins.python_reward import PythonFunctionEvaluator
from nexrl_core.config.options import check_options, describe_type
from nexrl_core.config.settings import PlainData

LIMITS = {"max_tokens": Option(64, int, "most tokens", ge=1), "stop": Option([], list[str], "stop strings")}


@dataclass(frozen=True, kw_only=True)
class Job(Settings):
    class_: str | None = setting(None, "a class in the file", key="class")
    limits: dict[str, int | list[str]] = setting(dict, "the limits", options=LIMITS)
    per_domain: dict[str, dict[str, int | list[str]]] = setting(
        {}, "changes per domain", values=Option({}, dict, "one domain's changes"))
    parts: dict[str, dict[str, PlainData]] = setting(
        {}, "loaders by name", values=Option(options={"type": Option("file", str, "loader")}, component="dataloader"))
    kwargs: dict[str, PlainData] = setting({}, "handed on as they are")


def test_a_python_keyword_is_a_recipe_key_through_key():
    assert list(Job.options())[0] == "class"
    job = Job.of({"class": "Mine"})
    assert job.class_ == "Mine" and job.to_dict()["class"] == "Mine" and "class_" not in job.to_dict()
    with pytest.raises(ConfigError, match=r"^job.class_: unknown key; did you mean 'job.class'\?"):
        Job.of({"class_": "Mine"}, "job")


def test_a_mapping_of_declared_keys_defaults_to_theirs_and_is_checked_key_by_key():
    option = Job.options()["limits"]
    assert option.options == LIMITS and option.default_value() == {"max_tokens": 64, "stop": []}
    assert Job().limits == {"max_tokens": 64, "stop": []} and Job.of({}).limits == {"max_tokens": 64, "stop": []}
    assert Job.of({"limits": {"max_tokens": 8}}).limits == {"max_tokens": 8, "stop": []}
    assert check_options({"limits": {"max_tokens": 0, "stpo": []}}, Job.options(), "job") == [
        "job.limits.max_tokens: expected a positive integer, got 0",
        "job.limits.stpo: unknown key; did you mean 'job.limits.stop'?"]


def test_named_entries_are_checked_one_by_one_naming_the_entry():
    assert describe_type(Job.options()["per_domain"]) == "a mapping"
    assert check_options({"per_domain": {"math": 3, "code": {"max_tokens": 9}}}, Job.options(), "job") == [
        "job.per_domain.math: expected a mapping, got an integer (3)"]


def test_entries_that_select_a_component_are_left_to_it():
    """The recipe check holds each against the component it names; the settings take the loader's
    own keys beside the declared ones."""
    job = Job.of({"parts": {"a": {"type": "file", "path": "a.jsonl"}}})
    assert job.parts == {"a": {"type": "file", "path": "a.jsonl"}}
    assert Job.options()["parts"].values.options == {"type": Option("file", str, "loader")}  # the docs see them
    with pytest.raises(ConfigError, match="job.parts.a: expected a mapping"):
        Job.of({"parts": {"a": "file"}}, "job")


def test_free_form_data_takes_any_plain_value():
    kwargs = {"n": 1, "x": 0.5, "flag": True, "none": None, "nested": {"list": [1, "two", {"three": 3}]}}
    job = Job.of({"kwargs": kwargs})
    assert job.kwargs == kwargs and job.kwargs is not kwargs
    with pytest.raises(dataclasses.FrozenInstanceError):
        job.kwargs = {}  # type: ignore[misc]


def test_the_python_evaluator_reads_class_as_its_recipe_key(tmp_path):
    (tmp_path / "ev.py").write_text("from nexrl_core import Evaluator, EvaluationRunResult\n"
                                    "class Const(Evaluator):\n"
                                    "    def __init__(self, value=1.0):\n        self.value = value\n"
                                    "    def evaluate(self, data, target):\n"
                                    "        return EvaluationRunResult(reward=self.value)\n")
    evaluator = PythonFunctionEvaluator(**{"path": str(tmp_path / "ev.py"), "class": "Const",
                                           "kwargs": {"value": 0.25}})
    assert evaluator.settings.class_ == "Const" and evaluator.settings.kwargs == {"value": 0.25}
    with pytest.raises(ConfigError, match=r"rollout_worker.evaluator.klass: unknown key"):
        PythonFunctionEvaluator(path=str(tmp_path / "ev.py"), klass="Const")


def test_a_multi_domain_section_keeps_its_loaders_keys():
    problems = MultiDomainDataLoader.check_config(
        {"domains": {"a": {"type": "arithmetic", "num_rows": 4}, "b": {"type": "inline", "rows": [{"prompt": "x"}]}}},
        "data")
    assert problems == ["data.domain_interleave_probs: required with several domains (the share of each training "
                        "batch, e.g. {a: 1, b: 1})"]


def test_the_cores_components_declare_their_keys_as_settings(core_pm):
    """One declaration per component: a Settings class, no Option table."""
    kinds = ("dataloader", "rollout_worker", "evaluator", "trainer", "inference_backend", "metrics_sink")
    checked = []
    for kind in kinds:
        for name, registration in core_pm.components(kind).items():
            cls = registration.cls
            if not cls.__module__.startswith("nexrl_core."):
                continue
            owners = [k for k in cls.__mro__ if "OPTIONS" in k.__dict__ and k.__module__.startswith("nexrl_core.")]
            assert owners == [], f"{kind} '{name}': OPTIONS in {owners}"
            settings = getattr(cls, "SETTINGS", None)
            assert settings is None or issubclass(settings, Settings), f"{kind} '{name}'"
            checked.append(name)
    assert {"file", "huggingface", "inline", "arithmetic", "multi_domain", "simple", "pig_latin", "numeric_answer",
            "python", "reward_funcs", "mock", "openai", "wandb", "tensorboard"} <= set(checked)
