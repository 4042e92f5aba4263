"""A component's section: what it reads is declared (typed settings, the core's keys and its own,
defaults filled, its own copy), every documented key overrides plainly, and the effective configuration
(with where each value came from) is visible."""

from __future__ import annotations

import ast
import inspect
import pickle
import subprocess
import sys
import textwrap

import pytest
import yaml

from nexrl_core import BaseRolloutWorker, ConfigError, Option, hookimpl
from nexrl_core.cli.docgen import SECTIONS, flatten_options
from nexrl_core.config.schema import CORE_OPTIONS, RolloutWorkerSettings, TrajectoryPoolSettings
from nexrl_core.config.settings import Section, read_section
from nexrl_core.launch.recipe import declared_options, effective_options, load_recipe
from nexrl_core.plugins import PluginManager, use_plugin_manager
from nexrl_core.testing import run_recipe

# -- the section a component reads ------------------------------------------------------------------

ROLLOUT_WORKER, TRAJECTORY_POOL = RolloutWorkerSettings.options(), TrajectoryPoolSettings.options()


def test_declared_defaults_are_filled_in_the_components_own_copy():
    recipe = {"batch_size": 8, "key_list": ["uid"]}
    cfg = read_section(recipe, TRAJECTORY_POOL, "trajectory_pool")
    assert cfg["batch_size"] == 8
    assert cfg["group_size"] == TRAJECTORY_POOL["group_size"].default == 4  # the declaration, not a fallback
    assert cfg["dynamic_sampling"]["max_replacements"] == 3 and isinstance(cfg["dynamic_sampling"], Section)
    cfg["key_list"].append("x")
    cfg["dynamic_sampling"]["enabled"] = True
    assert recipe == {"batch_size": 8, "key_list": ["uid"]}  # a copy: the recipe is unchanged
    assert read_section(recipe, TRAJECTORY_POOL, "trajectory_pool")["dynamic_sampling"]["enabled"] is False


def test_a_key_the_section_lacks_is_named_where_it_lives():
    cfg = read_section({"batch_size": 8}, TRAJECTORY_POOL, "trajectory_pool")
    with pytest.raises(KeyError, match="trajectory_pool.batch_sise: not in the section"):
        cfg["batch_sise"]
    with pytest.raises(KeyError, match="trajectory_pool.dynamic_sampling.enable: not in the section"):
        cfg["dynamic_sampling"]["enable"]
    assert cfg.get("batch_sise") is None and "batch_sise" not in cfg  # a mapping still
    with pytest.raises(KeyError, match="^'seed: not in the section"):
        read_section({}, {}, "")["seed"]  # the recipe's root: the key alone
    # as attributes too (components written against NexRL's DictConfig read cfg.key)
    assert cfg.batch_size == 8 and cfg.dynamic_sampling.max_replacements == 3
    with pytest.raises(AttributeError, match="trajectory_pool.dynamic_sampling.enable: not in the section"):
        cfg.dynamic_sampling.enable  # noqa: B018
    data = read_section({"path": "rows.jsonl"}, {"path": Option(None, str)}, "data")
    assert data.path == "rows.jsonl"  # a key named path, not the section's own place


def test_a_hand_built_section_gets_the_seed_the_composed_recipe_would():
    """``seed: ${seed}`` cannot be interpolated in a section built by hand: it is the root seed's
    declared default, as in a composed recipe that sets neither; other references stay null."""
    root = CORE_OPTIONS["seed"].default
    assert isinstance(root, int) and ROLLOUT_WORKER["seed"].default == "${seed}"
    assert read_section({}, ROLLOUT_WORKER, "rollout_worker")["seed"] == root
    assert RolloutWorkerSettings.own({}, "rollout_worker").seed == root  # the typed reading agrees
    assert read_section({"seed": 5}, ROLLOUT_WORKER, "rollout_worker")["seed"] == 5
    assert read_section({}, {"path": Option("${run_dir}/x", (str, None))}, "")["path"] is None
    loader = PluginManager(load_entrypoints=False).resolve("dataloader", "inline", "data")
    section = {"type": "inline", "rows": [{"prompt": "a"}]}
    assert loader.own_section(section)["seed"] == root  # data.seed: ${seed}
    assert loader.own_section(section, is_validate=True)["seed"] == 0  # not shuffled: declared 0


def test_a_section_that_is_not_a_mapping_is_an_error_naming_it():
    with pytest.raises(ConfigError, match="rollout_worker: expected a mapping, got list"):
        read_section([1, 2], ROLLOUT_WORKER, "rollout_worker")  # type: ignore[arg-type]


def test_a_section_pickles_for_ray_actors():
    cfg = read_section({"batch_size": 8, "group_size": 2}, TRAJECTORY_POOL, "trajectory_pool")
    back = pickle.loads(pickle.dumps(cfg))
    assert isinstance(back, Section) and back == cfg and back.to_dict() == cfg.to_dict()
    assert type(back.to_dict()["dynamic_sampling"]) is dict  # plain data, for a library that wants it
    with pytest.raises(KeyError, match="trajectory_pool.dynamic_sampling.nope"):
        back["dynamic_sampling"]["nope"]


class _Greeter(BaseRolloutWorker):
    OPTIONS = {"greeting": Option("hi", str, "declared")}

    def step(self, task):  # pragma: no cover - never reached
        return None


def test_a_component_reads_its_class_declaration_and_the_cores_typed():
    worker = _Greeter({"type": "x", "tasks_per_call": 2})
    assert worker._config["greeting"] == "hi"
    assert worker._config["num_workers"] == ROLLOUT_WORKER["num_workers"].default
    assert isinstance(worker.core_settings, RolloutWorkerSettings) and worker.core_settings.tasks_per_call == 2
    with pytest.raises(ConfigError, match="rollout_worker.num_workers: expected a positive integer, got 0"):
        _Greeter({"type": "x", "num_workers": 0})  # a bad core value, even in a section built by hand


class _ReadsUndeclared(BaseRolloutWorker):
    OPTIONS = {"greeting": Option("hi", str, "declared")}

    def __init__(self, config, parts=None):
        super().__init__(config, parts)
        self.greeting = self._config["greeting"]
        self.other = self._config["not_declared_anywhere"]

    def step(self, task):  # pragma: no cover - never reached
        return None


class _ReaderPlugin:
    @staticmethod
    @hookimpl
    def nexrl_rollout_workers():
        return {"reads_undeclared": _ReadsUndeclared}


def test_a_component_reading_an_undeclared_key_fails_naming_it():
    with pytest.raises(KeyError, match="rollout_worker.not_declared_anywhere: not in the section"):
        _ReadsUndeclared({"type": "reads_undeclared"})


def test_a_run_whose_component_reads_an_undeclared_key_stops_with_the_key(tmp_path):
    with pytest.raises(Exception) as info:
        run_recipe({"rollout_worker": {"type": "reads_undeclared"}}, str(tmp_path / "run"), _ReaderPlugin())
    assert "rollout_worker.not_declared_anywhere" in str(info.value)


def test_a_mock_run_reads_only_declared_keys(tmp_path):
    """Every core component reads declared keys (the static checks below): the run finishes."""
    result = run_recipe({"trainer": {"total_train_steps": 2}}, str(tmp_path / "run"))
    assert [r["step"] for r in result.metrics if "train/reward_mean" in r] == [1, 2]


# -- static check: what components read is declared ------------------------------------------------

_CONFIG_NAMES = {"config", "cfg", "section", "self._config", "self.config", "self._full_config", "logger_section",
                 "dynamic", "own"}


def _reads(cls: type) -> set[str]:
    """String keys a class's own methods read from a config-like name (``x["k"]``, ``x.get("k")``)."""
    out: set[str] = set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("check_config", "check_recipe", "declared_domains"):
            node.body = []  # class-level checks read raw sections, not the bound one
    for node in ast.walk(tree):
        target, key = None, None
        if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            target, key = node.value, node.slice.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and node.args and isinstance(node.args[0], ast.Constant):
            target, key = node.func.value, node.args[0].value
        if target is not None and isinstance(key, str) and ast.unparse(target) in _CONFIG_NAMES:
            out.add(key)
    return out


def _fallback_reads(cls: type) -> set[str]:
    """``x.get("k", fallback)`` on a config-like name in a class's own methods (checks of raw sections excepted)."""
    out: set[str] = set()
    tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name in ("check_config", "check_recipe", "declared_domains"):
            node.body = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                and ast.unparse(node.func.value) in _CONFIG_NAMES:
            out.add(f"{ast.unparse(node.func.value)}.get({node.args[0].value!r}, {ast.unparse(node.args[1])})")
    return out


_KNOWN_FALLBACKS: set[str] = set()  # none: every component reads its declared section


def test_components_re_default_nothing():
    """A default is written once, in the declaration: no ``config.get(key, fallback)`` in a component."""
    from nexrl_core import (
        BaseDataLoader,
        BaseRolloutWorker,
        BaseTrainer,
        InferenceClient,
        TrajectoryPool,
        TrajectoryPoolInstance,
        Validator,
        WeightSyncController,
    )

    pm = PluginManager()
    classes = {BaseDataLoader, BaseRolloutWorker, BaseTrainer, InferenceClient, TrajectoryPool, TrajectoryPoolInstance,
               Validator, WeightSyncController}
    for kind in ("dataloader", "rollout_worker", "trainer", "inference_backend", "weight_sync_backend",
                 "train_service", "metrics_sink"):
        for reg in pm.components(kind).values():
            classes |= {k for k in reg.cls.__mro__ if k.__module__.split(".")[0].startswith("nexrl")}
    found = {c.__qualname__: sorted(_fallback_reads(c)) for c in classes if c.__qualname__ not in _KNOWN_FALLBACKS}
    assert not {k: v for k, v in found.items() if v}


def _all_keys(options) -> set[str]:
    return {part for key, _ in flatten_options(options) for part in key.split(".")}


@pytest.mark.parametrize("kind, core", [("rollout_worker", ROLLOUT_WORKER), ("dataloader", CORE_OPTIONS["data"].options),
                                        ("inference_backend", CORE_OPTIONS["service"].options["inference_service"].options),
                                        ("weight_sync_backend", CORE_OPTIONS["weight"].options)])
def test_every_key_a_registered_component_reads_is_declared(kind, core):
    pm = PluginManager()
    missing = {}
    extra = {"seed", "shuffle", "group_size", "batch_groups"} if kind == "dataloader" else set()
    for name, reg in pm.components(kind).items():
        own = declared_options(kind, reg.cls)
        if own is None:
            continue
        declared = _all_keys({**own, **core}) | extra
        for klass in reg.cls.__mro__:
            if klass.__module__.split(".")[0] in ("nexrl_core", reg.cls.__module__.split(".")[0]) \
                    and klass is not object:
                bad = _reads(klass) - declared
                if bad:
                    missing[f"{name} ({klass.__name__})"] = sorted(bad)
    assert not missing, missing


def test_the_trainers_read_only_declared_keys():
    pm = PluginManager()
    missing = {}
    for name, reg in pm.components("trainer").items():
        values = {"trainer": {"type": name}}
        declared = _all_keys(effective_options(values, pm))
        for klass in reg.cls.__mro__:
            if klass.__module__.startswith(("nexrl_core.trainer", reg.cls.__module__)):
                bad = _reads(klass) - declared
                if bad:
                    missing[f"{name} ({klass.__name__})"] = sorted(bad)
    assert not missing, missing


# -- #31.1: every documented key overrides plainly ------------------------------------------------------

def _value(opt: Option) -> str:
    default = opt.default_value()
    if isinstance(default, str) and "${" not in default:
        return "'" + default.replace("'", "\\'") + "'"
    return yaml.safe_dump(default, default_flow_style=True, width=1 << 20).strip().removesuffix("\n...").strip() \
        if default is not None else "null"


def _documented_overrides() -> list[tuple[str, list[str], str]]:
    """(key, overrides, value) for every key docs/recipe.md lists (from the same declarations),
    with the selections that make it apply."""
    from nexrl_core.algorithms.registry import AlgorithmRegistry

    pm = _PM
    cases: list[tuple[str, list[str], str]] = []

    def add(prefix: str, options, select: list[str]) -> None:
        for key, opt in flatten_options(options, prefix):
            if "<name>" in key or opt.required or opt.options is not None or key in ("recipe_dir",):
                continue
            cases.append((key, [*select, f"{key}={_value(opt)}"], _value(opt)))

    add("", {k: v for k, v in CORE_OPTIONS.items() if k != "recipe_dir"}, [])
    for kind, (section, _) in SECTIONS.items():
        for name, reg in sorted(pm.components(kind).items()):
            own = declared_options(kind, reg.cls) or {}
            if kind == "metrics_sink":
                add(f"logger.{name}.", own, [f"logger.backend=[{name}]"])
            elif kind == "train_service":
                trainers = [t for t, r in pm.components("trainer").items()
                            if getattr(r.cls, "TRAIN_SERVICE_BATCH_FORMAT", None) == getattr(reg.cls, "BATCH_FORMAT", 0)]
                if trainers:
                    add(f"{section}.", own, [f"trainer.type={sorted(trainers)[0]}", f"{section}.backend={name}"])
            else:
                selector = "backend" if kind in ("weight_sync_backend", "inference_backend") else "type"
                add(f"{section}.", {k: v for k, v in own.items() if k != selector}, [f"{section}.{selector}={name}"])
            if kind == "trainer":
                algorithm = getattr(reg.cls, "ALGORITHM_OPTIONS", None) or {}
                add("algorithm.", algorithm, [f"trainer.type={name}"])
    registry = AlgorithmRegistry.from_plugin_manager(pm)
    grpo = "self_hosted_grpo" if "self_hosted_grpo" in pm.components("trainer") else None
    if grpo:
        for kind, selector in (("advantage_estimator", "type"), ("policy_loss", "policy_loss")):
            for name in registry.names(kind):
                fn = registry.get(kind, name, "")
                add("algorithm.", fn.declared(), [f"trainer.type={grpo}", f"algorithm.{selector}={name}"])
        cls = pm.components("trainer")[grpo].cls
        for need, options in (getattr(cls, "ALGORITHM_INPUTS", None) or {}).items():
            needing = [n for n in registry.names("advantage_estimator")
                       if need in registry.get("advantage_estimator", n, "").requires]
            if needing:
                add("algorithm.", options, [f"trainer.type={grpo}", f"algorithm.type={needing[0]}"])
    return cases


_PM = PluginManager()
_CASES = _documented_overrides()


def test_the_documented_keys_include_those_the_issue_names():
    keys = {key for key, _, _ in _CASES}
    assert {"algorithm.rollout_correction.enabled", "algorithm.clip_ratio_low", "algorithm.critic.lr",
            "rollout_worker.sampling.top_k", "trajectory_pool.batch_size"} <= keys


def test_every_documented_key_overrides_with_plain_key_value(tmp_path):
    """Every key set to its default, as ``key=value``: one load per selection for all its keys (set
    to their defaults, they cannot act on each other); a selection whose load fails is loaded again
    key by key, to name the keys that fail."""
    from omegaconf import OmegaConf

    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer: {type: mock}\n")

    def load(overrides: list[str]):
        with use_plugin_manager(_PM):  # every installed plugin, whatever an earlier test made the default
            return load_recipe(str(recipe), overrides)

    selections: dict[tuple[str, ...], list[tuple[str, str, str]]] = {}
    for key, overrides, value in _CASES:
        selections.setdefault(tuple(overrides[:-1]), []).append((key, overrides[-1], value))
    failed = {}
    for select, cases in selections.items():
        try:
            loaded = [(load([*select, *(override for _, override, _ in cases)]), cases)]
        except ConfigError:
            loaded = []
            for case in cases:
                try:
                    loaded.append((load([*select, case[1]]), [case]))
                except ConfigError as exc:
                    failed[case[0]] = str(exc)
        for cfg, checked in loaded:
            for key, override, value in checked:
                got = OmegaConf.select(cfg, key)
                got = OmegaConf.to_container(got) if OmegaConf.is_config(got) else got
                want = value[1:-1].replace("\\'", "'") if value.startswith("'") else yaml.safe_load(value)
                if want != got and "${" not in value:
                    failed[key] = f"{[*select, override]}: {got!r}"
    assert not failed, failed


# -- #31.2: the effective configuration -----------------------------------------------------------------

def _nexrl(*args, cwd):
    return subprocess.run([sys.executable, "-m", "nexrl_core.cli", *args], capture_output=True, text=True, cwd=cwd)


def test_nexrl_config_shows_component_defaults_and_sources(tmp_path):
    (tmp_path / "recipe.yaml").write_text(textwrap.dedent("""\
        trainer: {type: mock, total_train_steps: 3}
        data: {type: inline, rows: [{prompt: "1 + 1", answer: "2"}]}
        service: {inference_service: {backend: mock, mode: sum}}
    """))
    out = _nexrl("config", "recipe.yaml", "service.inference_service.learn_steps=7", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    cfg = yaml.safe_load(out.stdout)
    assert cfg["trainer"]["step_time_s"] == 0.0  # the mock trainer's own default, which the recipe omits
    assert cfg["service"]["inference_service"]["delay_s"] == 0.0
    assert cfg["service"]["inference_service"]["learn_steps"] == 7
    assert cfg["rollout_worker"]["sampling"]["top_k"] == 0  # the simple worker's sampling defaults
    out = _nexrl("config", "recipe.yaml", "service.inference_service.learn_steps=7", "--sources", cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    lines = {line.strip().split(":")[0]: line for line in out.stdout.splitlines() if "#" in line}
    assert lines["total_train_steps"].endswith("# recipe recipe.yaml")
    assert lines["step_time_s"].endswith("# default")
    assert lines["learn_steps"].endswith("# override 'service.inference_service.learn_steps=7'")
    assert any(line.strip() == "mode: sum  # recipe recipe.yaml" for line in out.stdout.splitlines())
    assert yaml.safe_load(out.stdout) == cfg  # still the same recipe


def test_run_dir_config_yaml_holds_the_component_defaults(tmp_path):
    from nexrl_core.runtime.run_info import write_config  # what `nexrl run` writes

    (tmp_path / "recipe.yaml").write_text("trainer: {type: mock}\n")
    write_config(str(tmp_path / "run"), load_recipe(str(tmp_path / "recipe.yaml")))
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["trainer"]["step_time_s"] == 0.0
    assert saved["rollout_worker"]["sampling"]["max_tokens"] == 64


def test_group_defaults_compose_and_a_bad_selection_still_reports(tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text("trainer: {type: mock}\n")
    with pytest.raises(ConfigError, match="does not exist"):
        load_recipe(str(recipe), ["trainer.no_such_key=1"])
    # an unknown component: nothing to fill, the checks name it
    cfg = load_recipe(str(recipe), ["trainer.type=no_such_trainer"])
    assert cfg.trainer.type == "no_such_trainer"
