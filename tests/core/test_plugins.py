"""Plugin discovery through real entry points (an installed ``.dist-info`` on sys.path), the
``NEXRL_LOAD_PLUGINS`` filter, failure reporting, conflicts, bad registrations, the
``nexrl plugins`` command, torch-free import, and a third-party evaluator used in a real run."""

from __future__ import annotations

import contextlib
import importlib
import importlib.metadata as md
import json
import os
import subprocess
import sys
import uuid

import pytest

import nexrl_core
from nexrl_core.algorithms import ALGORITHM_KINDS
from nexrl_core.builtins import DEFAULT_PLUGINS
from nexrl_core.errors import ConfigError, PluginError
from nexrl_core.plugins import CORE_DISTRIBUTION, KINDS, PluginManager

TRAINER_PLUGIN = """
from nexrl_core import hookimpl
from nexrl_core.trainer import BaseTrainer


class {cls}(BaseTrainer):
    def train(self, trajectories):
        return {{}}


@hookimpl
def nexrl_trainers():
    return {{"{name}": {cls}}}
"""


def _mod() -> str:
    """A module name no other test (or earlier import) has used."""
    return f"nxt_{uuid.uuid4().hex[:10]}"


def _trainer_dist(write_dist, root, dist, trainer_name, cls="DemoTrainer", ep_name=None):
    mod = _mod()
    write_dist(root, dist, {ep_name or dist.replace("-", "_"): mod},
               {mod: TRAINER_PLUGIN.format(cls=cls, name=trainer_name)})
    return mod


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A fresh 'site-packages' on sys.path; only the distributions written into it may load."""
    root = tmp_path / "site"
    root.mkdir()
    monkeypatch.syspath_prepend(str(root))
    monkeypatch.delenv("NEXRL_LOAD_PLUGINS", raising=False)
    return root


@contextlib.contextmanager
def _only_site_plugins(monkeypatch, site):
    """Hide the sys.path entries holding other installed nexrl plugins (e.g. nexrl-grpo, which
    would import torch), so that 'load everything' means the distributions in ``site``."""
    others = set()
    for dist in md.distributions():
        if dist.name != CORE_DISTRIBUTION and any(ep.group == "nexrl" for ep in dist.entry_points):
            others.add(os.path.realpath(str(dist.locate_file(""))))
    others.discard(os.path.realpath(str(site)))
    with monkeypatch.context() as m:
        m.setattr(sys, "path", [p for p in sys.path if os.path.realpath(p or ".") not in others])
        yield


def _only(monkeypatch, *dists: str) -> None:
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", ",".join(dists))


# ----------------------------------------------------------------------------- discovery


def test_entry_point_plugin_is_discovered_and_its_components_resolve(site, write_dist, monkeypatch):
    mod = _trainer_dist(write_dist, site, "nexrl-demo", "demo_trainer", ep_name="demo")
    _only(monkeypatch, "nexrl-demo")
    pm = PluginManager()

    cls = pm.resolve("trainer", "demo_trainer", "trainer.type")
    assert cls.__module__ == mod and cls.__name__ == "DemoTrainer"
    reg = pm.components("trainer")["demo_trainer"]
    assert reg.distribution == "nexrl-demo" and reg.plugin == "demo"
    # the built-ins are still there, attributed to nexrl-core
    assert pm.components("trainer")["mock"].distribution == CORE_DISTRIBUTION
    described = {p["name"]: p for p in pm.describe()}
    assert described["demo"]["distribution"] == "nexrl-demo"
    assert described["demo"]["version"] == "0.1.0"
    assert described["demo"]["hooks"] == ["nexrl_trainers"]
    assert described["demo"]["components"] == {"trainer": ["demo_trainer"]}
    assert not pm.failures and not pm.bad_registrations


def test_load_plugins_env_restricts_autoloading(site, write_dist, monkeypatch):
    _trainer_dist(write_dist, site, "nexrl-alpha", "alpha_trainer")
    _trainer_dist(write_dist, site, "nexrl-beta", "beta_trainer")

    monkeypatch.delenv("NEXRL_LOAD_PLUGINS", raising=False)  # unset: every installed plugin loads
    with _only_site_plugins(monkeypatch, site):
        names = set(PluginManager().components("trainer"))
    assert {"alpha_trainer", "beta_trainer", "mock"} <= names

    _only(monkeypatch, "nexrl-alpha")
    names = set(PluginManager().components("trainer"))
    assert "alpha_trainer" in names and "beta_trainer" not in names

    _only(monkeypatch, "nexrl-beta", "nexrl-alpha")
    names = set(PluginManager().components("trainer"))
    assert {"alpha_trainer", "beta_trainer"} <= names

    _only(monkeypatch)  # NEXRL_LOAD_PLUGINS="" : no plugin at all, only the core's built-ins
    pm = PluginManager()
    assert set(pm.records) == {name for name, _ in DEFAULT_PLUGINS}
    assert set(pm.components("trainer")) == {"mock"}


def test_plugin_whose_import_fails_is_reported_and_others_still_load(site, write_dist, monkeypatch):
    broken = _mod()
    write_dist(site, "nexrl-broken", {"broken": broken},
               {broken: "raise ImportError('needs the frobnicate package')\n"})
    _trainer_dist(write_dist, site, "nexrl-good", "good_trainer")
    _only(monkeypatch, "nexrl-broken", "nexrl-good")

    pm = PluginManager()
    assert "good_trainer" in pm.components("trainer")
    assert len(pm.failures) == 1
    failure = pm.failures[0]
    assert failure.name == "broken"
    assert failure.distribution == "nexrl-broken"
    assert "ImportError" in failure.error and "needs the frobnicate package" in failure.error
    # a recipe naming a missing component learns about the broken plugin too
    with pytest.raises(ConfigError) as info:
        pm.resolve("trainer", "frob", "trainer.type")
    assert "nexrl-broken" in str(info.value) and "frobnicate" in str(info.value)


def test_two_distributions_registering_one_name_is_an_error_naming_both(site, write_dist, monkeypatch):
    _trainer_dist(write_dist, site, "nexrl-first", "twin", cls="FirstTwin")
    _trainer_dist(write_dist, site, "nexrl-second", "twin", cls="SecondTwin")
    _only(monkeypatch, "nexrl-first", "nexrl-second")

    pm = PluginManager()
    with pytest.raises(PluginError) as info:
        pm.resolve("trainer", "twin", "trainer.type")
    message = str(info.value)
    assert "nexrl-first" in message and "nexrl-second" in message and "'twin'" in message


def test_same_name_for_different_kinds_is_fine(site, write_dist, monkeypatch):
    mod = _mod()
    write_dist(site, "nexrl-both", {"both": mod}, {mod: """
        from nexrl_core import hookimpl, Evaluator, EvaluationRunResult
        from nexrl_core.trainer import BaseTrainer

        class T(BaseTrainer):
            def train(self, trajectories):
                return {}

        class E(Evaluator):
            def evaluate(self, data, evaluation_target):
                return EvaluationRunResult()

        @hookimpl
        def nexrl_trainers():
            return {"shared": T}

        @hookimpl
        def nexrl_evaluators():
            return {"shared": E}
    """})
    _only(monkeypatch, "nexrl-both")
    pm = PluginManager()
    assert pm.resolve("trainer", "shared", "k").__name__ == "T"
    assert pm.resolve("evaluator", "shared", "k").__name__ == "E"


def test_bad_registrations_are_reported_and_skipped(site, write_dist, monkeypatch):
    mod = _mod()
    write_dist(site, "nexrl-sloppy", {"sloppy": mod}, {mod: """
        from nexrl_core import hookimpl
        from nexrl_core.trainer import BaseTrainer

        class Good(BaseTrainer):
            def train(self, trajectories):
                return {}

        class NotATrainer:
            pass

        @hookimpl
        def nexrl_trainers():
            return {"good": Good, "instance": Good.__new__(Good), "text": "a.b:C", "wrongbase": NotATrainer}

        @hookimpl
        def nexrl_evaluators():
            return [Good]

        @hookimpl
        def nexrl_dataloaders():
            raise RuntimeError("boom while registering")
    """})
    _only(monkeypatch, "nexrl-sloppy")
    pm = PluginManager()

    trainers = pm.components("trainer")
    assert "good" in trainers
    assert not {"instance", "text", "wrongbase"} & set(trainers)
    pm.components("evaluator")
    assert set(pm.components("dataloader")) == set(_builtin_names("nexrl_dataloaders"))  # built-ins survive
    bad = "\n".join(pm.bad_registrations)
    for name in ("'instance'", "'text'", "'wrongbase'"):
        assert name in bad
    assert "nexrl-sloppy" in bad
    assert "not a subclass of BaseTrainer" in bad
    assert "nexrl_evaluators() returned list" in bad
    assert "nexrl_dataloaders() raised RuntimeError: boom while registering" in bad
    with pytest.raises(ConfigError):
        pm.resolve("trainer", "wrongbase", "trainer.type")


LAZY_PLUGIN = """
from nexrl_core import Lazy, hookimpl


@hookimpl
def nexrl_trainers():
    return {{"lazy": Lazy("{impl}:LazyTrainer"), "missing": Lazy("{impl}_gone:LazyTrainer"),
            "wrongbase": Lazy("{impl}:NotATrainer"), "no_path": Lazy("{impl}")}}


@hookimpl
def nexrl_advantage_estimators():
    return {{"lazy_adv": Lazy("{impl}:scaled"), "missing_adv": Lazy("{impl}_gone:scaled")}}
"""

LAZY_IMPL = """
from nexrl_core.trainer import BaseTrainer


class LazyTrainer(BaseTrainer):
    def train(self, trajectories):
        return {}


class NotATrainer:
    pass


def scaled(data, *, scale: float = 2.0):
    return data, data
"""


def test_a_lazy_registration_is_imported_when_selected_and_checked_then(site, write_dist, monkeypatch):
    from nexrl_core.algorithms import AlgorithmRegistry

    mod = _mod()
    impl = f"{mod}_impl"
    write_dist(site, "nexrl-lazy", {"lazy": mod}, {mod: LAZY_PLUGIN.format(impl=impl), impl: LAZY_IMPL})
    _only(monkeypatch, "nexrl-lazy")
    pm = PluginManager()

    trainers = pm.components("trainer")
    assert {"lazy", "missing", "wrongbase"} <= set(trainers) and "no_path" not in trainers
    assert "not a 'module:attribute' path" in "\n".join(pm.bad_registrations)
    assert impl not in sys.modules  # listed by name, nothing imported
    cls = pm.resolve("trainer", "lazy", "trainer.type")
    assert cls.__name__ == "LazyTrainer" and cls.__module__ == impl
    with pytest.raises(PluginError, match=r"^plugin 'lazy' \(nexrl-lazy\) registers trainer 'missing' as "
                                          r"Lazy\(path='nxt_\w+_gone:LazyTrainer'\), which failed to import: "
                                          r"ModuleNotFoundError"):
        pm.resolve("trainer", "missing", "trainer.type")
    with pytest.raises(PluginError, match="registers trainer 'wrongbase' .*, which is not a subclass of BaseTrainer"):
        pm.resolve("trainer", "wrongbase", "trainer.type")

    registry = AlgorithmRegistry.from_plugin_manager(pm)
    assert registry.get("advantage_estimator", "lazy_adv", "algorithm.type").options == {"scale": 2.0}
    with pytest.raises(ConfigError, match=r"^algorithm.type: plugin 'lazy' \(nexrl-lazy\) registers "
                                          r"advantage_estimator 'missing_adv' .*, which failed to import"):
        registry.get("advantage_estimator", "missing_adv", "algorithm.type")

    # what `nexrl plugins` lists: every registration imported, the broken ones reported instead
    (described,) = [p for p in pm.describe() if p["name"] == "lazy"]
    assert described["components"] == {"trainer": ["lazy"], "advantage_estimator": ["lazy_adv"]}
    bad = "\n".join(pm.bad_registrations)
    assert all(f"'{name}'" in bad for name in ("missing", "wrongbase", "no_path", "missing_adv"))


def test_resolve_unknown_name_lists_available_names_with_distribution(core_pm):
    with pytest.raises(ConfigError) as info:
        core_pm.resolve("trainer", "mokc", "trainer.type")
    message = str(info.value)
    assert message.startswith("trainer.type: unknown trainer 'mokc'")
    assert "'mock' (nexrl-core)" in message
    assert "Did you mean 'mock'?" in message
    with pytest.raises(ConfigError) as info:
        core_pm.resolve("evaluator", "nope", "rollout_worker.evaluator.type")
    assert "'exact_match' (nexrl-core)" in str(info.value) and "'numeric_answer' (nexrl-core)" in str(info.value)


def test_in_process_register_and_plugin_name_clash(core_pm):
    from nexrl_core import EvaluationRunResult, Evaluator, hookimpl

    class Mine(Evaluator):
        def evaluate(self, data, evaluation_target):
            return EvaluationRunResult(reward=1.0)

    class Plugin:
        @hookimpl
        def nexrl_evaluators(self):
            return {"mine": Mine}

    core_pm.register(Plugin(), name="mine-plugin")
    assert core_pm.resolve("evaluator", "mine", "k") is Mine
    with pytest.raises(PluginError, match="mine-plugin"):
        core_pm.register(Plugin(), name="mine-plugin")


# ----------------------------------------------------------------------------- subprocesses


def _subprocess_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env.update(extra)
    return env


def test_plugins_json_lists_the_core_builtins():
    proc = subprocess.run([sys.executable, "-m", "nexrl_core.cli", "plugins", "--json"], capture_output=True,
                          text=True, env=_subprocess_env(NEXRL_LOAD_PLUGINS=""), timeout=60)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    core = [p for p in data["plugins"] if p["distribution"] == CORE_DISTRIBUTION]
    assert [p["name"] for p in core] == [name for name, _ in DEFAULT_PLUGINS]
    # expected: exactly what the built-in hooks return, kind by kind
    expected, listed = {}, {}
    for kind, hook in [*((k, h) for k, (h, _) in KINDS.items()), *ALGORITHM_KINDS.items()]:
        names = sorted(_builtin_names(hook))
        if names:
            expected[kind] = names
        got = sorted(n for p in core for n in p["components"].get(kind, []))
        if got:
            listed[kind] = got
    assert listed == expected
    assert {p["version"] for p in core} == {nexrl_core_version()}
    # Every hook of the core's own kinds; the core registers estimators, while losses need torch and
    # a train service holds a model (torch, or a remote API's): both come from plugins.
    assert {h for p in core for h in p["hooks"]} == {hook for hook, _ in KINDS.values()} - {
        "nexrl_train_services"} | {"nexrl_advantage_estimators"}
    assert listed["advantage_estimator"] == ["dr_grpo", "gae", "grpo", "reinforce_plus_plus", "rloo"]
    assert data["failed"] == [] and data["bad_registrations"] == []
    assert "Traceback" not in proc.stderr


def _builtin_names(hook: str) -> list[str]:
    """Every name the core's default plugins register through ``hook``."""
    names: list[str] = []
    for _, module_path in DEFAULT_PLUGINS:
        module = importlib.import_module(module_path)
        if hasattr(module, hook):
            names += list(getattr(module, hook)())
    return names


def test_a_broken_builtin_is_reported_and_the_other_builtins_still_load(monkeypatch):
    import nexrl_core.plugins as plugins

    monkeypatch.setattr(plugins, "DEFAULT_PLUGINS",
                        (("core.broken", "nexrl_core.builtins.no_such_module"),) + DEFAULT_PLUGINS)
    monkeypatch.setenv("NEXRL_LOAD_PLUGINS", "")
    pm = PluginManager()
    assert [(f.name, f.distribution) for f in pm.failures] == [("core.broken", CORE_DISTRIBUTION)]
    assert "ModuleNotFoundError" in pm.failures[0].error
    assert set(pm.components("dataloader")) == set(_builtin_names("nexrl_dataloaders"))
    assert "mock" in pm.components("trainer")


def nexrl_core_version() -> str:
    return md.version("nexrl-core")


def test_importing_nexrl_core_does_not_import_heavy_packages():
    code = ("import sys, nexrl_core, nexrl_core.cli, nexrl_core.launch.recipe, nexrl_core.controller\n"
            "from nexrl_core.plugins import PluginManager\n"
            "pm = PluginManager(); [pm.components(k) for k in ('trainer', 'evaluator', 'inference_backend')]\n"
            "print(sorted(m for m in ('torch', 'transformers', 'vllm', 'ray') if m in sys.modules))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=_subprocess_env(NEXRL_LOAD_PLUGINS=""), timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"
    assert "Evaluator" in nexrl_core.__all__  # the contract's names are exported


# ----------------------------------------------------------------------------- third-party evaluator

EVALUATOR_PACKAGE = """
from nexrl_core import BaseEvaluationTarget, EvaluationRunResult, Evaluator, hookimpl


class EchoLengthEvaluator(Evaluator):
    '''Reward ``scale`` when the answer repeats the prompt; metric: answer length.'''

    def __init__(self, scale: float = 1.0, prompt_key: str = "prompt"):
        self.scale = scale
        self.prompt_key = prompt_key

    def evaluate(self, data, evaluation_target: BaseEvaluationTarget) -> EvaluationRunResult:
        same = evaluation_target.final_answer == data[self.prompt_key]
        return EvaluationRunResult(reward=self.scale * float(same), ground_truth=data[self.prompt_key],
                                   metrics={"chars": float(len(evaluation_target.final_answer))})


@hookimpl
def nexrl_evaluators():
    return {"echo_length": EchoLengthEvaluator}
"""


def test_third_party_evaluator_package_is_used_by_a_real_run(site, write_dist, monkeypatch, run_local, tmp_path):
    mod = _mod()
    write_dist(site, "nexrl-echo-eval", {"echo_eval": mod}, {mod: EVALUATOR_PACKAGE})
    _only(monkeypatch, "nexrl-echo-eval")
    pm = PluginManager()
    prompts = ["alpha", "bb", "ccc", "dddd"]
    val_prompts = ["x", "yyyyy", "zz"]
    controller, summary = run_local({
        "data": {"type": "inline", "rows": [{"prompt": p} for p in prompts]},
        "validate": {"validate_before_train": True,
                     "data": {"type": "inline", "rows": [{"prompt": p} for p in val_prompts]}},
        "rollout_worker": {"num_workers": 2, "evaluator": {"type": "echo_length", "scale": 0.25}},
        "trajectory_pool": {"batch_size": 4, "group_size": 2},
        "trainer": {"type": "mock", "total_train_steps": 2},
        "service": {"inference_service": {"backend": "mock", "mode": "echo"}},
    }, pm=pm)

    assert type(controller.rollout_workers[0]._evaluator).__module__ == mod
    assert controller.rollout_workers[0]._evaluator.scale == 0.25
    assert summary.global_step == 2 and summary.stopped_by == "finished"
    val = summary.validation[0]
    assert val["val/reward"] == 0.25
    assert val["val/chars"] == pytest.approx(sum(map(len, val_prompts)) / len(val_prompts))
    assert val["val/num_samples"] == 3.0
    for batch in controller.trainer.batches:
        assert [t["reward"] for t in batch] == [0.25] * 4
        assert all(t["score"]["chars"] == len(t["task"]["prompt"]) for t in batch)
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/reward_mean"] for r in rows if "train/reward_mean" in r] == [0.25, 0.25]


def test_unknown_evaluator_option_names_the_accepted_ones(site, write_dist, monkeypatch, tmp_path):
    from nexrl_core.launch.recipe import check_config, load_recipe

    mod = _mod()
    write_dist(site, "nexrl-echo-eval", {"echo_eval": mod}, {mod: EVALUATOR_PACKAGE})
    _only(monkeypatch, "nexrl-echo-eval")
    recipe = tmp_path / "r.yaml"
    recipe.write_text("data: {type: inline, rows: [{prompt: a}]}\n"
                      "trainer: {type: mock}\nservice: {inference_service: {backend: mock}}\n"
                      "rollout_worker: {evaluator: {type: echo_length, scael: 2.0}}\n")
    problems = check_config(load_recipe(str(recipe)), PluginManager())
    assert len(problems) == 1
    assert problems[0].startswith("rollout_worker.evaluator.scael: unknown key; did you mean "
                                  "'rollout_worker.evaluator.scale'?")
    assert "accepts: scale, prompt_key" in problems[0]
