"""Registries of named RL functions, filled by plugins through hooks, and the ``algorithm`` section.

Two kinds today, each with its hook (see :mod:`nexrl_core.hookspecs`) and the recipe key that
selects a registered name:

=======================  ==============================  =========================
kind                     hook                            selected by (GRPO trainer)
=======================  ==============================  =========================
``advantage_estimator``  ``nexrl_advantage_estimators``  ``algorithm.type``
``policy_loss``          ``nexrl_policy_losses``         ``algorithm.policy_loss``
=======================  ==============================  =========================

A registered function declares the ``algorithm.*`` keys it reads as its **keyword-only
parameters**; their defaults are the keys' defaults (and types), a ``typing.Literal`` annotation
lists the accepted values. Positional parameters are the data the trainer passes. A function
may also carry

- ``recommended_defaults`` (a dict): defaults it recommends for other ``algorithm.*`` keys (the
  trainer's or the loss's), used when the recipe does not set them (Dr. GRPO's loss normaliser,
  REINFORCE++'s KL penalty in the reward);
- ``requires`` (names): inputs the trainer must compute for it (``"values"``: a critic's values).

A trainer declares its own keys in ``ALGORITHM_OPTIONS`` (name -> :class:`~nexrl_core.Option`),
which of them select a function in ``ALGORITHM_SELECTORS`` (key -> kind), the inputs it can
compute in ``ALGORITHM_INPUTS`` (input -> the keys it then reads, e.g. the critic's: accepted
only when a selected function requires that input) and may check its values further in a
classmethod ``algorithm_option_problems(options) -> list[str]``.
:func:`algorithm_keys` (``nexrl validate``) and :func:`select_algorithms` (the trainer) read the
recipe the same way, with the core's option checker.
"""

from __future__ import annotations

import functools
import inspect
import typing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from difflib import get_close_matches
from typing import Any

from ..config.options import Option, check_options, component_options, param_docs
from ..config.settings import plain
from ..errors import ConfigError, PluginError

# kind -> hook that registers it
ALGORITHM_KINDS: dict[str, str] = {
    "advantage_estimator": "nexrl_advantage_estimators",
    "policy_loss": "nexrl_policy_losses",
}


def option_defaults(fn: Callable[..., Any]) -> dict[str, Any]:
    """The ``algorithm.*`` keys ``fn`` reads: its keyword-only parameters and their defaults."""
    params = inspect.signature(fn).parameters.values()
    missing = [p.name for p in params if p.kind is p.KEYWORD_ONLY and p.default is p.empty]
    if missing:
        raise TypeError(f"keyword-only parameters {missing} have no default (each is a recipe key and needs one)")
    return {p.name: p.default for p in params if p.kind is p.KEYWORD_ONLY}


def option_choices(fn: Callable[..., Any]) -> dict[str, tuple[Any, ...]]:
    """Accepted values of the options annotated with ``typing.Literal[...]``."""
    try:
        hints = typing.get_type_hints(fn)
    except Exception:  # an annotation that does not resolve: no choices to check
        return {}
    return {name: typing.get_args(hint) for name, hint in hints.items()
            if typing.get_origin(hint) is typing.Literal}


@dataclass(frozen=True)
class AlgorithmFunction:
    """One registered function: what it is, who registered it, the recipe keys it reads."""

    kind: str
    name: str
    fn: Callable[..., Any]
    distribution: str
    options: dict[str, Any] = field(default_factory=dict)
    choices: dict[str, tuple[Any, ...]] = field(default_factory=dict)
    recommended_defaults: dict[str, Any] = field(default_factory=dict)
    requires: tuple[str, ...] = ()

    @classmethod
    def create(cls, kind: str, name: str, fn: Callable[..., Any], distribution: str) -> AlgorithmFunction:
        requires = getattr(fn, "requires", ()) or ()
        return cls(kind, name, fn, distribution, option_defaults(fn), option_choices(fn),
                   dict(getattr(fn, "recommended_defaults", {}) or {}),
                   (requires,) if isinstance(requires, str) else tuple(requires))

    def declared(self) -> dict[str, Option]:
        """The keys ``fn`` reads as options: typed by annotation (a ``Literal`` lists the choices)
        or by the default; the help is the parameter's ``:param name:`` line.
        ``Annotated[float, Option(gt=1)]`` adds bounds (and a help that replaces the docstring's)."""
        try:
            hints = typing.get_type_hints(self.fn, include_extras=True)
        except Exception:  # an annotation that does not resolve: typed by the defaults
            hints = {}
        helps = param_docs(inspect.getdoc(self.fn) or "")
        out = {}
        for name, default in self.options.items():
            hint = hints.get(name)
            extra = None
            if typing.get_origin(hint) is typing.Annotated:
                hint, *metadata = typing.get_args(hint)
                extra = next((m for m in metadata if isinstance(m, Option)), None)
            help_text = (extra.help if extra else "") or helps.get(name, "")
            out[name] = (replace(extra, default=default, type=extra.type or hint, help=help_text) if extra
                         else Option(default, hint, help_text))
        return out

    def bind(self, options: Mapping[str, Any]) -> Callable[..., Any]:
        """``fn`` with its declared options taken from ``options`` (keys it does not read are left out)."""
        return functools.partial(self.fn, **{k: options[k] for k in self.options if k in options})


def unknown_name_error(kind: str, name: Any, key: str, available: Mapping[str, str], notes: str = "") -> ConfigError:
    """``key: unknown <kind> 'name'. Did you mean ...? Available: 'a' (dist), ...``"""
    listing = ", ".join(f"'{n}' ({dist})" for n, dist in sorted(available.items())) or "none"
    hint = get_close_matches(str(name), list(available), n=1)
    did_you_mean = f" Did you mean '{hint[0]}'?" if hint else ""
    return ConfigError(f"{key}: unknown {kind.replace('_', ' ')} '{name}'.{did_you_mean} Available: {listing}.{notes}")


class AlgorithmRegistry:
    """The registered functions of every kind, by name: an :class:`AlgorithmFunction`, or the
    plugin manager's registration (its ``cls`` imported when a recipe first selects the name). Holds
    plain functions, so it pickles (by reference) into another process with the trainer."""

    def __init__(self, functions: Mapping[str, Mapping[str, Any]], notes: str = ""):
        self._functions = {kind: dict(functions.get(kind, {})) for kind in ALGORITHM_KINDS}
        self._notes = notes

    @classmethod
    def from_plugin_manager(cls, plugin_manager: Any) -> AlgorithmRegistry:
        functions = {kind: plugin_manager.functions(kind) for kind in ALGORITHM_KINDS}
        notes = "".join(f" Plugin '{f.name}' ({f.distribution}) failed to load: {f.error}."
                        for f in plugin_manager.failures)
        return cls(functions, notes)

    def names(self, kind: str) -> list[str]:
        return sorted(self._functions[kind])

    def get(self, kind: str, name: Any, key: str) -> AlgorithmFunction:
        found = self._functions[kind].get(name) if isinstance(name, str) else None
        if found is None:
            available = {n: f.distribution for n, f in self._functions[kind].items()}
            raise unknown_name_error(kind, name, key, available, self._notes)
        if not isinstance(found, AlgorithmFunction):  # a plugin's registration: its function read once
            try:
                found = AlgorithmFunction.create(kind, name, found.cls, found.distribution)
            except PluginError as exc:
                raise ConfigError(f"{key}: {exc}") from exc
            self._functions[kind][name] = found
        return found


@dataclass(frozen=True)
class AlgorithmSelection:
    """The functions a recipe's ``algorithm`` section selects and every key's value."""

    functions: dict[str, AlgorithmFunction]  # selector key -> function
    options: dict[str, Any]  # every declared key -> the recipe's value, else its default

    def bound(self, selector: str) -> Callable[..., Any]:
        return self.functions[selector].bind(self.options)

    def requires(self, input_name: str) -> bool:
        """Whether a selected function needs the trainer to compute ``input_name`` (e.g. "values")."""
        return any(input_name in fn.requires for fn in self.functions.values())


def _plain(section: object) -> dict[str, Any]:
    """The section as a plain dict ({} when it is not a mapping: the key check reports that)."""
    values = plain(section)
    return values if isinstance(values, dict) else {}


def _trainer_problems(trainer_cls: type, options: Mapping[str, Any]) -> list[str]:
    """The trainer's own checks of its values (``algorithm_option_problems(options)``, optional;
    it must cope with values of the wrong type, which the key check reports)."""
    check = getattr(trainer_cls, "algorithm_option_problems", None)
    return list(check(dict(options))) if check is not None else []


def _resolve(trainer_cls: type, section: Mapping[str, Any], registry: AlgorithmRegistry,
             trainer_name: str | None = None) -> tuple[dict[str, AlgorithmFunction], dict[str, Option], list[str]]:
    own = component_options(trainer_cls, "ALGORITHM_OPTIONS") or {}
    selectors = dict(getattr(trainer_cls, "ALGORITHM_SELECTORS", {}) or {})
    functions: dict[str, AlgorithmFunction] = {}
    problems: list[str] = []
    for key, kind in selectors.items():
        default = own[key].default_value() if key in own else None
        try:
            functions[key] = registry.get(kind, section.get(key, default), f"algorithm.{key}")
        except ConfigError as exc:
            problems.append(str(exc))
    options = dict(own)
    inputs = dict(getattr(trainer_cls, "ALGORITHM_INPUTS", {}) or {})
    for key, fn in functions.items():
        for needed in fn.requires:
            if needed in inputs:
                for name, opt in inputs[needed].items():
                    options.setdefault(name, opt)
            else:
                problems.append(f"algorithm.{key}: {fn.kind.replace('_', ' ')} '{fn.name}' needs {needed}, which "
                                f"trainer '{trainer_name or trainer_cls.__name__}' does not compute (it computes: "
                                f"{', '.join(sorted(inputs)) or 'nothing beyond rewards'})")
    for fn in functions.values():
        for name, opt in fn.declared().items():
            options.setdefault(name, opt)
    for fn in functions.values():  # a function's recommended settings beat the other keys' own defaults
        for name, default in fn.recommended_defaults.items():
            if name in options:
                options[name] = replace(options[name], default=default)
    return functions, options, problems


def _values(options: Mapping[str, Option], section: Mapping[str, Any]) -> dict[str, Any]:
    """The recipe's values over the defaults; a mapping-valued key is merged one level deep."""
    out = {name: opt.default_value() for name, opt in options.items()}
    for name, value in section.items():
        default = out.get(name)
        out[name] = {**default, **value} if isinstance(default, Mapping) and isinstance(value, Mapping) else value
    return out


def algorithm_keys(trainer_cls: type, algorithm: Any, plugin_manager: Any,
                   trainer_name: str | None = None) -> tuple[dict[str, Option], list[str]]:
    """For ``nexrl validate``: (every ``algorithm.*`` option that ``trainer_cls`` and the functions
    the recipe selects read, problems). Problems name an unknown function (with a "did you mean")
    or come from the trainer's own value checks; the caller checks keys and values against the
    returned options (:func:`nexrl_core.check_options`). ``trainer_name`` is the recipe's
    ``trainer.type``, which problems name (else the class)."""
    registry = AlgorithmRegistry.from_plugin_manager(plugin_manager)
    section = _plain(algorithm)
    _, options, problems = _resolve(trainer_cls, section, registry, trainer_name)
    if problems:  # a function that is not found cannot say which keys it reads: no guesses about them
        options.update({name: Option(None, Any) for name in section if name not in options})
    elif not check_options(section, options, "algorithm"):
        problems += _trainer_problems(trainer_cls, _values(options, section))
    return options, problems


def select_algorithms(trainer_cls: type, algorithm: Any, registry: AlgorithmRegistry) -> AlgorithmSelection:
    """For the trainer: the selected functions and every key's value; ConfigError on any problem
    (including a key nobody reads), the same ones ``nexrl validate`` reports."""
    section = _plain(algorithm)
    functions, options, problems = _resolve(trainer_cls, section, registry)
    if problems:
        raise ConfigError("; ".join(problems))
    problems = check_options(section, options, "algorithm")
    if not problems:
        problems = _trainer_problems(trainer_cls, _values(options, section))
    if problems:
        raise ConfigError("; ".join(problems))
    return AlgorithmSelection(functions, _values(options, section))
