"""Hydra-style composition of a recipe: its ``defaults:`` list and group overrides.

A recipe may start with a defaults list, as in Hydra 1.1+::

    defaults:
      - weight: fully_async     # config group 'weight', option 'fully_async'
      - base                    # a config of the recipe's folder (base.yaml), merged at the root
      - _self_                  # where the recipe's own keys go (implicitly last)

A group option is ``<group>/<option>.yaml``, looked up first in the recipe's folder, then in
the package (``nexrl_core/conf/``); its keys land under the group's path (``weight/x.yaml``
fills ``weight:``) unless its first lines say ``# @package _global_`` (the root) or
``# @package a.b``. A group file may have its own defaults list (groups relative to its own
group; ``/g`` is absolute). ``optional g: x`` tolerates a missing option; ``g: null`` is a
placeholder an override can fill; ``g@pkg: x`` places the option at ``pkg``.

On the command line ``g=x`` changes the option of a group the defaults list names,
``+g=x`` appends a group, ``~g`` removes one. Everything is merged, in order, onto the
core's defaults (:func:`nexrl_core.config.schema.core_defaults`); later layers win, mappings merge.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Any

import yaml

from ..errors import ConfigError

# nexrl_core/conf: the core's config groups (shipped as package data next to the config package)
PACKAGE_CONF = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")


@dataclass
class GroupOverride:
    text: str  # the override as typed
    group: str
    option: str | None  # None: remove
    kind: str  # "set" | "add" | "delete"
    used: bool = False


@dataclass
class _Entry:
    group: str | None  # absolute group path, or None for a plain config
    name: str | None  # option / config name; None: empty placeholder
    package: str | None
    optional: bool
    where: str  # "file" for messages
    is_self: bool = False
    overridable: bool = True  # a 'group: option' entry (a plain config name is not)


class Composer:
    """Turns a recipe (already parsed) into the ordered layers to merge."""

    def __init__(self, recipe_path: str, overrides: list[GroupOverride]):
        self.recipe_path = recipe_path
        self.roots = [os.path.dirname(os.path.abspath(recipe_path)), PACKAGE_CONF]
        self.overrides = overrides
        self._stack: list[str] = []
        self.layer_files: list[str] = []  # the file of each layer :meth:`layers` returns, in order

    # -- groups ------------------------------------------------------------------------
    def is_group(self, group: str) -> bool:
        """A folder of ``.yaml`` options (a ``data/`` folder of JSONL files next to a recipe is not)."""
        return bool(self.options(group))

    def options(self, group: str) -> list[str]:
        names = set()
        for root in self.roots:
            folder = os.path.join(root, group)
            if os.path.isdir(folder):
                names |= {f[:-5] for f in os.listdir(folder) if f.endswith(".yaml")}
        return sorted(names)

    def _find(self, group: str | None, name: str) -> str | None:
        rel = os.path.join(group, name + ".yaml") if group else name + ".yaml"
        for root in self.roots:
            path = os.path.join(root, rel)
            if os.path.isfile(path):
                return path
        return None

    # -- composition -------------------------------------------------------------------------
    def layers(self, recipe: dict[str, Any]) -> list[dict[str, Any]]:
        """The recipe's layers in merge order (group options, the recipe itself, appended groups)."""
        out = self._expand(recipe, self.recipe_path, group_dir="")
        for ov in self.overrides:
            if ov.kind == "add":
                ov.used = True
                entry = _Entry(ov.group, ov.option, None, False, f"override '{ov.text}'")
                out += self._load_entry(entry)
        for ov in self.overrides:
            if not ov.used:
                raise ConfigError(self._unused(ov))
        return out

    def _unused(self, ov: GroupOverride) -> str:
        if ov.kind == "delete":
            return f"override '{ov.text}': the defaults list has no group '{ov.group}' to remove"
        return (f"override '{ov.text}': the recipe's defaults list has no group '{ov.group}' "
                f"(use '+{ov.text}' to add it)")

    def _expand(self, content: dict[str, Any], where: str, group_dir: str, package: str = "") -> list[dict[str, Any]]:
        content = dict(content)
        entries = self._entries(content.pop("defaults", None), where, group_dir)
        if not any(e.is_self for e in entries):
            entries.append(_Entry(None, None, None, False, where, is_self=True))
        layers: list[dict[str, Any]] = []
        for entry in entries:
            if entry.is_self:
                if content:
                    layers.append(_at(package, content))
                    self.layer_files.append(where)
                continue
            layers += self._load_entry(entry)
        return layers

    def _entries(self, raw: Any, where: str, group_dir: str) -> list[_Entry]:
        if raw is None:
            return []
        if not isinstance(raw, list):
            raise ConfigError(f"{where}: defaults: expected a list (e.g. '- weight: sync', '- _self_'), "
                              f"got {type(raw).__name__}")
        entries: list[Any] = []
        for i, item in enumerate(raw):
            spot = f"{where}: defaults[{i}]"
            if item == "_self_":
                if any(e.is_self for e in entries):
                    raise ConfigError(f"{spot}: _self_ appears twice")
                entries.append(_Entry(None, None, None, False, where, is_self=True))
            elif isinstance(item, str):
                path, _, pkg = item.partition("@")
                group, _, name = path.rpartition("/")
                folder = self._abs(group, group_dir) if group else (group_dir or None)
                entries.append(_Entry(folder, name, pkg or None, False, spot, overridable=False))
            elif isinstance(item, dict) and len(item) == 1:
                (key, value), = item.items()
                key = str(key).strip()
                optional = False
                words = key.split()
                if len(words) == 2 and words[0] == "optional":
                    optional, key = True, words[1]
                elif len(words) == 2 and words[0] == "override":
                    raise ConfigError(f"{spot}: 'override {words[1]}' entries are not supported; select the "
                                      f"option in the recipe's own defaults list or with {words[1]}=<option>")
                elif len(words) != 1:
                    raise ConfigError(f"{spot}: cannot read '{key}'")
                group, _, pkg = key.partition("@")
                if value is not None and not isinstance(value, str):
                    raise ConfigError(f"{spot}: option of group '{group}' must be one name, got "
                                      f"{type(value).__name__} (lists of options are not supported)")
                entries.append(_Entry(self._abs(group, group_dir), value, pkg or None, optional, spot))
            else:
                raise ConfigError(f"{spot}: expected '_self_', a config name or 'group: option', got {item!r}")
        return entries

    @staticmethod
    def _abs(group: str, group_dir: str) -> str:
        if group.startswith("/"):
            return group.strip("/")
        return f"{group_dir}/{group}".strip("/") if group_dir else group

    def _load_entry(self, entry: _Entry) -> list[dict[str, Any]]:
        name = entry.name
        if entry.group is not None and entry.overridable:
            for ov in self.overrides:
                if ov.group == entry.group and ov.kind in ("set", "delete") and not ov.used:
                    ov.used = True
                    name = ov.option if ov.kind == "set" else None
        if name is None:
            return []
        path = self._find(entry.group, name)
        label = f"{entry.group}/{name}" if entry.group else name
        if path is None:
            if entry.optional:
                return []
            if entry.group and self.is_group(entry.group):
                listing = ", ".join(self.options(entry.group)) or "none"
                raise ConfigError(f"{entry.where}: config group '{entry.group}' has no option '{name}' "
                                  f"(available: {listing})")
            raise ConfigError(f"{entry.where}: no config '{label}.yaml' in {self.roots[0]} or in nexrl_core/conf")
        if path in self._stack:
            raise ConfigError(f"{entry.where}: '{label}' includes itself (through {' -> '.join(self._stack)})")
        content, header = read_yaml_file(path, with_package=True)
        if content is None:
            content = {}
        if not isinstance(content, dict):
            raise ConfigError(f"{path}: a config must be a mapping of keys, got {type(content).__name__}")
        package = entry.package or header or "_group_"  # '_global_': the root; '_group_': the group's path
        package = {"_global_": "", "_group_": (entry.group or "").replace("/", ".")}.get(package, package)
        self._stack.append(path)
        try:
            group_dir = entry.group or ""
            return self._expand(content, path, group_dir, package=package)
        finally:
            self._stack.pop()


def _at(package: str, content: dict[str, Any]) -> dict[str, Any]:
    for part in reversed([p for p in package.split(".") if p]):
        content = {part: content}
    return content


def deep_merge(base: Any, over: Any) -> Any:
    """``over`` onto ``base``: mappings merge key by key, anything else replaces. The result shares
    no container with its inputs (a YAML alias must not become one object in two places)."""
    if isinstance(base, dict) and isinstance(over, dict):
        out = {k: _copy(v) for k, v in base.items()}
        for key, value in over.items():
            out[key] = deep_merge(base[key], value) if key in base else _copy(value)
        return out
    return _copy(over)


def _copy(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _copy(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_copy(v) for v in value]
    return value


# -- YAML with line numbers in every message ---------------------------------------------------------

class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key written twice in one mapping (YAML would keep the last)."""


def _construct_mapping(loader: _UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        line = key_node.start_mark.line + 1
        try:
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key '{key}' (first on line {seen[key]}): YAML would keep only the "
                                f"last one; write each key once", key_node.start_mark)
            seen[key] = line
        except TypeError:
            pass  # an unhashable key: the base constructor reports it
    return loader.construct_mapping_base(node, deep=deep)


_UniqueKeyLoader.construct_mapping_base = yaml.SafeLoader.construct_mapping
_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG,
                                 lambda loader, node: _construct_mapping(loader, node))


def read_yaml_file(path: str, with_package: bool = False) -> Any:
    """Parse a YAML file; any problem is one ConfigError naming ``file:line``."""
    if os.path.isdir(path):
        raise ConfigError(f"{path}: is a directory, not a YAML file")
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read ({exc.strerror})") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[:exc.start].count(b"\n") + 1
        raise ConfigError(f"{path}:{line}: not UTF-8 text (byte 0x{data[exc.start]:02x}); save the file as "
                          f"UTF-8") from None
    try:
        content = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise ConfigError(yaml_error_message(path, exc)) from None
    if not with_package:
        return content
    return content, _package_header(text)


def yaml_error_message(path: str, exc: yaml.YAMLError) -> str:
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or str(exc)
    context = getattr(exc, "context", None) or ""
    context_mark = getattr(exc, "context_mark", None)
    opened = {"while scanning a quoted scalar": "a quoted string", "while parsing a flow sequence": "a '['",
              "while parsing a flow mapping": "a '{'", "while scanning a block scalar": "a block scalar"}
    for start, what in opened.items():
        if context.startswith(start) and context_mark is not None and (
                "end of stream" in problem or "stream end" in problem or context_mark.line != getattr(mark, "line", -1)):
            return (f"{path}:{context_mark.line + 1}: not valid YAML ({what} opens here, column "
                    f"{context_mark.column + 1}, and is never closed)")
    where = f"{path}:{mark.line + 1}" if mark is not None else path
    if problem.startswith("duplicate key"):
        return f"{where}: {problem}"
    return f"{where}: not valid YAML ({problem})"


# '# @package x' among the comment and blank lines a config file opens with
_PACKAGE_HEADER = re.compile(r"(?:[ \t\r]*(?:#.*)?\n)*?[ \t]*#+[ \t]*@package(.*)")


def _package_header(text: str) -> str | None:
    match = _PACKAGE_HEADER.match(text)
    return (match.group(1).strip() or None) if match else None
