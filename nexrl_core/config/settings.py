"""Typed settings: a component's recipe keys declared once, as a frozen dataclass.

::

    @dataclass(frozen=True, kw_only=True)
    class ServerSettings(Settings):
        host: str = setting("127.0.0.1", "where the server listens")
        port: int | None = setting(None, "its port (null: a free one)", ge=1, le=65535)
        dtype: Literal["auto", "float32", "bfloat16"] = setting("auto", "the weights' precision")
        model_path: str = setting(help="the model folder")  # no default: the recipe must set it

    class MyBackend(InferenceClient):
        SETTINGS = ServerSettings

        def __init__(self, config):
            super().__init__(config)
            self.settings = ServerSettings.own(self.config)  # typed: self.settings.port is int | None

A field's annotation is its type (``bool``, ``int``, ``float``, ``str``, ``list[str]``,
``dict[str, str]``, ``X | None``, ``Literal[...]``, a nested :class:`Settings` class, whose
default is that class: ``adapter: Adapter = setting(Adapter, "...")``) and
:func:`setting` gives its default, help and the other :class:`~nexrl_core.config.options.Option`
arguments (``choices``, ``ge``/``gt``/``le``/``lt``, ``check``, ``path``, ``secret``, ``needs``).
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
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar, Union

from ..errors import ConfigError
from .bound import _to_plain, fill_defaults
from .options import _UNSET, REQUIRED, Option, check_options, option_defaults

__all__ = ["PlainData", "Settings", "setting"]

_OPTION = "nexrl_option"
_KEY = "nexrl_key"
S = TypeVar("S", bound="Settings")

#: Free-form recipe data (what YAML holds): the type of a field whose contents nexrl does not
#: declare, e.g. keyword arguments handed on to the user's function.
PlainData = Union[str, int, float, bool, None, list["PlainData"], dict[str, "PlainData"]]


def setting(default: Any = REQUIRED, help: str = "", key: str | None = None, **option: Any) -> Any:
    """One field of a :class:`Settings` class: its default (none given: the recipe must set it), one
    line of help, and any other :class:`Option` argument. ``key``: the recipe key, where it cannot
    be the field's name (a Python keyword). A mapping with ``options=`` whose default is ``dict``
    defaults to its options' defaults."""
    meta: dict[str, Any] = {_OPTION: {"default": default, "help": help, **option}}
    if key is not None:
        meta[_KEY] = key
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
    if default is dict:  # a mapping of declared keys: each key's default
        declared = option.get("options")
        return dataclasses.field(default_factory=lambda: option_defaults(declared), metadata=meta)
    if isinstance(default, type) and issubclass(default, Settings):  # a nested section: its own defaults
        return dataclasses.field(default_factory=default, metadata=meta)
    if isinstance(default, (list, dict)):
        return dataclasses.field(default_factory=lambda: copy.deepcopy(default), metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


class Settings:
    """Base of the typed settings classes: subclass it as ``@dataclass(frozen=True, kw_only=True)``."""

    _options: ClassVar[dict[type, dict[str, Option]]] = {}

    @classmethod
    def options(cls) -> dict[str, Option]:
        """The recipe keys this class declares, as the Option table recipes are checked against."""
        if cls not in Settings._options:
            Settings._options[cls] = {_key(field): _field_option(cls, field) for field in _fields(cls)}
        return Settings._options[cls]

    @classmethod
    def of(cls: type[S], section: Mapping[str, Any] | None, path: str = "") -> S:
        """The settings of a recipe section (a mapping; keys it leaves out get their defaults).
        ConfigError naming every bad key, as ``nexrl validate`` words them."""
        settings, problems = cls.parse(section, path)
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
        values = cls._own_values(section) if own else _to_plain(section)
        problems = check_options(values, _parts_open(cls.options()), path)
        return (None, problems) if problems else (cls._build(values), [])

    @classmethod
    def _own_values(cls, section: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: value for key, value in _to_plain(section).items() if key in cls.options()}

    @classmethod
    def _build(cls: type[S], values: Mapping[str, Any]) -> S:
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for field in _fields(cls):
            if _key(field) not in values:
                continue  # the dataclass default
            value = values[_key(field)]
            nested = _settings_class(hints[field.name])
            declared = cls.options()[_key(field)].options
            if nested is not None and isinstance(value, Mapping):
                value = nested._build(value)
            elif declared is not None and isinstance(value, Mapping):  # a mapping of declared keys: their defaults
                value = fill_defaults(copy.deepcopy(dict(value)), declared, resolved=True)
            kwargs[field.name] = copy.deepcopy(value) if isinstance(value, (list, dict)) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as recipe-shaped plain data (nested settings as mappings), by recipe key."""
        out: dict[str, Any] = {}
        for field in _fields(type(self)):
            value = getattr(self, field.name)
            out[_key(field)] = value.to_dict() if isinstance(value, Settings) else copy.deepcopy(value)
        return out


def _parts_open(options: dict[str, Option]) -> dict[str, Option]:
    """``options`` with the entries that select a component (``values=Option(component=...)``) open:
    the recipe check held each against the component it names, which reads its own keys."""
    return {key: dataclasses.replace(opt, values=dataclasses.replace(opt.values, options=None, type=dict))
            if opt.values is not None and opt.values.component is not None else opt for key, opt in options.items()}


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
    declared = dict(field.metadata.get(_OPTION, {}))
    annotation = typing.get_type_hints(cls)[field.name]
    nested = _settings_class(annotation)
    default = declared.pop("default", _UNSET)
    if default is _UNSET:  # a plain dataclass field, not made by setting()
        default = field.default if field.default is not dataclasses.MISSING else REQUIRED
    if default is dict:
        default = _UNSET  # its options' defaults
    if declared.get("options") is not None or declared.get("values") is not None:
        return Option(default, dict, **declared)  # checked key by key, each message naming its key
    if nested is not None:
        if default is None:
            return Option(None, (dict, None), options=nested.options(), **declared)
        return Option(REQUIRED if default is REQUIRED else _UNSET, dict, options=nested.options(), **declared)
    return Option(default, annotation, **declared)
