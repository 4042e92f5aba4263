"""The effective configuration and what a component reads of it.

- :func:`fill_defaults`: writes the declared default of every key a recipe leaves out, so the
  composed recipe (``nexrl config``, ``run_dir/config.yaml``) holds every value a run uses and
  every documented key overrides with a plain ``key=value``.
- :class:`BoundConfig`: a component's section, read-only, that refuses a key its declaration
  lacks (:class:`UndeclaredKey`, naming the key): a component reads values, never re-defaults them.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from ..errors import ConfigError, NexRLError
from .options import Option, component_options

__all__ = ["ANY", "BoundConfig", "UndeclaredKey", "bind", "bind_component", "bind_recipe", "declared_value",
           "fill_defaults", "key_tree"]

ANY = "*"  # in a key tree: any other key, with this subtree


class UndeclaredKey(NexRLError, KeyError):
    """A component read a key that its declaration (``OPTIONS`` or the core's schema) lacks."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


# -- what a component reads ------------------------------------------------------------------------------

def _parts_open(values: Any, options: Mapping[str, Option]) -> dict[str, Option]:
    """``options`` with each section that selects another component left open: that part is built
    by the launcher from the recipe and handed in, so the component does not read it."""
    values = values if isinstance(values, Mapping) else {}
    out: dict[str, Option] = {}
    for key, opt in options.items():
        value = values.get(key)
        if opt.component is not None and isinstance(value, Mapping):
            out[key] = replace(opt, options=None, values=None, type=dict)
        elif opt.options is not None and opt.values is None and isinstance(value, Mapping):
            out[key] = replace(opt, options=_parts_open(value, opt.options))
        else:
            out[key] = opt
    return out


# -- defaults -----------------------------------------------------------------------------------------

def fill_defaults(values: dict[str, Any], options: Mapping[str, Option], resolved: bool = False) -> dict[str, Any]:
    """In place: the declared default of every key ``values`` leaves out (required and removed keys,
    and defaults that are not plain data, excepted); nested sections too. Returns ``values``.
    ``resolved``: ``values`` is past interpolation (a section built by hand), so a default that
    names another key (``${seed}``) cannot be resolved and is null."""
    for key, opt in options.items():
        if opt.removed is not None:
            continue
        if key not in values and not opt.required:
            default = opt.default_value()
            if resolved and isinstance(default, str) and "${" in default:
                default = None
            if _is_plain(default):
                values[key] = _plain_copy(default)
        value = values.get(key)
        # Entries the recipe names (domains) keep only what they set: a domain's keys change the shared ones.
        if isinstance(value, dict) and opt.options is not None and opt.values is None:
            fill_defaults(value, opt.options, resolved)
    return values


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


# -- bound sections -------------------------------------------------------------------------------------

def key_tree(options: Mapping[str, Option] | None) -> dict[str, Any] | None:
    """The readable keys of ``options`` (removed ones left out): key -> its own tree, None where
    any key may be read (a free-form mapping or a plain value)."""
    if options is None:
        return None
    tree: dict[str, Any] = {}
    for key, opt in options.items():
        if opt.removed is not None:
            continue
        if opt.options is None and opt.values is None:
            tree[key] = None
            continue
        sub = key_tree(opt.options) if opt.options is not None else {}
        if opt.values is not None and sub is not None:
            sub[ANY] = key_tree(opt.values.options)
        tree[key] = sub
    return tree


class BoundConfig(Mapping):
    """A recipe section filled from its declaration, read-only. Reading a key the declaration lacks
    raises :class:`UndeclaredKey` (``path.key``); a declared key reads its value (the default when
    the recipe left it out). Nested sections are bound too; ``cfg.key`` reads like ``cfg["key"]``."""

    __slots__ = ("_values", "_tree", "_path")

    def __init__(self, values: Mapping[str, Any], tree: dict[str, Any] | None, path: str = "") -> None:
        object.__setattr__(self, "_values", dict(values))
        object.__setattr__(self, "_tree", tree)
        object.__setattr__(self, "_path", path)

    def _check(self, key: str) -> Any:
        """The subtree of ``key``; UndeclaredKey when it is not declared."""
        tree = self._tree
        if tree is None:
            return None
        if key in tree:
            return tree[key]
        if ANY in tree:
            return tree[ANY]
        full = f"{self._path}.{key}" if self._path else key
        known = ", ".join(sorted(k for k in tree if k != ANY)) or "none"
        raise UndeclaredKey(f"{full}: read but not declared (declared keys here: {known}); declare it with "
                            f"Option(...) in the component's OPTIONS (or nexrl_core/config/schema.py)")

    def __getitem__(self, key: str) -> Any:
        sub = self._check(key)
        return self._wrap(key, self._values[key], sub)

    def get(self, key: str, default: Any = None) -> Any:
        """The value of a declared key (``default`` only where a free-form section lacks it)."""
        sub = self._check(key)
        if key not in self._values:
            return default
        return self._wrap(key, self._values[key], sub)

    def __getattr__(self, key: str) -> Any:
        if key.startswith("_"):
            raise AttributeError(key)
        try:
            return self[key]
        except KeyError as exc:
            if isinstance(exc, UndeclaredKey):
                raise
            raise AttributeError(key) from None

    def __setattr__(self, key: str, value: Any) -> None:
        raise TypeError(f"{self._path or 'the recipe'}: a bound config is read-only (set '{key}' in the recipe)")

    def _wrap(self, key: str, value: Any, sub: Any) -> Any:
        full = f"{self._path}.{key}" if self._path else key
        if isinstance(value, Mapping):
            return BoundConfig(value, sub, full)
        if isinstance(value, list):
            return copy.deepcopy(value)
        return value

    def __contains__(self, key: object) -> bool:
        return key in self._values

    def __iter__(self) -> Iterator[str]:
        return iter(self._values)

    def __len__(self) -> int:
        return len(self._values)

    def __repr__(self) -> str:
        return f"BoundConfig({self._path or '<recipe>'}: {self._values!r})"

    def __reduce__(self) -> Any:  # pickled to Ray actors
        return (BoundConfig, (self._values, self._tree, self._path))

    def to_dict(self) -> dict[str, Any]:
        """A plain deep copy (what a library that wants a dict gets)."""
        return copy.deepcopy(self._values)


def bind(config: Any, options: Mapping[str, Option] | None, path: str = "") -> BoundConfig:
    """``config`` (a mapping, a DictConfig, a BoundConfig) as a bound section of ``options``:
    defaults filled, undeclared reads refused. A BoundConfig already bound is returned as is."""
    if isinstance(config, BoundConfig):
        return config
    values = _to_plain(config)
    if not isinstance(values, dict):
        raise ConfigError(f"{path or 'the recipe'}: expected a mapping, got {type(values).__name__}")
    return BoundConfig(fill_defaults(values, options or {}, True), key_tree(options) if options is not None else None,
                       path)


def declared_value(config: Any, key: str, options: Mapping[str, Option], path: str = "") -> Any:
    """``config[key]`` when the recipe sets it, else its declared default (``options[key]``): one key
    of a large section read without binding all of it (the launcher's ``launch_mode``)."""
    section = {key: config[key]} if config is not None and key in config else {}
    return bind(section, {key: options[key]}, path)[key]


def bind_component(config: Any, cls: type, core: Mapping[str, Option], path: str,
                   extra: Mapping[str, Option] | None = None) -> BoundConfig:
    """What a component (class ``cls``) reads of its section ``path``: the core's keys ``core``,
    ``cls``'s own declared ones and ``extra`` (keys nexrl sets itself). A nested section that
    selects another component (an evaluator) is left open: the launcher hands that part in."""
    if isinstance(config, BoundConfig):
        return config
    values = _to_plain(config)
    if not isinstance(values, dict):
        raise ConfigError(f"{path}: expected a mapping, got {type(values).__name__}")
    own = component_options(cls)
    declared = {**dict(core), **dict(extra or {})}
    if own is None:  # declares nothing: the core's keys filled, any key read
        return BoundConfig(fill_defaults(values, declared, True), None, path)
    options = {**own, **declared}
    fill_defaults(values, options, True)
    return BoundConfig(values, key_tree(_parts_open(values, options)), path)


def bind_recipe(config: Any, trainer_cls: type | None = None) -> BoundConfig:
    """The whole recipe bound to the core's declarations and ``trainer_cls``'s own (what a trainer
    reads: it is built with all of it). The sections of parts handed in (the algorithm functions,
    the train service, the other components) are left open: each binds its own."""
    if isinstance(config, BoundConfig):
        return config
    from .schema import CORE_OPTIONS

    values = _to_plain(config)
    if not isinstance(values, dict):
        raise ConfigError(f"the recipe: expected a mapping, got {type(values).__name__}")
    options = dict(CORE_OPTIONS)
    if trainer_cls is not None:
        trainer = options["trainer"]
        own = component_options(trainer_cls) or {}
        options["trainer"] = replace(trainer, component=None, options={**own, **dict(trainer.options or {})})
    fill_defaults(values, options, True)
    return BoundConfig(values, key_tree(_parts_open(values, options)), "")


def _to_plain(config: Any) -> Any:
    if config is None:
        return {}
    if isinstance(config, BoundConfig):
        return config.to_dict()
    try:
        from omegaconf import DictConfig, OmegaConf
        from omegaconf.errors import OmegaConfBaseException

        if isinstance(config, DictConfig):
            try:
                return OmegaConf.to_container(config, resolve=True)
            except OmegaConfBaseException as exc:
                key = getattr(exc, "full_key", None) or ""
                raise ConfigError(f"{key or 'the recipe'}: {str(exc).splitlines()[0]}") from None
    except ImportError:  # pragma: no cover - omegaconf is a core dependency
        pass
    if isinstance(config, Mapping):
        return _plain_copy(config)
    return config
