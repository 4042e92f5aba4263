"""Recipe loading: defaults + recipe YAML + Hydra-style overrides, then strict checking.

Every problem is collected and reported as one line naming the key, so
``nexrl validate`` can print them all and ``nexrl run`` can refuse to start.
"""

from __future__ import annotations

import inspect
import os
from difflib import get_close_matches
from typing import Any

import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from .algorithms.registry import algorithm_keys
from .errors import ConfigError, NexRLError
from .launch import launch_mode_problem

DEFAULTS_PATH = os.path.join(os.path.dirname(__file__), "defaults.yaml")

# Sections owned by the core: their keys are exactly the defaults' keys.
STRICT_SECTIONS = ("trajectory_pool", "weight", "validate", "resume", "logger", "runtime_monitor")
RESUME_MODES = ("disable", "auto", "from_path")
ERROR_POLICIES = ("stop_on_error", "stop_on_critical", "continue")


def load_recipe(path: str, overrides: list[str] | None = None) -> DictConfig:
    """Defaults <- recipe file <- overrides; interpolations resolved. Raises ConfigError."""
    if not os.path.isfile(path):
        raise ConfigError(f"{path}: recipe file not found")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else path
        raise ConfigError(f"{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys, got {type(raw).__name__}")
    raw.pop("defaults", None)  # Hydra composition lists are not used: defaults come from the core
    cfg = OmegaConf.merge(OmegaConf.load(DEFAULTS_PATH), _to_omegaconf(raw, path))
    _apply_overrides(cfg, overrides or [])
    recipe_dir = os.path.dirname(os.path.abspath(path))
    try:
        resolved = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{getattr(exc, 'full_key', '') or path}: cannot resolve interpolation "
                          f"({str(exc.msg).splitlines()[0]})") from None
    resolved.recipe_dir = recipe_dir  # relative paths stay relative to the working directory
    return resolved


def _to_omegaconf(raw: dict, path: str) -> DictConfig:
    try:
        return OmegaConf.create(raw)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {exc}") from None


def _apply_overrides(cfg: DictConfig, overrides: list[str]) -> None:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except HydraException as exc:
            raise ConfigError(f"override '{text}': {str(exc).splitlines()[0]}") from None
        key = ov.key_or_group
        if ov.is_delete():
            _delete(cfg, key, text)
            continue
        value = ov.value()
        value = _plain_value(value)
        if not ov.is_add() and OmegaConf.select(cfg, key, throw_on_missing=False) is None and not _has_key(cfg, key):
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            raise ConfigError(f"override '{text}': key '{key}' does not exist{_suggest(cfg, key)}; "
                              f"use '+{text}' to add a new key{' under ' + parent if parent else ''}")
        OmegaConf.update(cfg, key, value, merge=True, force_add=True)


def _plain_value(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain_value(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain_value(v) for v in value]
    return value


def _has_key(cfg: DictConfig, dotted: str) -> bool:
    node: Any = cfg
    for part in dotted.split("."):
        if not isinstance(node, DictConfig) or part not in node:
            return False
        node = node._get_node(part)
    return True


def _delete(cfg: DictConfig, key: str, text: str) -> None:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if not isinstance(parent, DictConfig) or leaf not in parent:
        raise ConfigError(f"override '{text}': key '{key}' does not exist")
    del parent[leaf]


def _suggest(cfg: DictConfig, key: str) -> str:
    parent_key, _, leaf = key.rpartition(".")
    parent = OmegaConf.select(cfg, parent_key) if parent_key else cfg
    if isinstance(parent, DictConfig):
        hit = get_close_matches(leaf, [str(k) for k in parent.keys()], n=1)
        if hit:
            return f" (did you mean '{(parent_key + '.') if parent_key else ''}{hit[0]}'?)"
    return ""


# -- strict checking -------------------------------------------------------------------

def check_config(cfg: DictConfig, plugin_manager: Any) -> list[str]:
    """Every problem in ``cfg`` as one line each (empty list: the recipe is sound)."""
    problems: list[str] = []
    defaults = OmegaConf.create(OmegaConf.to_container(OmegaConf.load(DEFAULTS_PATH), resolve=True))
    top_allowed = set(defaults.keys()) | {"recipe_dir"}
    for key in cfg.keys():
        if key not in top_allowed:
            problems.append(_unknown(str(key), "", top_allowed))
    # The weight-sync backend declares its own keys of the `weight` section (CONFIG_KEYS).
    weight_backend = _resolve_quietly(plugin_manager, "weight_sync_backend", cfg.weight.get("backend")) \
        if isinstance(cfg.get("weight"), DictConfig) else None
    for name in STRICT_SECTIONS:
        allowed = defaults[name]
        if name == "weight" and weight_backend is not None:
            allowed = OmegaConf.merge(allowed, OmegaConf.create(dict(getattr(weight_backend, "CONFIG_KEYS", {}) or {})))
        problems += _check_keys(cfg.get(name), allowed, name)
    launch_problem = launch_mode_problem(cfg.get("launch_mode"))
    if launch_problem is not None:
        problems.append(launch_problem)
    problems += _check_choice(cfg, "resume.mode", RESUME_MODES)
    problems += _check_choice(cfg, "runtime_monitor.exception_handling.policy", ERROR_POLICIES)
    if cfg.resume.mode == "from_path" and not cfg.resume.resume_path:
        problems.append("resume.resume_path: required when resume.mode is 'from_path'")
    problems += _check_positive_int(cfg, "trajectory_pool.batch_size")
    problems += _check_positive_int(cfg, "trajectory_pool.group_size")
    problems += _check_positive_int(cfg, "rollout_worker.num_workers")
    problems += _check_positive_int(cfg, "trainer.total_train_steps")
    limit = cfg.weight.get("rollout_limit")
    if limit is not None and limit != "batch" and not (isinstance(limit, int) and not isinstance(limit, bool)
                                                       and limit >= 1):
        problems.append(f"weight.rollout_limit: expected null, 'batch' or a positive integer, got {limit!r}")
    tp = cfg.trajectory_pool
    if isinstance(tp.get("batch_size"), int) and isinstance(tp.get("group_size"), int) and tp.group_size > 0 \
            and tp.batch_size % tp.group_size:
        problems.append(f"trajectory_pool.batch_size ({tp.batch_size}) must be a multiple of "
                        f"trajectory_pool.group_size ({tp.group_size}) so groups are never split across batches")
    if tp.get("group_size", 1) > 1 and not tp.get("key_list"):
        problems.append("trajectory_pool.key_list: groups of more than one trajectory need a grouping key "
                        "(e.g. [uid])")

    def component(kind: str, section: Any, key: str, extra_defaults: dict | None = None) -> type | None:
        if section is None:
            return None
        type_key = "backend" if kind in ("inference_backend",) else "type"
        name = section.get(type_key)
        try:
            cls = plugin_manager.resolve(kind, name, f"{key}.{type_key}")
        except NexRLError as exc:
            problems.append(str(exc))
            return None
        allowed = dict(extra_defaults or {})
        allowed.update(getattr(cls, "CONFIG_KEYS", {}) or {})
        allowed[type_key] = name
        key_problems = _check_keys(section, OmegaConf.create(allowed), key, strict_nested=False)
        problems.extend(key_problems)
        if not key_problems:
            problems.extend(_component_check(cls, section, key))
        return cls

    component("dataloader", cfg.data, "data", _section_defaults(defaults.data, "path", "prompt_key",
                                                                 "dataset_paths", "rows"))
    if cfg.validate.get("data") is not None:
        component("dataloader", cfg.validate.data, "validate.data",
                  _section_defaults(defaults.data, "path", "prompt_key", "dataset_paths", "rows"))
    worker_defaults = dict(OmegaConf.to_container(defaults.rollout_worker))
    component("rollout_worker", cfg.rollout_worker, "rollout_worker", worker_defaults)
    ev = cfg.rollout_worker.get("evaluator")
    if ev is not None:
        problems += _check_evaluator(ev, plugin_manager)
    trainer_cls = component("trainer", cfg.trainer, "trainer", dict(OmegaConf.to_container(defaults.trainer)))
    if trainer_cls is not None:
        # The trainer's own keys plus those of the estimator / loss the recipe selects.
        algo_keys, algo_problems = algorithm_keys(trainer_cls, cfg.algorithm, plugin_manager)
        problems += algo_problems
        problems += _check_keys(cfg.algorithm, OmegaConf.create(algo_keys), "algorithm")
        ts_keys = getattr(trainer_cls, "TRAIN_SERVICE_KEYS", {}) or {}
        problems += _check_keys(cfg.service.train_service, OmegaConf.create(dict(ts_keys)), "service.train_service",
                                strict_nested=False)
    component("inference_backend", cfg.service.inference_service, "service.inference_service",
              {"model_tag": "default"})
    try:
        plugin_manager.resolve("weight_sync_backend", cfg.weight.backend, "weight.backend")
    except NexRLError as exc:
        problems.append(str(exc))
    else:
        problems.extend(_component_check(weight_backend, cfg.weight, "weight"))
    sinks = cfg.logger.backend
    for sink in [sinks] if isinstance(sinks, str) else list(sinks or []):
        try:
            plugin_manager.resolve("metrics_sink", sink, "logger.backend")
        except NexRLError as exc:
            problems.append(str(exc))
    for key in (set(cfg.service.keys()) - {"train_service", "inference_service"}):
        problems.append(_unknown(str(key), "service", {"train_service", "inference_service"}))
    return problems


def _resolve_quietly(plugin_manager: Any, kind: str, name: Any) -> type | None:
    try:
        return plugin_manager.resolve(kind, name, kind)
    except NexRLError:
        return None


def _component_check(cls: type | None, section: Any, key: str) -> list[str]:
    """A component's own value checks: ``cls.check_config(section, key)`` returns problem lines
    (each naming ``key.<option>``), so `nexrl validate` finds what the constructor would reject."""
    check = getattr(cls, "check_config", None)
    if cls is None or not callable(check):
        return []
    return [str(p) for p in check(section, key) or []]


def _section_defaults(section: Any, *extra: str) -> dict:
    out = dict(OmegaConf.to_container(section))
    for key in extra:
        out.setdefault(key, None)
    return out


def _check_evaluator(ev: Any, pm: Any) -> list[str]:
    if not isinstance(ev, DictConfig):
        return [f"rollout_worker.evaluator: expected a mapping with a 'type' key, got {ev!r}"]
    try:
        cls = pm.resolve("evaluator", ev.get("type"), "rollout_worker.evaluator.type")
    except NexRLError as exc:
        return [str(exc)]
    params = inspect.signature(cls.__init__).parameters
    takes_any = any(p.kind == p.VAR_KEYWORD for p in params.values())
    accepted = [n for n in params if n not in ("self",)]
    problems = []
    for key in ev.keys():
        if key != "type" and not takes_any and key not in accepted:
            problems.append(_unknown(str(key), "rollout_worker.evaluator", set(accepted),
                                     f" (evaluator '{ev.type}' accepts: {', '.join(accepted) or 'no options'})"))
    return problems


def _check_keys(section: Any, allowed: Any, path: str, strict_nested: bool = True) -> list[str]:
    if section is None:
        return []
    if not isinstance(section, DictConfig):
        return [f"{path}: expected a mapping, got {_type_name(section)}"]
    problems = []
    allowed_keys = set(allowed.keys()) if isinstance(allowed, DictConfig) else set()
    for key in section.keys():
        key = str(key)
        if key not in allowed_keys:
            problems.append(_unknown(key, path, allowed_keys))
            continue
        default = allowed[key]
        value = section[key]
        problems += _check_type(value, default, f"{path}.{key}")
        if strict_nested and isinstance(default, DictConfig) and len(default) and isinstance(value, DictConfig):
            problems += _check_keys(value, default, f"{path}.{key}")
    return problems


def _check_type(value: Any, default: Any, key: str) -> list[str]:
    if default is None or value is None:
        return []
    ok = True
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, (ListConfig, list)):
        ok = isinstance(value, (ListConfig, list, str)) if key.endswith("logger.backend") else \
            isinstance(value, (ListConfig, list))
    elif isinstance(default, (DictConfig, dict)):
        ok = isinstance(value, (DictConfig, dict))
    if ok:
        return []
    return [f"{key}: expected {_type_name(default)}, got {_type_name(value)} ({value!r})"]


def _type_name(value: Any) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int):
        return "an integer"
    if isinstance(value, float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, (ListConfig, list)):
        return "a list"
    if isinstance(value, (DictConfig, dict)):
        return "a mapping"
    return type(value).__name__


def _unknown(key: str, path: str, allowed: set, tail: str = "") -> str:
    full = f"{path}.{key}" if path else key
    hit = get_close_matches(key, sorted(allowed), n=1)
    hint = f"; did you mean '{(path + '.') if path else ''}{hit[0]}'?" if hit else ""
    return f"{full}: unknown key{hint}{tail}"


def _check_choice(cfg: DictConfig, key: str, choices: tuple[str, ...]) -> list[str]:
    value = OmegaConf.select(cfg, key)
    if value not in choices:
        return [f"{key}: '{value}' is not one of {', '.join(choices)}"]
    return []


def _check_positive_int(cfg: DictConfig, key: str) -> list[str]:
    value = OmegaConf.select(cfg, key)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return []
    return [f"{key}: expected a positive integer, got {value!r}"]


def require_valid(cfg: DictConfig, plugin_manager: Any) -> None:
    problems = check_config(cfg, plugin_manager)
    if problems:
        raise ConfigError("the recipe has problems:\n  - " + "\n  - ".join(problems))
