"""The plugin-author testing kit (issue 18, item 6): in-process registration that also works
when the plugin is installed (the documented snippet used to raise pluggy's "already
registered"), the pytest fixtures, a mock-component run, the evaluator conformance check and
``nexrl plugins check``."""

from __future__ import annotations

import importlib
import json
import math
import time
import types

import pytest

import nexrl_core.plugins as plugins
from nexrl_core import EvaluationRunResult, Evaluator, Option
from nexrl_core.cli import main
from nexrl_core.plugins import PluginManager
from nexrl_core.testing import (
    MOCK_RECIPE,
    QUICK_MONITOR,
    check_evaluator,
    make_recipe,
    plugin_manager,
    run_recipe,
    use_plugins,
    write_recipe,
)

PLUGIN = '''
from nexrl_core import EvaluationRunResult, Evaluator, hookimpl


class EndsWith(Evaluator):
    EXAMPLES = [{"data": {"suffix": "!"}, "response": "hi!", "reward": 1.0},
                {"data": {"suffix": "!"}, "response": "hi", "reward": 0.0}]

    def evaluate(self, data, evaluation_target):
        hit = evaluation_target.final_answer.endswith(data.get("suffix", "!"))
        return EvaluationRunResult(reward=float(hit), metrics={"hit": float(hit)})


@hookimpl
def nexrl_evaluators():
    return {"ends_with": EndsWith}
'''


def test_registering_an_installed_plugin_in_process_is_not_an_error(tmp_path, monkeypatch, write_dist):
    site = tmp_path / "site"
    write_dist(site, "nexrl-evaluator-endswith", {"endswith": "kit_endswith_plugin"}, {"kit_endswith_plugin": PLUGIN})
    monkeypatch.syspath_prepend(str(site))
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "nexrl-evaluator-endswith")
    module = importlib.import_module("kit_endswith_plugin")

    pm = PluginManager()  # loads the installed plugin through its entry point
    assert pm.records["endswith"].module is module
    pm.register(module, name="my_plugin")  # the README's snippet: used to raise "Plugin already registered"
    assert list(pm.records).count("endswith") == 1 and "my_plugin" not in pm.records
    assert pm.resolve("evaluator", "ends_with", "k").__name__ == "EndsWith"

    kit = plugin_manager(module, entry_points=True)  # the same through the kit
    assert kit.resolve("evaluator", "ends_with", "k") is module.EndsWith
    alone = plugin_manager(module)  # without entry points: built-ins + the module, named by the distribution
    assert alone.resolve("evaluator", "ends_with", "k") is module.EndsWith
    assert alone.records["kit_endswith_plugin"].distribution == "nexrl-evaluator-endswith"


def test_use_plugins_installs_the_manager_for_the_cli_and_restores_it(tmp_path, capfd):
    module = _module("kit_plugin_a", PLUGIN)
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("rollout_worker: {evaluator: {type: ends_with}}\ndata: {type: arithmetic}\n"
                      "trainer: {type: mock}\nservice: {inference_service: {backend: mock}}\n")
    assert main(["validate", str(recipe)]) == 2  # not registered
    assert "unknown evaluator 'ends_with'" in capfd.readouterr().err
    before = plugins.get_plugin_manager()
    with use_plugins(module) as pm:
        assert plugins.get_plugin_manager() is pm
        assert main(["validate", str(recipe)]) == 0
    assert plugins._DEFAULT is before


def test_the_pytest_fixtures(nexrl_plugins, nexrl_run, tmp_path):
    """The fixtures nexrl-core's pytest11 entry point provides to every pytest session."""
    module = _module("kit_plugin_b", PLUGIN)
    pm = nexrl_plugins(module)
    assert plugins.get_plugin_manager() is pm
    result = nexrl_run({"rollout_worker": {"evaluator": {"type": "ends_with"}},
                        "data": {"type": "inline", "rows": [{"prompt": "shout!", "suffix": "!"},
                                                            {"prompt": "whisper", "suffix": "!"}]},
                        "service": {"inference_service": {"backend": "mock", "mode": "echo"}},
                        "trainer": {"total_train_steps": 2}}, module)
    assert result.summary.global_step == 2 and result.summary.stopped_by == "finished"
    assert len(result.trajectories) == 8 and result.errors == []
    for t in result.trajectories:  # the mock echoes the prompt: the reward is the evaluator's verdict on it
        assert t["reward"] == float(t["task"]["prompt"].endswith("!")) == t["score"]["hit"]
    assert [r["step"] for r in result.metrics if "train/reward_mean" in r] == [1, 2]


def test_run_recipe_refuses_a_bad_recipe_as_nexrl_run_does(tmp_path):
    from nexrl_core.launch.recipe import RecipeProblems

    with pytest.raises(RecipeProblems, match="rollout_worker.evaluator.type: unknown evaluator 'ends_with'"):
        run_recipe({"rollout_worker": {"evaluator": {"type": "ends_with"}}}, str(tmp_path / "run"))


def test_make_recipe_merges_sections_and_write_recipe_loads_as_nexrl_run_does(tmp_path):
    from nexrl_core.launch.recipe import load_recipe

    recipe = make_recipe(trainer={"total_train_steps": 3}, rollout_worker={"evaluator": {"type": "exact_match"}},
                         service={"inference_service": {"backend": "mock", "mode": "echo"}})
    assert recipe["trainer"] == {"type": "mock", "total_train_steps": 3}  # merged key by key
    assert recipe["rollout_worker"] == {"num_workers": 2, "evaluator": {"type": "exact_match"}}  # named: replaced
    assert recipe["service"]["inference_service"] == {"backend": "mock", "mode": "echo"}
    recipe["runtime_monitor"]["stop_timeout"] = 1  # a copy: the kit's constants stay as they are
    assert MOCK_RECIPE["runtime_monitor"] == QUICK_MONITOR and QUICK_MONITOR["stop_timeout"] == 10
    assert make_recipe(None, seed=3) == {"seed": 3}
    cfg = load_recipe(write_recipe({**recipe, "run_dir": str(tmp_path / "run")}, tmp_path / "r.yaml"))
    assert cfg.trainer.total_train_steps == 3 and cfg.service.inference_service.mode == "echo"


# ----------------------------------------------------------------------------- conformance

def _module(name: str, source: str) -> types.ModuleType:
    module = types.ModuleType(name)
    exec(compile(source, f"{name}.py", "exec"), module.__dict__)
    return module


def _ok(**extra):
    return EvaluationRunResult(reward=1.0, **extra)


class Good(Evaluator):
    OPTIONS = {"word": Option("yes", str, "the word that scores")}
    EXAMPLES = [{"data": {"x": 1}, "response": "yes", "reward": 1.0},
                {"data": {"x": 2}, "response": "no", "reward": 0.0}]

    def __init__(self, word="yes"):
        self.word = word

    def evaluate(self, data, evaluation_target):
        hit = self.word in evaluation_target.final_answer
        return EvaluationRunResult(reward=float(hit), ground_truth=self.word, metrics={"hit": float(hit)})


class RaisesOnEmpty(Good):
    def evaluate(self, data, evaluation_target):
        if not evaluation_target.final_answer.strip():
            raise ValueError("nothing to parse")
        return super().evaluate(data, evaluation_target)


class ReturnsDict(Good):
    def evaluate(self, data, evaluation_target):
        return {"reward": 1.0}


class NanAndBadMetric(Good):
    def evaluate(self, data, evaluation_target):
        return EvaluationRunResult(reward=math.nan, metrics={"hit": "yes"}, ground_truth=3)


class Mutates(Good):
    def evaluate(self, data, evaluation_target):
        data["seen"] = True
        return super().evaluate(data, evaluation_target)


class Unpicklable(Good):
    def evaluate(self, data, evaluation_target):
        return _ok(extra_info={"parse": lambda s: s})


class WrongExample(Good):
    EXAMPLES = [{"data": {}, "response": "yes", "reward": 0.5}]


class SharedState(Evaluator):
    """Remembers the answer on the class: right one call at a time, wrong in parallel threads."""

    EXAMPLES = [{"data": {"answer": str(i)}, "response": str(i), "reward": 1.0} for i in range(6)]
    current = None

    def evaluate(self, data, evaluation_target):
        SharedState.current = data.get("answer")
        time.sleep(0.002)
        return EvaluationRunResult(reward=float(evaluation_target.final_answer == SharedState.current))


class BadDefault(Good):
    OPTIONS = {"threshold": Option("high", float, "a number with a text default")}


class NeedsService(Evaluator):
    def __init__(self, service: dict):
        self.service = service

    def evaluate(self, data, evaluation_target):
        return _ok()


PROBLEMS = {  # evaluator -> a text every one of its problems... at least one problem line holds
    RaisesOnEmpty: "an empty reply (data of EXAMPLES[0]): evaluate raised ValueError: nothing to parse "
                   "(tests/core/test_testing_kit.py:",
    ReturnsDict: "EXAMPLES[0]: evaluate returned dict, expected nexrl_core.EvaluationRunResult",
    NanAndBadMetric: "EXAMPLES[0]: reward nan is not a finite number",
    Mutates: "EXAMPLES[0]: evaluate changed the data item it was given",
    Unpicklable: "EXAMPLES[0]: extra_info does not pickle",
    WrongExample: "EXAMPLES[0]: reward 1.0, the example expects 0.5",
    SharedState: "with one instance per thread in 4 threads at once, rewards differ from the sequential ones",
    BadDefault: "OPTIONS['threshold']: expected a number, got a string ('high') (the declared default fails its "
                "own declaration)",
}


def test_a_conforming_evaluator_passes():
    report = check_evaluator(Good)
    assert report.ok and report.problems == [], report.text()
    assert report.calls > 2 * (2 + 7)  # examples and odd replies, twice, then in threads
    assert report.text().startswith("evaluator Good: ok (")


@pytest.mark.parametrize("cls", list(PROBLEMS), ids=lambda c: c.__name__)
def test_each_misbehaviour_is_a_problem_line(cls):
    report = check_evaluator(cls)
    assert not report.ok
    assert any(PROBLEMS[cls] in p for p in report.problems), report.text()


def test_nan_reward_and_bad_metric_and_ground_truth_each_named():
    problems = check_evaluator(NanAndBadMetric).problems
    assert "EXAMPLES[0]: metric 'hit' is 'yes', not a finite number" in problems
    assert "EXAMPLES[0]: ground_truth is int, expected str" in problems


def test_options_are_checked_as_validate_checks_them_and_missing_ones_skip():
    assert check_evaluator(Good, options={"word": "no"}).problems == [
        "EXAMPLES[0]: reward 0.0, the example expects 1.0", "EXAMPLES[1]: reward 1.0, the example expects 0.0"]
    assert check_evaluator(Good, options={"wrod": "x"}).problems == [
        "options.wrod: unknown key; did you mean 'options.word'?"]
    report = check_evaluator(NeedsService)
    assert report.skipped == "needs options service: give them (nexrl plugins check NAME service=...) or in its " \
                             "EXAMPLES" and not report.ok and report.problems == []
    assert check_evaluator(NeedsService, options={"service": {"url": "x"}}).ok


def test_without_examples_generic_data_is_used_and_noted():
    class NoExamples(Evaluator):
        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult(reward=float(evaluation_target.final_answer == str(data["answer"])))

    report = check_evaluator(NoExamples)
    assert report.ok and "declares no EXAMPLES" in report.notes[0]

    class ReadsOtherData(Evaluator):
        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult(reward=float(len(data["test_cases"])))

    report = check_evaluator(ReadsOtherData)
    assert report.problems[-1] == "the generic sample data does not suit this evaluator: declare EXAMPLES"


# ----------------------------------------------------------------------------- nexrl plugins check

BAD_PLUGIN = '''
from nexrl_core import EvaluationRunResult, Evaluator, hookimpl


class Fussy(Evaluator):
    def evaluate(self, data, evaluation_target):
        return EvaluationRunResult(reward=1.0 / len(evaluation_target.final_answer))


@hookimpl
def nexrl_evaluators():
    return {"fussy": Fussy}
'''


def test_nexrl_plugins_check(nexrl_plugins, capfd, tmp_path):
    good, bad = _module("kit_plugin_good", PLUGIN), _module("kit_plugin_bad", BAD_PLUGIN)
    nexrl_plugins(good, bad)
    assert main(["plugins", "check", "kit_plugin_good"]) == 0
    out = capfd.readouterr().out
    assert out.startswith("evaluator 'ends_with' ((in-process)): ok (")

    assert main(["plugins", "check", "fussy"]) == 1
    out = capfd.readouterr().out
    assert out.splitlines()[:2] == [
        "evaluator 'fussy' ((in-process)): FAILED (1 problem)",
        "  problem: an empty reply (data of sample[0]): evaluate raised ZeroDivisionError: float division by zero "
        "(kit_plugin_bad.py:7 in evaluate); a reply it cannot use should score (e.g. 0), not fail the sample"]

    assert main(["plugins", "check", "fussy", "--json"]) == 1
    [report] = json.loads(capfd.readouterr().out)
    assert report["component"] == "evaluator 'fussy' ((in-process))" and not report["ok"]

    # options of one evaluator; a python reward needs its file
    reward = tmp_path / "r.py"
    reward.write_text("def score(response, data, bonus=0):\n    return float(response.strip() == str(data['answer']))"
                      " + bonus\n")
    assert main(["plugins", "check", "python"]) == 0
    assert "skipped: needs options path" in capfd.readouterr().out
    assert main(["plugins", "check", "python", f"path={reward}", "kwargs={bonus: 0.5}"]) == 0
    assert "evaluator 'python' (nexrl-core" in capfd.readouterr().out
    assert main(["plugins", "check", "python", f"path={reward}", "kwargs.bonsu=1"]) == 1
    assert "got an unexpected keyword argument 'bonsu'" in capfd.readouterr().out

    assert main(["plugins", "check", "no-such-plugin"]) == 2
    assert "error: 'no-such-plugin' is neither an installed plugin" in capfd.readouterr().err
    assert main(["plugins", "check", "nexrl-core", "a=1"]) == 2
    assert "key=value options apply to one evaluator" in capfd.readouterr().err


def test_nexrl_plugins_check_on_the_core(core_pm, capfd):
    assert main(["plugins", "check", "nexrl-core"]) == 0
    out = capfd.readouterr().out
    assert "evaluator 'exact_match' (nexrl-core" in out and "evaluator 'numeric_answer' (nexrl-core" in out
    assert "trainer 'mock' (nexrl-core 0.1.0): ok (option declarations)" in out
    assert "FAILED" not in out
