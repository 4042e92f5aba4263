"""Declared options: what a recipe mapping may hold, with type, default, range and help. A
component declares the keys of its recipe section as ``OPTIONS = {"key": Option(...)}`` or as a
typed ``SETTINGS`` class (:mod:`.settings`; both: docs/plugins.md, "Declaring options").

``nexrl validate`` and ``nexrl run`` check a recipe against these declarations with the same
function (:func:`check_options`): unknown keys (with a "did you mean"), wrong types,
non-finite numbers, values out of range or not among the choices, missing required keys,
nested mappings. Declarations are inherited along the class hierarchy (a subclass adds to
its bases' options). The core's own sections are declared the same way
(:mod:`nexrl_core.config.schema`), and the help texts feed the recipe reference.

An evaluator without ``OPTIONS`` is described by its ``__init__`` signature: each keyword
parameter is an option, typed by its annotation (or its default's type) and required when
it has no default.
"""

from __future__ import annotations

import copy
import inspect
import math
import re
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from difflib import get_close_matches
from typing import Any

from ..redaction import add_secret, is_secret_key
from ..types import lookup

__all__ = ["REQUIRED", "Capabilities", "Option", "check_options", "component_capabilities", "component_options",
           "describe_type", "option_defaults", "options_from_signature", "unmet_needs"]


class _Marker:
    def __init__(self, name: str):
        self._name = name

    def __repr__(self) -> str:
        return self._name


REQUIRED: Any = _Marker("REQUIRED")  # default of an option the recipe must set
_UNSET: Any = _Marker("UNSET")


@dataclass(frozen=True)
class Option:
    """One recipe key.

    :param default: the value when the recipe omits the key; :data:`REQUIRED` when it must
        be set. A mapping option with ``options`` and no default defaults to its options'
        defaults.
    :param type: what the value may be: ``bool``, ``int``, ``float`` (an int is accepted),
        ``str``, ``list``/``list[str]``, ``dict``, ``X | None``, ``Literal[...]``, ``Any``,
        or a tuple of those (any of them). Inferred from ``default`` when left out.
    :param help: one line for ``nexrl validate`` messages and the recipe reference.
    :param choices: the allowed values.
    :param ge, gt, le, lt: numeric bounds (>=, >, <=, <). Numbers must also be finite.
    :param options: for a mapping: its keys' own options (checked recursively).
    :param values: for a mapping whose keys the user names (domains, say): the option every
        value is checked against.
    :param check: extra rule ``fn(value) -> problem or None``, run when the type is right.
    :param removed: the key is no longer read; the text says what to do instead.
    :param component: core use: the mapping selects a registered component of this kind
        (``"trainer"``, ``"dataloader"``...) by its ``selector`` key; the component's own
        options are allowed next to ``options``.
    :param path: a file or folder the run reads (a string or a list of them): a relative path
        written in a recipe file is looked up next to that recipe first (one given as an
        override stays relative to the current folder).
    :param secret: the value is a credential: it never reaches a file, a log line or the console
        (``***`` there; see :mod:`nexrl_core.redaction`). Keys named like one (``api_key``,
        ``password``, ``*_token``...) are secret whether declared so or not.
    :param needs: the key acts only together with another: a value other than the default is
        an error while the condition does not hold (:func:`unmet_needs`). A condition is
        ``"key"`` (true), ``"key == value"``, ``"key != value"`` or ``"key > number"``, joined
        with `` or ``; a tuple of them must all hold. ``key`` is dotted from the recipe's root,
        or ``.key`` for a key of the same mapping.
    """

    default: Any = _UNSET
    type: Any = None
    help: str = ""
    choices: tuple[Any, ...] | None = None
    ge: float | None = None
    gt: float | None = None
    le: float | None = None
    lt: float | None = None
    options: Mapping[str, Option] | None = None
    values: Option | None = None
    check: Callable[[Any], str | None] | None = None
    removed: str | None = None
    component: str | None = None
    selector: str = "type"
    path: bool = False
    secret: bool = False
    needs: str | tuple[str, ...] | None = None

    @property
    def required(self) -> bool:
        return self.default is REQUIRED

    def default_value(self) -> Any:
        """The default, with a mapping's default built from its options."""
        if self.default is _UNSET:
            return option_defaults(self.options) if self.options is not None else None
        if self.default is REQUIRED:
            return None
        # A copy of a mutable default: a caller filling a section must never change the declaration.
        return copy.deepcopy(self.default) if isinstance(self.default, (dict, list)) else self.default

    def spec(self) -> _Spec:
        if self.type is not None:
            spec = _spec(self.type)
        elif self.options is not None or self.values is not None:
            spec = _Spec("dict")
        else:
            default = self.default_value()  # typed by its default
            spec = _spec(type(default)) if default is not None else _Spec("any")
        if self.default_value() is None and not self.required and not spec.accepts(None):
            spec = _Spec("union", parts=(spec, _Spec("none")))
        return spec


@dataclass(frozen=True)
class Capabilities:
    """What a component brings to a run and what it needs from the others.

    ``nexrl validate`` (and ``nexrl run``) check that the chosen trainer, inference backend
    and weight-sync backend fit together: every capability one of them ``requires`` must be
    ``provided`` by one of them. Capabilities are free-form strings; the core's are
    ``"trainer:state_dict"`` (the trainer exports its weights as tensors in this process),
    ``"weight_sync:state_dict"`` (something delivers those tensors to the inference
    service) and ``"inference:load_weights"`` (the inference backend loads tensors in
    process). A plugin names its own (``"weight_sync:vllm"``, ``"inference:tinker"``...).

    :param provides: capabilities this component supplies.
    :param requires: capability -> why it is needed (shown when it is missing).
    """

    provides: AbstractSet[str] = frozenset()  # any set of names; kept as a frozenset
    requires: Mapping[str, str] = None  # type: ignore[assignment]

    def __post_init__(self) -> None:
        object.__setattr__(self, "provides", frozenset(self.provides))
        object.__setattr__(self, "requires", dict(self.requires or {}))


def component_capabilities(cls: type) -> Capabilities:
    caps = getattr(cls, "CAPABILITIES", None)
    return caps if isinstance(caps, Capabilities) else Capabilities()


# -- where declarations come from --------------------------------------------------------------

def component_options(cls: type, attr: str = "OPTIONS") -> dict[str, Option] | None:
    """The options ``cls`` declares (a typed ``SETTINGS`` class, or ``OPTIONS``), merged along its
    class hierarchy. None when no class in the hierarchy declares any."""
    merged: dict[str, Option] = {}
    found = False
    for klass in reversed(cls.__mro__):
        settings = klass.__dict__.get("SETTINGS") if attr == "OPTIONS" else None
        for table in (settings.options() if settings is not None else None, klass.__dict__.get(attr)):
            if table is not None:
                found = True
                merged.update(table)
    return merged if found else None


def options_from_signature(func: Callable[..., Any], skip: tuple[str, ...] = ("self",),
                           doc: str | None = None) -> dict[str, Option] | None:
    """Options described by a constructor's keyword parameters; None when it takes ``**kwargs``
    (anything goes). Annotations give the types; a parameter without a default is required;
    its ``:param name: text`` line (in ``func``'s docstring, else in ``doc``) is its help."""
    sig = inspect.signature(func)
    helps = {**param_docs(doc or ""), **param_docs(inspect.getdoc(func) or "")}
    try:
        hints = typing.get_type_hints(func)
    except Exception:  # an annotation that does not evaluate: fall back to the defaults' types
        hints = {}
    out: dict[str, Option] = {}
    for name, p in sig.parameters.items():
        if name in skip or p.kind == p.VAR_POSITIONAL:
            continue
        if p.kind == p.VAR_KEYWORD:
            return None
        default = REQUIRED if p.default is p.empty else p.default
        # an annotation get_type_hints could not resolve: as written, unless it is a string
        written = None if isinstance(p.annotation, str) or p.annotation is p.empty else p.annotation
        out[name] = Option(default, hints.get(name, written), helps.get(name, ""))
    return out


def param_docs(doc: str) -> dict[str, str]:
    """``{name: text}`` of the ``:param name: text`` fields of a docstring (continuation lines joined)."""
    out: dict[str, str] = {}
    name = None
    for line in doc.splitlines():
        match = re.match(r"\s*:param (?:[\w\[\], |.]+ )?(\w+):\s*(.*)", line)
        if match:
            name = match.group(1)
            out[name] = match.group(2).strip()
        elif name is not None and line.startswith((" ", "\t")) and line.strip() and not line.strip().startswith(":"):
            out[name] += " " + line.strip()
        else:
            name = None
    return out


def option_defaults(options: Mapping[str, Option] | None) -> dict[str, Any]:
    """Recipe-shaped defaults of ``options`` (required and removed keys left out)."""
    out: dict[str, Any] = {}
    for key, opt in (options or {}).items():
        if opt.removed is not None or opt.required:
            continue
        out[key] = opt.default_value()
    return out


# -- checking ----------------------------------------------------------------------------------

class Check:
    """Walks a mapping against its options, one line per problem. The recipe check subclasses it
    to resolve the components a section selects (:meth:`value`) and word its hints (:meth:`hint`).

    :param root: the whole recipe, what keys that act only with another (``needs``) look up; None:
        their conditions are not checked.
    """

    def __init__(self, root: Any = None):
        self.root = root

    def mapping(self, values: Any, options: Mapping[str, Option] | None, path: str, owner: str = "",
                listed: list[str] | None = None) -> list[str]:
        """Every problem of the mapping ``values`` against ``options`` (None: any key). ``owner``
        is named in an unknown-key message, with the keys it accepts (``listed``; None: all)."""
        if not isinstance(values, Mapping):
            return [f"{path or 'the recipe'}: expected a mapping, got {type_name(values)}{self.hint(path, values)}"]
        if options is None:
            return []
        problems: list[str] = []
        known = [k for k, o in options.items() if o.removed is None]
        for key, value in values.items():
            key = str(key)
            full, opt = f"{path}.{key}" if path else key, options.get(key)
            if opt is None:
                problems.append(unknown_key(key, path, known, owner, known if listed is None else listed))
            elif opt.removed is not None:
                problems.append(removed_key(full, opt))
            else:
                problems += self.value(value, opt, full)
        for key, opt in options.items():
            if opt.required and opt.removed is None and values.get(key) is None:
                full = f"{path}.{key}" if path else key
                problems.append(f"{full}: required{f' ({opt.help})' if opt.help else ''}")
        if not problems and self.root is not None:  # nested sections are judged as the walk reaches them
            problems = unmet_needs(values, options, path, self.root, recursive=False)
        return problems

    def value(self, value: Any, opt: Option, path: str) -> list[str]:
        """Problems of one value against its option (type, finiteness, range, choices, nested keys).

        A secret's value (``Option(secret=True)``, or a key named like one) is remembered here, as
        every recipe is checked before a run writes anything, and never quoted in a message."""
        secret = opt.secret or is_secret_key(path.rsplit(".", 1)[-1])
        if secret:
            add_secret(value)
        spec = opt.spec()
        if value is None:
            if opt.required:
                return []  # reported once, as "required", by mapping()
            return [] if spec.accepts(None) else [f"{path}: expected {spec.describe()}, got null"]
        if isinstance(value, str) and value == "???":
            return [f"{path}: a value is required here (the recipe has '???')"]
        if opt.options is not None and not isinstance(value, Mapping):
            return [f"{path}: expected a mapping, got {type_name(value)}{self.hint(path, value)}"]
        if not spec.accepts(value):
            shown = "" if secret else f"{_show(value)}{_yaml_hint(value, spec)}"
            return [f"{path}: expected {spec.describe()}, got {type_name(value)}{shown}"]
        bad_number = _non_finite(value)
        if bad_number is not None:
            return [f"{path}: expected a finite number, got {bad_number}"]
        for choices in (opt.choices, spec.literal_choices()):
            if choices is not None and value not in choices:
                if secret:
                    return [f"{path}: the value is not one of {', '.join(str(c) for c in choices)}"]
                return [f"{path}: {value!r} is not one of {', '.join(str(c) for c in choices)}"
                        f"{_closest(value, choices)}"]
        if _is_number(value) and not _in_range(float(value), opt):
            return [f"{path}: expected {_range_words(opt, value)}, got {value!r}"]
        problems: list[str] = []
        if opt.options is not None:
            problems += self.mapping(value, opt.options, path)
        if opt.values is not None and isinstance(value, Mapping):
            problems += [p for key, item in value.items() for p in self.value(item, opt.values, f"{path}.{key}")]
        if not problems and opt.check is not None:
            message = opt.check(value)
            if message:
                problems.append(f"{path}: {message}")
        return problems

    def hint(self, path: str, value: Any) -> str:
        return _show(value)


def check_options(values: Any, options: Mapping[str, Option] | None, path: str, *, owner: str = "") -> list[str]:
    """Every problem of the mapping ``values`` (plain data) against ``options`` (None: any key),
    one line each, prefixed by its dotted ``path``: :meth:`Check.mapping`, which lists the keys
    an ``owner`` (``"evaluator 'exact_match'"``) accepts."""
    return Check().mapping(values, options, path, owner)


# -- keys that act only together with another ------------------------------------------------------

def _condition(text: str, section: Mapping[str, Any], options: Mapping[str, Option], path: str,
               root: Any) -> tuple[bool, str]:
    """Whether one ``or``-alternative holds, and its words (``algorithm.use_kl_loss: true``)."""
    key, op, operand = (text.split(" ", 2) + ["", ""])[:3]
    if key.startswith("."):  # a key of the same mapping: its declared default when the recipe omits it
        value = section.get(key[1:])
        if key[1:] not in section and key[1:] in options:
            value = options[key[1:]].default_value()
        key = f"{path}{key}" if path else key[1:]
    else:
        value = lookup(root, key)
    if not op:
        return bool(value), f"{key}: true"
    import yaml

    want = yaml.safe_load(operand)
    if op == "==":
        return value == want, f"{key}: {operand}"
    if op == "!=":
        return value != want, f"{key} other than {operand}"
    if op == ">":
        return _is_number(value) and value > want, f"{key} > {operand}"
    raise ValueError(f"needs: unknown operator in {text!r}")


def unmet_needs(values: Any, options: Mapping[str, Option] | None, path: str, root: Any,
                recursive: bool = True) -> list[str]:
    """Keys set (to a value other than their default) whose ``needs`` does not hold: each does
    nothing, so each is one line naming the key it needs. Walks nested sections; named entries
    (``values=``) are skipped, since their settings inherit from elsewhere."""
    if not isinstance(values, Mapping) or not options:
        return []
    problems = []
    for key, value in values.items():
        opt = options.get(str(key))
        if opt is None or opt.removed is not None:
            continue
        full = f"{path}.{key}" if path else str(key)
        if opt.needs is not None and value != opt.default_value():
            for need in (opt.needs,) if isinstance(opt.needs, str) else opt.needs:
                held = [_condition(alt.strip(), values, options, path, root) for alt in need.split(" or ")]
                if not any(ok for ok, _ in held):
                    problems.append(f"{full}: does nothing without {' or '.join(w for _, w in held)} "
                                    f"(set that, or delete {full})")
                    break
            if problems and problems[-1].startswith(f"{full}: "):
                continue  # one line for a section that does nothing, not one per key inside
        if recursive and opt.options is not None and isinstance(value, Mapping):
            problems += unmet_needs(value, opt.options, full, root)
    return problems


#: What a key of a NexRL or ROLL recipe became, for the message of a key nexrl does not read: the
#: migration table's ``hint`` and ``suffix`` (nexrl_core.cli.migration_table, which importing nexrl_core
#: loads, registers them: the table is ``nexrl migrate``'s data, above this layer).
SEED_KEY_WORDS: dict[str, Callable[[str], Any]] = {}


def removed_key(full: str, opt: Option) -> str:
    """The message of a key nexrl no longer reads (pointing at ``nexrl migrate`` for a seed key)."""
    suffix = SEED_KEY_WORDS["suffix"](full) if SEED_KEY_WORDS else ""
    return f"{full}: no longer a recipe key: {opt.removed}{suffix}"


def _closest(value: Any, choices: tuple[Any, ...]) -> str:
    by_lower = {str(c).lower(): str(c) for c in choices}
    hit = by_lower.get(str(value).lower())
    if hit is None:
        close = get_close_matches(str(value).lower(), list(by_lower), n=1)
        hit = by_lower[close[0]] if close else None
    return f"; did you mean {hit!r}?" if hit else ""


def unknown_key(key: str, path: str, known: list[str], owner: str = "", listed: list[str] | None = None) -> str:
    """``path.key: unknown key; did you mean ...?`` and, for a component with few options of its
    own (``listed``), which ones it accepts."""
    full = f"{path}.{key}" if path else key
    hint = SEED_KEY_WORDS["hint"](full) if SEED_KEY_WORDS else None  # a NexRL or ROLL key: name nexrl's
    if hint is not None:
        return f"{full}: {hint}"
    hit = get_close_matches(key, sorted(set(known)), n=1)
    text = f"{full}: unknown key"
    if hit:
        text += f"; did you mean '{(path + '.') if path else ''}{hit[0]}'?"
    if owner and listed and len(listed) <= 10:
        text += f" ({owner} accepts: {', '.join(listed) or 'no options'})"
    return text


# -- type specs -----------------------------------------------------------------------------------

_SCALARS: dict[str, Callable[[Any], bool]] = {
    "any": lambda v: True, "none": lambda v: v is None, "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool), "float": lambda v: _is_number(v),
    "str": lambda v: isinstance(v, str)}
_WORDS = {"any": "any value", "none": "null", "bool": "a boolean", "int": "an integer", "float": "a number",
          "str": "a string", "list": "a list", "dict": "a mapping"}
_KINDS: dict[Any, str] = {bool: "bool", int: "int", float: "float", str: "str", dict: "dict", list: "list",
                          tuple: "list", set: "list", frozenset: "list", type(None): "none", None: "none", Any: "any",
                          object: "any", inspect.Parameter.empty: "any"}


class _Spec:
    """A normalised type: kind in any/none/bool/int/float/str/list/dict/union/literal."""

    def __init__(self, kind: str, parts: tuple[_Spec, ...] = (), item: _Spec | None = None,
                 values: tuple[Any, ...] = ()):
        self.kind, self.parts, self.item, self.values = kind, parts, item, values

    def accepts(self, value: Any) -> bool:
        k, item = self.kind, self.item
        if k in ("list", "dict"):
            container = (list, tuple) if k == "list" else Mapping
            items = value.values() if isinstance(value, Mapping) else value
            return isinstance(value, container) and (item is None or all(item.accepts(v) for v in items))
        if k == "union":
            return any(p.accepts(value) for p in self.parts)
        if k == "literal":
            return any(value == v and type(value) is type(v) for v in self.values) or \
                (all(isinstance(v, str) for v in self.values) and isinstance(value, str))
        return _SCALARS[k](value)

    def literal_choices(self) -> tuple[Any, ...] | None:
        if self.kind == "literal":
            return self.values
        lits = [p for p in self.parts if p.kind == "literal"]  # a union
        if lits and not any(p.kind in ("str", "any") for p in self.parts):
            return tuple(v for p in lits for v in p.values) + ((None,) if self.accepts(None) else ())
        return None

    def describe(self) -> str:
        k = self.kind
        if k == "list":
            if self.item is None or self.item.kind == "any":
                return _WORDS[k]
            kinds = [_plural(p.describe()) for p in (self.item.parts if self.item.kind == "union" else (self.item,))]
            return f"a list of {' or '.join(kinds)}"
        if k == "literal":
            return "one of " + ", ".join(repr(v) for v in self.values)
        if k == "union":
            text = " or ".join(p.describe() for p in self.parts if p.kind != "none")
            return f"{text} or null" if any(p.kind == "none" for p in self.parts) else text
        return _WORDS[k]


def _plural(words: str) -> str:
    words = words.removeprefix("an ").removeprefix("a ")
    return words if words.endswith("s") else words + "s"


def _spec(tp: Any) -> _Spec:
    if isinstance(tp, tuple):
        return _Spec("union", parts=tuple(_spec(t) for t in tp))
    if isinstance(tp, str):  # a type named in words
        tp = {"bool": bool, "int": int, "float": float, "str": str, "list": list, "dict": dict}.get(tp, Any)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or isinstance(tp, types.UnionType):
        return _Spec("union", parts=tuple(_spec(a) for a in args))
    if origin is typing.Literal:
        return _Spec("literal", values=tuple(args))
    kind = _KINDS.get(origin if origin is not None else tp)
    if kind is None and isinstance(origin or tp, type):  # an abstract container, or Path (written as a string)
        cls = origin or tp
        kind = "dict" if issubclass(cls, Mapping) else "list" if issubclass(cls, Sequence) and not issubclass(
            cls, str) else "str" if cls.__name__ in ("Path", "PurePath", "PosixPath", "WindowsPath") else None
    if kind == "list" and origin is not None:
        return _Spec("list", item=_spec(args[0]) if args and args[0] is not Ellipsis else None)
    if kind == "dict" and origin is not None:
        return _Spec("dict", item=_spec(args[1]) if len(args) == 2 else None)
    return _Spec(kind or "any")


def describe_type(opt: Option) -> str:
    """The option's type in words (for references and messages)."""
    return opt.spec().describe()


# -- small helpers --------------------------------------------------------------------------------

def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _non_finite(value: Any) -> str | None:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)
    bad = [b for b in map(_non_finite, value) if b is not None] if isinstance(value, (list, tuple)) else []
    return bad[0] if bad else None


def _in_range(x: float, opt: Option) -> bool:
    return not ((opt.ge is not None and x < opt.ge) or (opt.gt is not None and x <= opt.gt)
                or (opt.le is not None and x > opt.le) or (opt.lt is not None and x >= opt.lt))


def _range_words(opt: Option, value: Any) -> str:
    integer = not opt.spec().accepts(0.5)
    noun = "integer" if integer else "number"
    if opt.le is None and opt.lt is None:
        if (opt.ge == 1 and integer) or (opt.gt == 0 and opt.ge is None):
            return f"a positive {noun}"
        if opt.ge == 0 and opt.gt is None:
            return f"a non-negative {noun}"
    bounds = []
    for sym, bound in ((">=", opt.ge), (">", opt.gt), ("<=", opt.le), ("<", opt.lt)):
        if bound is not None:
            bounds.append(f"{sym} {bound:g}")
    return f"a{'n' if integer else ''} {noun} {' and '.join(bounds)}"


def type_name(value: Any) -> str:
    """What ``value`` is, in the words of the type descriptions (bool before int: a bool is an int)."""
    kind = next((k for k in ("none", "bool", "int", "float", "str") if _SCALARS[k](value)), None)
    if kind is None:
        kind = "list" if isinstance(value, (list, tuple)) else "dict" if isinstance(value, Mapping) else None
    return _WORDS[kind] if kind else type(value).__name__


def _show(value: Any) -> str:
    if isinstance(value, (Mapping, list, tuple)) or value is None:
        return ""
    text = repr(value)
    return f" ({text if len(text) <= 60 else text[:57] + '...'})"


def _yaml_hint(value: Any, spec: _Spec) -> str:
    # PyYAML reads 1e-5 (no dot) as text: the commonest way to write a bad learning rate.
    if isinstance(value, str) and spec.accepts(1.5) and not spec.accepts("x"):
        try:
            float(value)
        except ValueError:
            return ""
        return "; YAML reads a number like 1e-5 as text: write 1.0e-5"
    return ""
