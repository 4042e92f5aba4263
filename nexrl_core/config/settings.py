"""Typed settings: a component's recipe keys declared once, as a frozen dataclass subclassing
:class:`Settings` (an example: docs/plugins.md, "Declaring options"); the component reads its section
with ``MySettings.own(section)``.

A field's annotation is its type (``bool``, ``int``, ``float``, ``str``, ``list[str]``,
``dict[str, str]``, ``X | None``, ``Literal[...]``, a nested :class:`Settings` class, whose
default is that class: ``adapter: Adapter = setting(Adapter, "...")``) and
:func:`setting` gives its default, help and the other :class:`~nexrl_core.config.options.Option`
arguments (``choices``, ``ge``/``gt``/``le``/``lt``, ``check``, ``path``, ``secret``, ``needs``).
A recipe key nexrl no longer reads is listed in the class's ``REMOVED`` (key -> what to do instead).
A nested section that selects a registered component takes ``component=`` (and ``selector=``): it
holds that component's keys too, which the recipe check held against the component and the
settings leave out (the component reads them with its own class's :meth:`Settings.own`).
A mapping whose keys are declared elsewhere takes ``options=`` (its default ``dict``: its keys'
defaults) or, for keys the user names, ``values=`` (each entry checked against that option, the
message naming the entry); free-form data is :data:`PlainData`. ``key=`` names the recipe key of
a field that cannot carry its name (``class_: str = setting(key="class")``).
:meth:`Settings.options` is the table ``nexrl validate``, ``nexrl run``, ``nexrl config`` and the
recipe reference read (a component's ``SETTINGS`` counts as its ``OPTIONS``), so what the type
checker sees and what a recipe is checked against are one declaration.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, Union

from ..errors import ConfigError
from .options import _UNSET, REQUIRED, Check, Option, option_defaults

__all__ = ["PlainData", "Section", "Settings", "fill_defaults", "plain", "read_section", "setting"]

_OPTION = "nexrl_option"
_KEY = "nexrl_key"
S = TypeVar("S", bound="Settings")

#: Free-form recipe data (what YAML holds): the type of a field whose contents nexrl does not
#: declare, e.g. keyword arguments handed on to the user's function.
PlainData = Union[str, int, float, bool, None, list["PlainData"], dict[str, "PlainData"]]


def setting(default: Any = REQUIRED, help: str = "", key: str | None = None, **option: Any) -> Any:
    """One field of a :class:`Settings` class: its default (none given: the recipe must set it), one
    line of help, ``key=`` and any other :class:`Option` argument (the field's metadata is that
    Option; its type, the annotation, is added when the class is read)."""
    meta: dict[str, Any] = {_OPTION: Option(_UNSET if default is dict else default, help=help, **option)}
    if key is not None:
        meta[_KEY] = key
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if default is dict:  # a mapping of declared keys: each key's default
        return dataclasses.field(default_factory=lambda: option_defaults(option.get("options")), metadata=meta)
    if isinstance(default, type) and issubclass(default, Settings):  # a nested section: its own defaults
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Settings:
    """Base of the typed settings classes: subclass it as ``@dataclass(frozen=True, kw_only=True)``."""

    _options: ClassVar[dict[type[Settings], dict[str, Option]]] = {}
    #: recipe keys no longer read: key -> what to do instead (``nexrl validate`` names it)
    REMOVED: ClassVar[dict[str, str]] = {}
    #: the section also holds sections declared elsewhere (``logger.<sink>``): a parent leaves them out
    HOLDS_OTHERS: ClassVar[bool] = False

    @classmethod
    def options(cls) -> dict[str, Option]:
        """The recipe keys this class declares, as the Option table recipes are checked against."""
        if cls not in Settings._options:
            removed = {key: Option(removed=text) for key, text in cls.REMOVED.items()}
            Settings._options[cls] = {**{_key(field): _field_option(cls, field) for field in _fields(cls)}, **removed}
        return Settings._options[cls]

    @classmethod
    def of(cls: type[S], section: S | Mapping[str, Any] | None, path: str = "") -> S:
        """The settings of a recipe section (a mapping; keys it leaves out get their defaults), or
        ``section`` itself when it already is this class. ConfigError naming every bad key, as
        ``nexrl validate`` words them."""
        if isinstance(section, cls):
            return section
        settings, problems = cls.parse(typing.cast("Mapping[str, Any] | None", section), path)
        if settings is None:
            raise ConfigError("; ".join(problems))
        return settings

    @classmethod
    def own(cls: type[S], section: Mapping[str, Any] | None, path: str = "") -> S:
        """:meth:`of` the keys this class declares, of a section that holds others' too (a
        component's section holds the core's keys beside its own; the recipe check saw them all)."""
        return cls.of(cls._own_values(section), path)

    @classmethod
    def parse(cls: type[S], section: Mapping[str, Any] | None, path: str = "",
              own: bool = False) -> tuple[S | None, list[str]]:
        """The settings and no problems, or None and every problem, one line each. ``own``: only the
        keys this class declares (as :meth:`own` reads them)."""
        values = cls._own_values(section) if own else plain(section)
        if not isinstance(values, dict):
            return None, [f"{path or 'the recipe'}: expected a mapping, got {type(values).__name__}"]
        # filled first: a section the mapping leaves out is its defaults, and any key it requires is named
        values = fill_defaults(values, cls.options(), resolved=True)
        problems = _DeclaredKeys().mapping(values, cls.options(), path)
        return (None, problems) if problems else (cls._build(values), [])

    @classmethod
    def _own_values(cls, section: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: value for key, value in plain(section).items() if key in cls.options()}

    @classmethod
    def _build(cls: type[S], values: Mapping[str, Any]) -> S:
        # ``values`` is parse's own copy, every nested default filled
        hints = _hints(cls)
        kwargs: dict[str, Any] = {}
        for field in _fields(cls):
            if _key(field) not in values:
                continue  # the dataclass default
            value = values[_key(field)]
            nested = _settings_class(hints[field.name])
            kwargs[field.name] = nested._build(value) if nested is not None and isinstance(value, Mapping) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as recipe-shaped plain data (nested settings as mappings), by recipe key."""
        out: dict[str, Any] = {}
        for field in _fields(type(self)):
            value = getattr(self, field.name)
            out[_key(field)] = value.to_dict() if isinstance(value, Settings) else copy.deepcopy(value)
        return out


_HINTS: dict[type, dict[str, Any]] = {}


def _hints(cls: type) -> dict[str, Any]:
    """``cls``'s field types, resolved once (a class's annotations do not change)."""
    if cls not in _HINTS:
        _HINTS[cls] = typing.get_type_hints(cls)
    return _HINTS[cls]


class _DeclaredKeys(Check):
    """The check of the keys a Settings class declares. A section that selects a component
    (``component=``) or holds ``logger.<sink>`` (``HOLDS_OTHERS``) also holds keys the recipe check
    held against their owner, which reads them itself: those are left out here."""

    def value(self, value: Any, opt: Option, path: str) -> list[str]:
        holds_others = opt.component is not None or any(
            table is opt.options for cls, table in Settings._options.items() if cls.HOLDS_OTHERS)
        if holds_others and opt.options is not None and isinstance(value, Mapping):
            value = {key: item for key, item in value.items() if key in opt.options}
        return super().value(value, opt, path)


def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    if "__dataclass_fields__" not in cls.__dict__:
        raise TypeError(f"{cls.__qualname__}: a Settings class must be a dataclass: "
                        "@dataclass(frozen=True, kw_only=True)")
    return dataclasses.fields(cls)


def _key(field: dataclasses.Field) -> str:
    """The recipe key of a field: its name, or the ``key=`` it was declared with."""
    return str(field.metadata.get(_KEY, field.name))


def _settings_class(annotation: Any) -> type[Settings] | None:
    """The Settings class an annotation names, alone or with ``| None``."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if isinstance(candidate, type) and issubclass(candidate, Settings):
            return candidate
    return None


def _field_option(cls: type, field: dataclasses.Field) -> Option:
    """The field's Option (made by :func:`setting`, else by its dataclass default), typed by its annotation."""
    opt = field.metadata.get(_OPTION) or Option(REQUIRED if field.default is dataclasses.MISSING else field.default)
    annotation = _hints(cls)[field.name]
    nested = _settings_class(annotation)
    if opt.options is not None or opt.values is not None:
        return dataclasses.replace(opt, type=dict)  # checked key by key, each message naming its key
    if nested is None:  # ``type=``: a looser check than the annotation, where ``check=`` words the problem better
        return opt if opt.type is not None else dataclasses.replace(opt, type=annotation)
    nullable = opt.default is None or type(None) in typing.get_args(annotation)
    default = None if opt.default is None else REQUIRED if opt.required and not nullable else _UNSET
    return dataclasses.replace(opt, default=default, type=(dict, None) if nullable else dict, options=nested.options())


# -- a section as a component reads it ------------------------------------------------------------------

class Section(dict[str, Any]):
    """A recipe section as a component reads it (``cfg["key"]``, or ``cfg.key`` where the key is not
    a dict method's name): its own copy, nested mappings Sections too. A key it lacks is a KeyError
    (AttributeError) naming where that key would live. Its typed reading is the component's
    :meth:`Settings.own`."""

    def __init__(self, values: Mapping[str, Any], path: str = "") -> None:
        sections = {key: Section(value, f"{path}.{key}" if path else key)
                    for key, value in values.items() if isinstance(value, Mapping)}
        super().__init__({**values, **sections})
        self._path = path  # underscored: ``cfg.path`` is a recipe key (a data file), not this

    def __missing__(self, key: str) -> Any:
        full = f"{self._path}.{key}" if self._path else key
        raise KeyError(f"{full}: not in the section (a declared key always is)")

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError as exc:
            raise AttributeError(exc.args[0]) from None

    def to_dict(self) -> dict[str, Any]:
        """A plain deep copy (what a library that wants a dict gets)."""
        return _plain_copy(self)


def read_section(config: Mapping[str, Any] | None, options: Mapping[str, Option], path: str) -> Section:
    """``config`` (a mapping, a DictConfig, a Section) as a component reads it: a copy, with the
    declared default of every key of ``options`` it leaves out."""
    values = plain(config)
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'the recipe'}: expected a mapping, got {type(values).__name__}")
    return Section(fill_defaults(values, options, resolved=True), path)


# -- plain values and declared defaults ----------------------------------------------------------------

def plain(config: object) -> Any:
    """``config`` as plain dicts and lists ({} for None): a DictConfig resolved (ConfigError naming
    the key that cannot be), another mapping copied."""
    from omegaconf import DictConfig, OmegaConf
    from omegaconf.errors import OmegaConfBaseException

    if config is None:
        return {}
    if isinstance(config, DictConfig):
        try:
            return OmegaConf.to_container(config, resolve=True)
        except OmegaConfBaseException as exc:
            raise ConfigError(f"{getattr(exc, 'full_key', None) or 'the recipe'}: {str(exc).splitlines()[0]}") from None
    return _plain_copy(config) if isinstance(config, Mapping) else config


def fill_defaults(values: dict[str, Any], options: Mapping[str, Option], resolved: bool = False) -> dict[str, Any]:
    """In place: the declared default of every key ``values`` leaves out (required and removed keys,
    and defaults that are not plain data, excepted); nested sections too. Returns ``values``: the
    composed recipe (``nexrl config``, ``run_dir/config.yaml``) holds every value a run uses.
    ``resolved``: ``values`` is past interpolation (a section built by hand), so a default that
    names another key cannot be resolved there: one that is a root key alone (``${seed}``) is that
    key's declared default (what the composed recipe holds when the recipe leaves both out), any
    other is null."""
    for key, opt in options.items():
        if opt.removed is not None:
            continue
        if key not in values and not opt.required:
            default = opt.default_value()
            if resolved and isinstance(default, str) and "${" in default:
                default = _root_default(default)
            elif resolved and opt.default is _UNSET and opt.options is not None:  # its keys' defaults, resolved
                default = fill_defaults({}, opt.options, resolved)
            if _is_plain(default):
                values[key] = _plain_copy(default)
        value = values.get(key)
        # Entries the recipe names (domains) keep only what they set: a domain's keys change the shared ones.
        if isinstance(value, dict) and opt.options is not None and opt.values is None:
            fill_defaults(value, opt.options, resolved)
    return values


#: the recipe's root keys, what ``${key}`` in a default names: nexrl_core.config.schema fills it when
#: imported (it declares them with Settings, which stand on this module)
ROOT_OPTIONS: dict[str, Option] = {}


def _root_default(reference: str) -> Any:
    """The declared default of the root key ``reference`` names (``${seed}``: 42); None for any
    other text or a default that is itself a reference."""
    match = re.fullmatch(r"\$\{(\w+)\}", reference)
    opt = ROOT_OPTIONS.get(match.group(1)) if match else None
    default = opt.default_value() if opt is not None else None
    return None if isinstance(default, str) and "${" in default else default


def _is_plain(value: Any) -> bool:
    if value is None or isinstance(value, (bool, int, float, str)):
        return True
    if isinstance(value, (list, tuple)):
        return all(_is_plain(v) for v in value)
    if isinstance(value, Mapping):
        return all(isinstance(k, str) and _is_plain(v) for k, v in value.items())
    return False


def _plain_copy(value: Any) -> Any:
    if isinstance(value, Mapping):
        return {k: _plain_copy(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain_copy(v) for v in value]
    return value
