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
:meth:`Settings.options` is the table ``nexrl validate``, ``nexrl run``, ``nexrl config`` and the
recipe reference read (a component's ``SETTINGS`` counts as its ``OPTIONS``), so what the type
checker sees and what a recipe is checked against are one declaration.
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from collections.abc import Mapping
from typing import Any, ClassVar, TypeVar

from ..errors import ConfigError
from .bound import _to_plain
from .options import _UNSET, REQUIRED, Option, check_options

__all__ = ["Settings", "setting"]

_OPTION = "nexrl_option"
S = TypeVar("S", bound="Settings")


def setting(default: Any = REQUIRED, help: str = "", **option: Any) -> Any:
    """One field of a :class:`Settings` class: its default (none given: the recipe must set it), one
    line of help, and any other :class:`Option` argument."""
    meta = {_OPTION: {"default": default, "help": help, **option}}
    if default is REQUIRED:
        return dataclasses.field(metadata=meta)
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
            Settings._options[cls] = {field.name: _field_option(cls, field) for field in _fields(cls)}
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
        problems = check_options(values, cls.options(), path)
        return (None, problems) if problems else (cls._build(values), [])

    @classmethod
    def _own_values(cls, section: Mapping[str, Any] | None) -> dict[str, Any]:
        return {key: value for key, value in _to_plain(section).items() if key in cls.options()}

    @classmethod
    def _build(cls: type[S], values: Mapping[str, Any]) -> S:
        hints = typing.get_type_hints(cls)
        kwargs: dict[str, Any] = {}
        for field in _fields(cls):
            if field.name not in values:
                continue  # the dataclass default
            value = values[field.name]
            nested = _settings_class(hints[field.name])
            if nested is not None and isinstance(value, Mapping):
                value = nested._build(value)
            kwargs[field.name] = copy.deepcopy(value) if isinstance(value, (list, dict)) else value
        return cls(**kwargs)

    def to_dict(self) -> dict[str, Any]:
        """The settings as recipe-shaped plain data (nested settings as mappings)."""
        return dataclasses.asdict(self)  # type: ignore[call-overload]


def _fields(cls: type) -> tuple[dataclasses.Field, ...]:
    if "__dataclass_fields__" not in cls.__dict__:
        raise TypeError(f"{cls.__qualname__}: a Settings class must be a dataclass: "
                        "@dataclass(frozen=True, kw_only=True)")
    return dataclasses.fields(cls)


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
    if nested is not None:
        if default is None:
            return Option(None, (dict, None), options=nested.options(), **declared)
        return Option(REQUIRED if default is REQUIRED else _UNSET, dict, options=nested.options(), **declared)
    return Option(default, annotation, **declared)
