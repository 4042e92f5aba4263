"""Recipe loading (core defaults <- composed recipe <- overrides) and strict checking.

Every key of a recipe is declared somewhere (:mod:`nexrl_core.config.schema` for the core's keys, a
component's ``OPTIONS`` for its own) and every problem is one line naming the key, so
``nexrl validate`` can print them all and ``nexrl run`` refuses to start with the same lines:
both call :func:`check_config` (and :mod:`nexrl_core.launch.preflight` for data, run directory and
resume state).
"""

from __future__ import annotations

import copy
import inspect
import os
from collections.abc import Mapping
from dataclasses import replace
from difflib import get_close_matches
from typing import Any, cast

import yaml
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ..config.options import (
    Check,
    Option,
    check_options,
    component_capabilities,
    component_options,
    options_from_signature,
    type_name,
    unmet_needs,
)
from ..config.schema import CORE_OPTIONS, core_defaults
from ..config.settings import fill_defaults, plain
from ..errors import ConfigError, NexRLError
from ..redaction import add_config_secrets, add_secret, is_secret_key
from ..runtime.python_class import KINDS as PYTHON_KINDS
from ..runtime.python_class import PythonClassSettings, loads_from_file
from ..types import lookup
from .compose import Composer, GroupOverride, deep_merge, read_yaml_file

# kind -> words for messages
KIND_WORDS = {"dataloader": "data loader", "rollout_worker": "rollout worker", "evaluator": "evaluator",
              "trainer": "trainer", "weight_sync_backend": "weight-sync backend",
              "inference_backend": "inference backend", "metrics_sink": "metrics sink",
              "train_service": "train service"}


class RecipeProblems(ConfigError):
    """A recipe with one or more problems; ``problems`` holds one line each."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__(problems[0] if len(problems) == 1 else
                         f"{len(problems)} problems:\n  - " + "\n  - ".join(problems))


# -- loading ---------------------------------------------------------------------------------

def load_recipe(path: str, overrides: list[str] | None = None, raw: Any = None,
                sources: dict[str, str] | None = None) -> DictConfig:
    """Defaults (the core's and those of the components the recipe selects) <- recipe (with its
    defaults list) <- overrides; interpolations resolved. ``raw``: the recipe's content, not yet
    written to ``path`` (which still places it). The values of keys named like secrets are
    remembered (:mod:`nexrl_core.redaction`) first, so no message, file or console line shows
    them, even one about a bad override. ``sources``, when given, receives where each value came
    from: dotted key -> ``default``, ``recipe <file>`` or ``override '<text>'`` (a key not listed
    takes the source of its nearest listed parent)."""
    from ..plugins import peek_plugin_manager

    pm = peek_plugin_manager()
    for text in overrides or []:
        key, sep, value = text.partition("=")
        if sep and is_secret_key(key.rsplit(".", 1)[-1]):
            add_secret(value.strip().strip("'\""))
    if raw is None:
        if not os.path.exists(path):
            raise ConfigError(f"{path}: recipe file not found")
        raw = read_yaml_file(path)
    if raw is None or raw == {}:
        raise ConfigError(f"{path}: the recipe is empty (recipes/quickstart.yaml is a complete example)")
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: a recipe must be a mapping of keys, got {type(raw).__name__}")
    composer = Composer(path, [])
    group_overrides, value_overrides = _parse_overrides(overrides or [], composer)
    composer.overrides = group_overrides
    recipe: Any = {}
    layers = composer.layers(raw)
    for layer in layers:
        recipe = deep_merge(recipe, layer)
    for _, ov in value_overrides:  # `section={}`: the section as its defaults (merging {} would keep the recipe's)
        parent, leaf = _parent(recipe, ov.key_or_group)
        if not ov.is_delete() and ov.value() == {} and isinstance(parent, dict):
            parent.pop(leaf, None)
    recipe_dir = os.path.dirname(os.path.abspath(path))
    resolve_recipe_paths(recipe, recipe_dir, pm)
    values = deep_merge(core_defaults(), recipe)
    # The selected components' defaults go in too, so each of their keys overrides plainly; an
    # override may change the selection (trainer.type=...), so it is applied once, leniently, to learn it.
    probe = copy.deepcopy(values)
    _apply_overrides(probe, value_overrides, strict=False)
    declared = effective_options(probe, pm)
    fill_defaults(values, declared)
    _apply_overrides(values, value_overrides, declared=declared)
    if sources is not None:
        sources.clear()
        sources[""] = "default"
        for layer, where in zip(layers, composer.layer_files, strict=True):
            _mark(sources, layer, "", f"recipe {_shown_path(where)}")
        for text, ov in value_overrides:  # a mapping set on the command line replaces what was below it
            _mark(sources, None, ov.key_or_group, f"override '{text}'")
    # a section an override brought whose default is null (validate.data) gets its defaults too
    fill_defaults(values, declared)
    # Set before resolving, so a recipe can name files next to it: ${recipe_dir}/data/train.jsonl
    values["recipe_dir"] = recipe_dir
    try:
        resolved = OmegaConf.to_container(_create(values, path), resolve=True)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{getattr(exc, 'full_key', '') or path}: cannot resolve interpolation "
                          f"({str(exc.msg).splitlines()[0]})") from None
    add_config_secrets(resolved)
    return _create(resolved, path)


def resolve_recipe_paths(values: Any, recipe_dir: str, pm: Any = None, options: Mapping[str, Option] | None = None) -> None:
    """In place: each relative path a recipe names (options declared ``path=True``, the core's and
    the selected components') becomes the path next to the recipe when that file or folder exists
    there; otherwise it is left as written (relative to the current folder, or a name such as a
    model id). Values with an interpolation are left alone."""
    if not isinstance(values, dict):
        return
    if options is None:
        from ..plugins import peek_plugin_manager

        for kind in PYTHON_KINDS:  # a class loaded from a file: its file first, the class's own keys next
            if loads_from_file(kind, values.get(kind)) and isinstance(values[kind].get("path"), str):
                values[kind]["path"] = _recipe_path(values[kind]["path"], recipe_dir)
        options = effective_options(values, pm or peek_plugin_manager())
    for key, value in list(values.items()):
        opt = options.get(str(key))
        if opt is not None and opt.path:
            values[key] = _recipe_path(value, recipe_dir)
        elif opt is not None and opt.options is not None:
            resolve_recipe_paths(value, recipe_dir, options=opt.options)


def _recipe_path(value: Any, recipe_dir: str) -> Any:
    if isinstance(value, list):
        return [_recipe_path(v, recipe_dir) for v in value]
    if not isinstance(value, str) or not value or os.path.isabs(value) or "${" in value or value.startswith("~"):
        return value
    candidate = os.path.normpath(os.path.join(recipe_dir, value))
    if os.path.exists(candidate):
        return candidate
    file, sep, name = value.rpartition(":")  # 'rewards.py:accuracy': a function of a file (reward_funcs)
    if sep and file.endswith(".py") and os.path.isfile(os.path.join(recipe_dir, file)):
        return f"{os.path.normpath(os.path.join(recipe_dir, file))}:{name}"
    return value


def _select(opt: Option, values: Any, pm: Any, path: str) -> type | str:
    """The registered class the component section ``values`` at ``path`` selects, or why none is
    (one resolution for both walks: the options in effect and the checks)."""
    assert opt.options is not None and opt.component is not None
    section = _mapping(values)
    try:
        return cast(type, pm.resolve_section(opt.component, section, path, opt.selector,
                                             section.get(opt.selector, opt.options[opt.selector].default_value())))
    except NexRLError as exc:
        return str(exc)


def _own_options(kind: str, cls: type, section: Mapping[str, Any]) -> dict[str, Option] | None:
    """The keys a component class accepts beside the core's (None: any, ``**kwargs``); a class
    loaded from a file (``type: python``) also takes the keys that name it."""
    own = declared_options(kind, cls)
    return {**PythonClassSettings.options(), **(own or {})} if loads_from_file(kind, section) else own


# -- the declarations of a recipe, with its selections ------------------------------------------------------

def effective_options(values: Any, pm: Any) -> dict[str, Option]:
    """The options of the recipe ``values`` (plain dicts): the core's, with each selected
    component's own merged into its section, and the trainer's ``algorithm`` and
    ``service.train_service`` keys. An unknown component adds nothing (the checks report it)."""
    from ..algorithms.registry import algorithm_keys

    values = _mapping(values)
    out = _effective(values, _core_options(values, pm)[0], pm)  # with logger.<sink>
    trainer_cls = _select(CORE_OPTIONS["trainer"], values.get("trainer"), pm, "trainer")
    if isinstance(trainer_cls, str):
        return out
    algorithm, service = _mapping(values.get("algorithm")), _mapping(lookup(values, "service.train_service"))
    try:
        declared = algorithm_keys(trainer_cls, algorithm, pm, lookup(values, "trainer.type"))[0]
        out["algorithm"] = replace(out["algorithm"], options=_effective(algorithm, declared, pm, "algorithm."))
    except NexRLError:
        pass  # the checks report it
    try:
        declared = _train_service_declared(service, trainer_cls, pm)[0]
        inner = dict(out["service"].options or {})
        inner["train_service"] = replace(inner["train_service"],
                                         options=_effective(service, declared, pm, "service.train_service."))
        out["service"] = replace(out["service"], options=inner)
    except NexRLError:
        pass
    return out


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _effective(values: Any, options: Mapping[str, Option], pm: Any, prefix: str = "") -> dict[str, Option]:
    return {key: _effective_option(_mapping(values).get(key), opt, pm, prefix + key) for key, opt in options.items()}


def _effective_option(value: Any, opt: Option, pm: Any, path: str) -> Option:
    if not isinstance(value, Mapping):
        return opt
    if opt.component is not None and opt.options is not None:
        cls = _select(opt, value, pm, path)
        if not isinstance(cls, str):
            own = _own_options(opt.component, cls, value)
            if own is None:  # **kwargs: any key
                return replace(opt, options=None, values=None, type=dict)
            opt = replace(opt, options={**own, **dict(opt.options)})
    if opt.options is not None:
        return replace(opt, options=_effective(value, opt.options, pm, path + "."))
    if opt.values is not None:
        # a mapping of named entries, each resolved on its own (a domain's evaluator); options
        # holds the entries present, values any other
        entries = {str(k): _effective_option(v, opt.values, pm, f"{path}.{k}") for k, v in value.items()}
        return replace(opt, options=entries)
    return opt


def _mark(sources: dict[str, str], layer: Any, prefix: str, label: str) -> None:
    """Every key ``layer`` sets (a mapping's leaves; a null or a list as a whole) came from ``label``."""
    if isinstance(layer, dict) and layer:
        for key, value in layer.items():
            _mark(sources, value, f"{prefix}.{key}" if prefix else str(key), label)
    elif prefix:
        sources[prefix] = label
        for key in [k for k in sources if k.startswith(prefix + ".")]:
            del sources[key]


def _shown_path(path: str) -> str:
    rel = os.path.relpath(os.path.abspath(path))
    return path if rel.startswith("..") else rel


def source_of(sources: Mapping[str, str], dotted: str) -> str:
    """Where the value at ``dotted`` came from (its nearest listed key; see :func:`load_recipe`)."""
    key = dotted
    while key:
        if key in sources:
            return sources[key]
        key = key.rpartition(".")[0]
    return sources.get("", "default")


def _create(data: Any, path: str) -> DictConfig:
    try:
        return OmegaConf.create(data)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from None


def _parse_overrides(overrides: list[str], composer: Composer) -> tuple[list[GroupOverride], list[Any]]:
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    groups: list[GroupOverride] = []
    values: list[Any] = []
    for text in overrides:
        try:
            ov = parser.parse_override(text)
        except HydraException as exc:
            raise ConfigError(f"override '{text}': {str(exc).splitlines()[0]}") from None
        if ov.is_sweep_override():
            raise ConfigError(f"override '{text}': one value is needed (a sweep, 'a,b' or a range, runs several "
                              f"recipes: run each)")
        key = ov.key_or_group
        if "/" in key or ("." not in key and composer.is_group(key)):
            value = None if ov.is_delete() else ov.value()
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"override '{text}': '{key}' is a config group: give one option name "
                                  f"(available: {', '.join(composer.options(key)) or 'none'})")
            kind = "delete" if value is None else "add" if ov.is_add() else "set"
            groups.append(GroupOverride(text, key, value, kind))
        else:
            values.append((text, ov))
    return groups, values


_ABSENT: Any = object()


def _apply_overrides(values: dict[str, Any], overrides: list[Any], strict: bool = True,
                     declared: Any = None) -> None:
    """In place, on the plain recipe, as OmegaConf.update(merge=True, force_add=True) sets a key: a
    parent that is missing or not a mapping becomes one ('rows.0': an item of a list), a mapping
    merges into a mapping. ``strict=False``: a key that does not exist is added (to learn what the
    overrides select); ``declared``: keys that may be set plainly though absent (under a section
    null by default)."""
    for text, ov in overrides:
        key = ov.key_or_group
        if ov.is_delete():
            _delete(values, key, text)
            continue
        value = ov.value()
        current = lookup(values, key, _ABSENT)
        if strict and not ov.is_add() and not ov.is_force_add() and current is _ABSENT and \
                not (declared and _option_at(key, declared, named=True)):
            parent = key.rsplit(".", 1)[0] if "." in key else ""
            raise ConfigError(f"override '{text}': key '{key}' does not exist{_suggest(values, key)}; "
                              f"use '+{text}' to add a new key{' under ' + parent if parent else ''}")
        if isinstance(current, dict) and not isinstance(value, dict):
            raise ConfigError(_section_override_message(text, key, value))
        node: Any = values
        parts = key.split(".")
        try:
            for i, part in enumerate(parts):
                slot: Any = int(part) if isinstance(node, list) else part  # 'rows.0': an item of a list
                below = node[slot] if isinstance(node, list) else node.get(slot)
                if i == len(parts) - 1:
                    node[slot] = deep_merge(below, value)
                elif not isinstance(below, (dict, list)):
                    node[slot] = below = {}
                node = below
        except (ValueError, IndexError):  # a list index that is not there
            raise ConfigError(f"override '{text}': key '{key}' does not exist") from None


def _section_override_message(text: str, key: str, value: Any) -> str:
    opt = _option_at(key)
    hint = f"set one of its keys, e.g. {key}.{opt.selector}={value}" if opt is not None and opt.component \
        else "set one of its keys instead (key.subkey=value)"
    return (f"override '{text}': '{key}' is a section, not a value, and there is no config group '{key}' "
            f"(no {key}/{value}.yaml next to the recipe or in nexrl_core/conf); {hint}")


def _option_at(dotted: str, options: Mapping[str, Option] = CORE_OPTIONS, named: bool = False) -> Option | None:
    """The option of the dotted key (``named``: an entry the recipe names, a domain, counts)."""
    opt: Option | None = Option(options=options)
    for part in dotted.split("."):
        assert opt is not None
        opt = (opt.options or {}).get(part) or (opt.values if named else None)
        if opt is None or (named and opt.removed is not None):
            return None
    return opt


def _delete(values: dict[str, Any], key: str, text: str) -> None:
    """``~key``, as Hydra deletes a key: the value the recipe (or an earlier override) gave a key
    nexrl declares is gone, so its declared default applies. A key every run reads that holds its
    default already is switched off: null where it may be null (``~trainer.checkpoint_path``: no
    checkpoints; a section: none), an error naming what to set where it may not."""
    parent, leaf = _parent(values, key)
    if not isinstance(parent, dict) or leaf not in parent:
        raise ConfigError(f"override '{text}': key '{key}' does not exist")
    opt = _option_at(key)
    if opt is None or opt.removed is not None:
        del parent[leaf]
    # the value as written (an interpolation as its text, as the declared default holds it)
    elif opt.options is None and not opt.required and parent[leaf] != opt.default_value():
        parent[leaf] = opt.default_value()
    elif opt.spec().accepts(None):
        parent[leaf] = None
    else:
        default = opt.default_value()
        if opt.options is not None:
            example = f"{key}.<key>=<value>, or {key}={{}} for its defaults"
        elif default is None:
            example = f"{key}=<value>"
        else:
            example = f"{key}={yaml.safe_dump(default, default_flow_style=True, width=1000).strip()}".removesuffix(
                "\n...").strip()
        if default == {}:
            example += " (its defaults)"
        raise ConfigError(f"override '{text}': {key} is needed by every run ({opt.help or 'a core key'}), so it "
                          f"cannot be deleted; set it instead, e.g. {example}")


def _suggest(values: dict[str, Any], key: str) -> str:
    parent, leaf = _parent(values, key)
    hit = get_close_matches(leaf, [str(k) for k in parent], n=1) if isinstance(parent, dict) else []
    return f" (did you mean '{key[:len(key) - len(leaf)]}{hit[0]}'?)" if hit else ""


def _parent(values: dict[str, Any], key: str) -> tuple[Any, str]:
    """The mapping that holds the dotted ``key`` (None when there is none) and its last part."""
    parent_key, _, leaf = key.rpartition(".")
    return (lookup(values, parent_key) if parent_key else values), leaf


# -- checking ------------------------------------------------------------------------------------

def check_config(cfg: Mapping[str, Any], plugin_manager: Any, eval_only: bool = False) -> list[str]:
    """Every problem of the recipe's keys and values, one line each (empty: sound).

    Covers the core's keys, every selected component's declared options, cross-key rules and
    whether the trainer, inference backend and weight-sync backend fit together. Files (data,
    run directory, resume state) are checked by :func:`nexrl_core.launch.preflight.check_files`.
    """
    from .ray.network import plan

    values = plain(cfg)
    found, sinks, problems = _check_keys(values, plugin_manager, eval_only)
    if not isinstance(values, Mapping):
        return problems
    problems += _cross_checks(values)
    problems += _domain_checks(values, found)
    trainer_cls = found.get("trainer")
    if trainer_cls is not None:
        trainer_type = lookup(values, "trainer.type")
        problems += check_algorithm(values.get("algorithm"), trainer_cls, plugin_manager,
                                    str(trainer_type) if trainer_type else None, root=values)
        problems += _check_train_service(values, trainer_cls, plugin_manager)
        problems += _check_reference_service(values, found, plugin_manager)
    for path, cls in found.items():  # each component's rules across sections, the trainer's included
        problems += hook_lines(cls, "check_recipe", path, values)
    if not eval_only:
        problems += check_capabilities(found, values, plugin_manager)
        net = plan(values, found, sinks)
        problems += [net.problem] if net.problem else []
    return problems


def _check_keys(values: Any, pm: Any, eval_only: bool = False) -> tuple[dict[str, type], list[type], list[str]]:
    """The component classes the recipe selects (dotted section -> class), its metrics sinks' classes,
    and the problems of its keys."""
    checker = _Checker(pm, values, eval_only)
    options, sinks, problems = _core_options(values, pm)
    problems += checker.mapping(values, options, "")
    return checker.found, sinks, problems


def network_plan(cfg: Mapping[str, Any], plugin_manager: Any) -> Any:
    """``ray.private_network`` decided for a recipe (:mod:`nexrl_core.launch.ray.network`), as
    :func:`check_config` decides it."""
    from .ray.network import Plan, plan, requested

    values = plain(cfg)
    if not requested(values):
        return Plan()
    found, sinks, _ = _check_keys(values, plugin_manager)
    return plan(values, found, sinks)


def require_valid(cfg: Mapping[str, Any], plugin_manager: Any, eval_only: bool = False) -> None:
    """Raise :class:`RecipeProblems` listing every problem :func:`check_config` finds."""
    problems = check_config(cfg, plugin_manager, eval_only=eval_only)
    if problems:
        raise RecipeProblems(problems)


class _Checker(Check):
    """Walks the recipe against the declared options; remembers the component classes it resolved."""

    def __init__(self, pm: Any, root: Any = None, eval_only: bool = False):
        super().__init__(root if root is not None else {})
        self.pm = pm
        self.eval_only = eval_only  # nexrl eval trains nothing: the recipe need not name a trainer
        self.found: dict[str, type] = {}

    def value(self, value: Any, opt: Option, path: str) -> list[str]:
        if opt.component is not None and isinstance(value, Mapping):
            return self.component(value, opt, path)
        return super().value(value, opt, path)

    def hint(self, path: str, value: Any) -> str:
        return _section_hint(path, value)

    def component(self, values: Mapping[str, Any], opt: Option, path: str) -> list[str]:
        assert opt.options is not None and opt.component is not None
        selector, core = opt.selector, dict(opt.options)
        name = values.get(selector, core[selector].default_value())
        if name is None and core[selector].required:  # mock components are asked for by name
            return [] if self.eval_only and path == "trainer" else self._core_keys(values, core, path)
        cls = _select(opt, values, self.pm, path)
        if isinstance(cls, str):  # why none is selected
            return [cls] + self._core_keys(values, {k: o for k, o in core.items() if k != selector}, path)
        self.found[path] = cls
        own = _own_options(opt.component, cls, values)
        if own is None:  # takes any keys (**kwargs): only the core's are checked
            return self._core_keys(values, core, path)
        problems = self.mapping(values, {**own, **core}, path,
                                owner=f"{KIND_WORDS.get(opt.component, opt.component)} '{name}'",
                                listed=[k for k, o in own.items() if o.removed is None and k not in core])
        return problems or component_check(cls, values, path)

    def _core_keys(self, values: Mapping[str, Any], core: dict[str, Option], path: str) -> list[str]:
        return self.mapping({k: v for k, v in values.items() if k in core}, core, path)


def component_check(cls: type, values: Mapping[str, Any], path: str, hook: str = "check_config") -> list[str]:
    """A component's own rules, run once its declared options are sound:
    ``cls.check_config(section, key) -> ["<key>.<option>: why", ...]`` (the constructor should raise
    the same, so validate and run agree)."""
    return hook_lines(cls, hook, path, dict(values), path)


def hook_lines(cls: type, hook: str, path: str, *args: Any) -> list[str]:
    """The lines ``cls.<hook>(*args)`` returns, optional: a component's own rules (``check_config``,
    above; ``check_recipe(recipe)``, its rules across sections, which must cope with values of the
    wrong type, as the key checks report them) or notes. A hook that raises is one line at ``path``."""
    check = getattr(cls, hook, None)
    if not callable(check):
        return []
    try:
        return [str(p) for p in check(*args) or []]
    except Exception as exc:  # a plugin bug must not hide the recipe's problems behind a traceback
        return [f"{path}: {cls.__name__}.{hook} raised {type(exc).__name__}: {exc}"]


def declared_options(kind: str, cls: type) -> dict[str, Option] | None:
    """The options a component class accepts in its recipe section (None: any)."""
    own = component_options(cls)
    if own is None and kind == "evaluator":
        return options_from_signature(cls.__init__, doc=inspect.getdoc(cls))  # type: ignore[misc]  # the class's own
    return own if own is not None else {}


def _section_hint(path: str, value: Any) -> str:
    opt = _option_at(path) if path else None
    if opt is not None and opt.component and isinstance(value, str):
        return f" ({value!r}); to choose a {KIND_WORDS.get(opt.component, opt.component)} write " \
               f"{path}: {{{opt.selector}: {value}}}"
    if isinstance(value, list):
        return " (a '- item' list where 'key: value' lines belong)"
    if isinstance(value, (str, int, float, bool)):
        return f" ({value!r})"
    return ""


def _core_options(values: Any, pm: Any) -> tuple[dict[str, Option], list[type], list[str]]:
    """The core options, plus a ``logger.<sink>`` section for each chosen sink that declares options;
    the chosen sinks' classes; and the problems of ``logger.backend`` (sinks that are not registered)."""
    options = dict(CORE_OPTIONS)
    logger_section = _mapping(_mapping(values).get("logger"))
    backend = logger_section.get("backend")
    names = [backend] if isinstance(backend, str) else backend if isinstance(backend, list) else []
    logger_options = dict(options["logger"].options or {})
    sinks: list[type] = []
    problems: list[str] = []
    for name in names:
        try:
            cls = pm.resolve("metrics_sink", name, "logger.backend")
        except NexRLError as exc:
            problems.append(str(exc))
            continue
        sinks.append(cls)
        own = component_options(cls)
        if own:
            logger_options[str(name)] = Option(options=own, help=f"options of the {name} metrics sink")
        problems += component_check(cls, _mapping(logger_section.get(str(name))), f"logger.{name}")
    options["logger"] = Option(options=logger_options, help=options["logger"].help)
    return options, sinks, problems


# -- cross-key rules ----------------------------------------------------------------------------------

def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) else None


def _cross_checks(values: Mapping[str, Any]) -> list[str]:
    problems = []
    batch, group = _int(lookup(values, "trajectory_pool.batch_size")), _int(lookup(values, "trajectory_pool.group_size"))
    if batch and group and batch > 0 and group > 0 and batch % group:
        problems.append(f"trajectory_pool.batch_size ({batch}) must be a multiple of trajectory_pool.group_size "
                        f"({group}) so groups are never split across batches")
    if group and group > 1 and lookup(values, "trajectory_pool.key_list") == []:
        problems.append("trajectory_pool.key_list: groups of more than one trajectory need a grouping key "
                        "(e.g. [uid])")
    if lookup(values, "trajectory_pool.dynamic_sampling.enabled") is True and (
            (group is not None and group < 2) or lookup(values, "trajectory_pool.key_list") == []):
        problems.append("trajectory_pool.dynamic_sampling.enabled: drops groups whose rewards are all equal, so it "
                        "needs groups of several samples (group_size > 1 and a key_list)")
    if lookup(values, "overwrite_run_dir") is True and lookup(values, "resume.mode") in ("auto", "from_path"):
        problems.append(f"overwrite_run_dir: applies to a fresh run only (resume.mode: disable); with resume.mode "
                        f"'{lookup(values, 'resume.mode')}' the earlier run is continued, not moved aside")
    workers, actors = _int(lookup(values, "rollout_worker.num_workers")), _int(lookup(values, "rollout_worker.num_actors"))
    if workers and actors and actors > workers > 0:
        problems.append(f"rollout_worker.num_actors ({actors}) exceeds rollout_worker.num_workers ({workers}): "
                        f"every actor hosts at least one worker")
    every = _int(lookup(values, "weight.model_update_frequency"))
    if every and every > 1:
        mode, lag = lookup(values, "weight.sync_mode") or "sync", _int(lookup(values, "weight.staleness_threshold")) or 0
        if mode == "sync" or lag < every:
            problems.append(f"weight.model_update_frequency: pushing weights every {every} steps lets rollouts lag "
                            f"{every} versions behind the trainer: it needs weight.sync_mode batch-async or "
                            f"fully-async with weight.staleness_threshold >= {every} (now: {mode}, {lag})")
    if lookup(values, "resume.mode") == "from_path" and not lookup(values, "resume.resume_path"):
        problems.append("resume.resume_path: required when resume.mode is 'from_path'")
    if isinstance(lookup(values, "validate"), Mapping) and lookup(values, "validate.data") is None:
        if lookup(values, "validate.validate_before_train") is True:
            problems.append("validate.validate_before_train: validation is requested but validate.data is not set "
                            "(add a validation set, or set validate_before_train: false)")
        freq = _int(lookup(values, "weight.validate_freq"))
        if freq and freq > 0:
            problems.append(f"weight.validate_freq: validation every {freq} steps is requested but validate.data is "
                            f"not set (add a validation set, or set validate_freq: 0)")
    return problems


def _declared_domains(found: Mapping[str, type], values: Mapping[str, Any], which: str) -> list[str] | None:
    cls, section = found.get(which), lookup(values, which)
    declared = getattr(cls, "declared_domains", None)
    return declared(section) if declared is not None and isinstance(section, Mapping) else None


def _domain_checks(values: Mapping[str, Any], found: Mapping[str, type]) -> list[str]:
    """Per-domain settings name domains the data has (where the data loader declares them)."""
    train = _declared_domains(found, values, "data")
    val = _declared_domains(found, values, "validate.data")
    problems = []
    both = None if train is None and val is None else list(dict.fromkeys((train or []) + (val or [])))
    checks = (("rollout_worker.domain_evaluators", both), ("rollout_worker.domain_sampling", both),
              ("algorithm.reward_processing.domains", train))
    for key, known in checks:
        section = lookup(values, key)
        if known is None or not isinstance(section, Mapping):
            continue
        for name in section:
            if name not in known:
                hint = get_close_matches(str(name), known, n=1)
                problems.append(f"{key}.{name}: no such domain{f'; did you mean {hint[0]!r}?' if hint else ''} "
                                f"(the data's domains: {', '.join(known) or 'none'})")
    return problems


def check_algorithm(section: Mapping[str, Any] | None, trainer_cls: type, plugin_manager: Any,
                    trainer_name: str | None = None, root: Any = None) -> list[str]:
    """``algorithm``: the trainer's own keys plus those of the estimator and loss the recipe selects
    by name (:func:`nexrl_core.algorithms.algorithm_keys`, which the trainer's selection also uses)."""
    from ..algorithms.registry import algorithm_keys

    section = section if section is not None else {}
    if not isinstance(section, Mapping):
        return [f"algorithm: expected a mapping, got {type_name(section)}"]
    declared, problems = algorithm_keys(trainer_cls, section, plugin_manager, trainer_name)
    key_problems = check_options(section, declared, "algorithm",
                                 owner=f"trainer '{trainer_name or getattr(trainer_cls, '__name__', trainer_cls)}'")
    if not key_problems:
        key_problems = unmet_needs(section, declared, "algorithm", root if root is not None else {"algorithm": section})
    return key_problems + [p for p in problems if p not in key_problems]


def _train_service_declared(section: Mapping[str, Any], trainer_cls: type, plugin_manager: Any,
                            trainer_name: str | None = None) -> tuple[dict[str, Option], type | None]:
    """The keys ``service.train_service`` may hold with this trainer, and the registered train
    service the section selects (None for a trainer that drives none: its own declared keys)."""
    from ..runtime.train_service import train_service_class, train_service_options

    own = component_options(trainer_cls, "TRAIN_SERVICE_OPTIONS") or {}
    if not getattr(trainer_cls, "TRAIN_SERVICE_BATCH_FORMAT", None):
        return own, None
    service_cls = train_service_class(trainer_cls, section, plugin_manager, trainer_name)
    return {**train_service_options(service_cls, trainer_cls), **own}, service_cls


def _check_train_service(values: Mapping[str, Any], trainer_cls: type, plugin_manager: Any) -> list[str]:
    """``service.train_service``: the keys of the train service it selects (a trainer that drives a
    registered one, see :mod:`nexrl_core.runtime.train_service`), or else the trainer's own declared keys."""
    from ..runtime.train_service import SECTION, selected_backend

    section = lookup(values, SECTION, {})
    section = {} if section is None else section
    if not isinstance(section, Mapping):
        return []  # the core's check of the section's type reports it
    try:
        declared, service_cls = _train_service_declared(section, trainer_cls, plugin_manager,
                                                        lookup(values, "trainer.type"))
    except NexRLError as exc:
        return [str(exc)]
    owner = f"train service '{selected_backend(trainer_cls, section)}'" if service_cls is not None else ""
    problems = check_options(section, declared, SECTION, owner=owner) or unmet_needs(section, declared, SECTION, values)
    if not problems and service_cls is not None:
        problems += component_check(service_cls, section, SECTION)
    if not problems:
        problems += component_check(trainer_cls, section, SECTION, "check_train_service")
    return problems


REFERENCE_SECTION = "service.reference_service"


def _check_reference_service(values: Mapping[str, Any], found: Mapping[str, type], pm: Any) -> list[str]:
    """``service.reference_service``: a trainer that takes its KL reference from a service, with
    the keys that make it compute one (its ``REFERENCE_SERVICE_NEEDS``, an ``Option.needs``), and
    a backend that scores given tokens (``InferenceClient.score``)."""
    backend_cls, trainer_cls = found.get(REFERENCE_SECTION), found.get("trainer")
    if backend_cls is None or trainer_cls is None:
        return []  # not set, or its selection is already reported
    needs = getattr(trainer_cls, "REFERENCE_SERVICE_NEEDS", None)
    if not needs:
        return [f"{REFERENCE_SECTION}: trainer '{lookup(values, 'trainer.type')}' computes no KL reference, so the "
                f"service would do nothing (delete {REFERENCE_SECTION})"]
    from ..algorithms.registry import algorithm_keys

    algorithm = dict(_mapping(lookup(values, "algorithm")))
    try:  # the algorithm's keys with their defaults (an estimator's recommended ones: KL in reinforce++'s reward)
        declared, _ = algorithm_keys(trainer_cls, algorithm, pm, lookup(values, "trainer.type"))
    except NexRLError:
        declared = {}
    filled = {k: opt.default_value() for k, opt in declared.items() if opt.removed is None and opt.options is None}
    root = {**values, "algorithm": {**filled, **algorithm}}
    problems = unmet_needs({"reference_service": lookup(values, REFERENCE_SECTION)},
                           {"reference_service": Option(None, (dict, None), needs=needs)}, "service", root)
    if problems:
        return problems
    can_score = getattr(backend_cls, "can_score", None)
    if not callable(can_score) or not can_score():
        return [f"{REFERENCE_SECTION}.backend: inference backend '{lookup(values, REFERENCE_SECTION + '.backend')}' "
                f"cannot score given tokens (InferenceClient.score), which a KL reference needs; choose one that "
                f"can (hf)"]
    return []


# -- do the chosen components fit together? ------------------------------------------------------------

# (section, the key that selects it, kind) of the components whose capabilities must fit together
_ROLES = (("trainer", "trainer.type", "trainer"),
          ("service.inference_service", "service.inference_service.backend", "inference_backend"),
          ("weight", "weight.backend", "weight_sync_backend"))


def check_capabilities(found: Mapping[str, type], values: Mapping[str, Any], pm: Any = None) -> list[str]:
    """Every capability one of trainer / inference backend / weight-sync backend requires is provided
    by one of them (see :class:`nexrl_core.Capabilities`)."""
    chosen = [(KIND_WORDS[kind], found[path], key) for path, key, kind in _ROLES if path in found]
    if len(chosen) < len(_ROLES):
        return []  # an unknown component is already reported
    provided = set().union(*(component_capabilities(cls).provides for _, cls, _ in chosen))
    problems = []
    for role, cls, key in chosen:
        for capability, why in component_capabilities(cls).requires.items():
            if capability not in provided:
                others = ", ".join(f"{r} '{lookup(values, k)}'" for r, _, k in chosen if k != key)
                problems.append(f"{key}: {role} '{lookup(values, key)}' needs '{capability}' ({why}), which "
                                f"neither {others} provides{_providers(capability, pm)}")
    for key, capability, why in RECIPE_NEEDS:
        if lookup(values, key) is True and capability not in provided:
            names = ", ".join(f"{r} '{lookup(values, k)}'" for r, _, k in chosen)
            problems.append(f"{key}: needs '{capability}' ({why}), which none of {names} provides"
                            f"{_providers(capability, pm)}")
    return problems


#: (recipe key, capability, why): a key that, when true, needs a capability of the chosen components
RECIPE_NEEDS = (
    ("weight.partial_rollout", "weight_sync:in_flight", "weights pushed while requests decode, at a decode-step "
                                                        "boundary, the requests keeping their tokens"),
    ("weight.partial_rollout", "inference:in_flight_weights", "an engine that takes new weights between two "
                                                              "decode steps of a running batch"),
)


def _providers(capability: str, pm: Any) -> str:
    if pm is None:
        return ""
    hits = [f"{key}: {name} ({reg.distribution})" for _, key, kind in _ROLES
            for name, reg in sorted(pm.components(kind).items())
            if capability in component_capabilities(reg.cls).provides]
    return f"; it is provided by {', '.join(hits)}" if hits else ""
