"""``nexrl migrate OLD.yaml [-o NEW.yaml]``: a NexRL (or ROLL) recipe rewritten as a nexrl recipe.

The rewrite follows :mod:`nexrl_core.config.migration_table` (also the source of docs/migrating.md):

1. the recipe's defaults list is composed, as ``nexrl run`` composes it;
2. keys move to nexrl's (``dataloader`` -> ``data``, ``max_steps`` -> ``trainer.total_train_steps``
   ...), then seed values become nexrl's (``data.type: torch`` -> ``file``), then the keys whose
   value needs converting (``evaluator_module_path: file.py:Class``, ROLL's ``rollout_batch_size``
   ...);
3. what the rest of the recipe decides is filled in (``weight.backend`` from the inference backend);
4. ``${...}`` references follow the keys they name;
5. every key nexrl still rejects is taken out and listed with the reason;
6. relative paths are rewritten for the new file's folder.

The result is then checked as ``nexrl validate`` checks it, and the Python files it names are
searched for the seed's imports (listed with nexrl's, never rewritten).
"""

from __future__ import annotations

import ast
import copy
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..config.migration_table import (
    IMPORT_RULES,
    KEY_RULES,
    VALUE_RULES,
    WEIGHT_BACKENDS,
    Context,
    KeyRule,
    get_key,
    rule_for,
)

_REJECTED = re.compile(r"^(?P<key>[^\s:]+): (?P<why>unknown key.*|no longer a recipe key: .*"
                       r"|expected a mapping, got null.*|does nothing without .*)$")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")  # ${a.b}: a key; ${oc.env:X} (a resolver) is left alone


@dataclass
class Change:
    """One line of the report: ``seed`` became ``nexrl`` (``kind`` moved, value or set), or was
    dropped with ``why``."""

    kind: str
    seed: str
    nexrl: str | None = None
    why: str = ""

    def text(self) -> str:
        if self.kind == "dropped":
            return f"{self.seed}: {self.why}"
        arrow = f"{self.seed} -> {self.nexrl}" if self.nexrl is not None else self.seed
        return f"{arrow} ({self.why})" if self.why else arrow


@dataclass
class Migration:
    """The nexrl recipe and what happened on the way."""

    recipe: dict[str, Any]
    changes: list[Change] = field(default_factory=list)
    imports: list[str] = field(default_factory=list)

    def of_kind(self, *kinds: str) -> list[Change]:
        return [c for c in self.changes if c.kind in kinds]

    def dropped(self) -> dict[str, str]:
        """seed key -> why it was not carried over."""
        return {c.seed: c.why for c in self.changes if c.kind == "dropped"}


class _Context(Context):
    def __init__(self, pm: Any, current: dict[str, Any]):
        self.pm = pm
        self.current = current

    def declares(self, kind: str, name: str, *keys: str) -> bool:
        from ..launch.recipe import declared_options

        registered = self.pm.components(kind).get(name)
        if registered is None:
            return False
        own = declared_options(kind, registered.cls)
        return own is None or all(k in own for k in keys)


# -- dotted access ---------------------------------------------------------------------------------

def _has(values: Any, dotted: str) -> bool:
    *parents, leaf = dotted.split(".")
    node = get_key(values, ".".join(parents)) if parents else values
    return isinstance(node, Mapping) and leaf in node


def _pop(values: dict[str, Any], dotted: str) -> Any:
    """Take ``dotted`` out; a section left empty by it goes too."""
    *parents, leaf = dotted.split(".")
    chain = [values]
    for part in parents:
        chain.append(chain[-1][part])
    value = chain[-1].pop(leaf)
    for node, part in zip(reversed(chain[:-1]), reversed(parents)):
        if node[part] == {}:
            del node[part]
        else:
            break
    return value


def _clash(values: Any, dotted: str, value: Any) -> str | None:
    """Why ``value`` cannot go to ``dotted`` (None: it can): a different value is already there
    (the recipe wrote nexrl's key itself, and that one wins). Mappings merge."""
    *parents, leaf = dotted.split(".")
    node = values
    for i, part in enumerate(parents):
        if not isinstance(node, Mapping) or node.get(part) is None:
            return None
        node = node[part]
        if not isinstance(node, Mapping):
            return f"{'.'.join(parents[:i + 1])} is already {node!r}"
    current = node.get(leaf) if isinstance(node, Mapping) else None
    if current is None or current == value:
        return None
    if isinstance(current, Mapping) and isinstance(value, Mapping):
        for key, item in value.items():
            inner = _clash(current, str(key), item)
            if inner is not None:
                return f"{dotted}.{inner}"
        return None
    return f"{dotted} is already {current!r}"


def _put(values: dict[str, Any], dotted: str, value: Any) -> None:
    """Set ``dotted`` (after :func:`_clash` said it may); mappings merge into one already there."""
    *parents, leaf = dotted.split(".")
    node = values
    for part in parents:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(node.get(leaf), dict) and isinstance(value, dict):
        for key, item in value.items():
            _put(node[leaf], str(key), item)
    else:
        node[leaf] = value


def _leaves(value: Any, prefix: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{prefix}.{k}")]
    return [prefix]


# -- the rewrite -------------------------------------------------------------------------------------

def migrate_recipe(seed: Mapping[str, Any], pm: Any) -> Migration:
    """The nexrl recipe for a composed seed recipe (no defaults list), with every change listed.
    Paths are left as written (:func:`migrate_file` places them)."""
    original = copy.deepcopy(dict(seed))
    recipe: dict[str, Any] = copy.deepcopy(dict(seed))
    out = Migration(recipe)
    ctx = _Context(pm, recipe)
    moved: dict[str, str] = {}      # seed key -> nexrl key, for ${...} references
    dropped: dict[str, Any] = {}    # seed key -> value, for ${...} references to it

    def move(rule: KeyRule, targets: dict[str, Any]) -> None:
        value = _pop(recipe, rule.seed)
        if rule.convert is None:
            targets = {str(rule.nexrl): value}
        for key in targets:  # nexrl's key referring to the seed's (weight.validate_freq: ${validate.eval...})
            if get_key(recipe, key) == "${" + rule.seed + "}" or (key in rule.replaces and _has(recipe, key)):
                _pop(recipe, key)
        clashes = [c for key, item in targets.items() if (c := _clash(recipe, key, item)) is not None]
        if clashes:
            out.changes.append(Change("dropped", rule.seed, why=f"{'; '.join(clashes)} (kept)"))
            dropped[rule.seed] = value
            return
        for key, item in targets.items():
            _put(recipe, key, item)
        shown = [key for key in targets if key != rule.seed]  # data_config keeps what does not move up
        if shown or not targets:
            out.changes.append(Change("moved", rule.seed, ", ".join(shown) or rule.nexrl, rule.why))
        if len(shown) == 1:
            moved[rule.seed] = shown[0]

    for rule in KEY_RULES:  # plain moves: sections first, in table order
        if rule.convert is None and rule.nexrl is not None and _has(recipe, rule.seed):
            move(rule, {})
    for vrule in VALUE_RULES:
        if _has(recipe, vrule.key) and get_key(recipe, vrule.key) == vrule.seed:
            _put(recipe, vrule.key, vrule.nexrl)
            out.changes.append(Change("value", f"{vrule.key}: {vrule.seed}", str(vrule.nexrl), vrule.why))
    for rule in KEY_RULES:  # values that need converting
        if rule.convert is None or not _has(recipe, rule.seed):
            continue
        result = rule.convert(get_key(recipe, rule.seed), original, ctx)
        if isinstance(result, str):
            dropped[rule.seed] = _pop(recipe, rule.seed)
            out.changes.append(Change("dropped", rule.seed, why=result))
        else:
            move(rule, result)
    _derive(recipe, original, out, ctx)
    _follow_references(recipe, moved, dropped)
    for _ in range(3):  # a reference to a key dropped as unknown takes its value: check again
        newly = _drop_rejected(recipe, out, pm, moved)
        if not newly:
            break
        dropped.update(newly)
        _follow_references(recipe, moved, dropped)
    _order(recipe)
    return out


def _derive(recipe: dict[str, Any], original: Mapping[str, Any], out: Migration, ctx: _Context) -> None:
    """The nexrl keys the seed's recipe leaves to the rest of it (migration_table.DERIVED)."""
    backend = get_key(recipe, "service.inference_service.backend")
    weight = WEIGHT_BACKENDS.get(str(backend))
    if get_key(recipe, "weight.backend") is None and weight and weight in ctx.pm.components("weight_sync_backend"):
        _put(recipe, "weight.backend", weight)
        out.changes.append(Change("set", "weight.backend", weight, f"inference backend {backend}"))
    model = get_key(recipe, "service.inference_service.model_path")
    trainer = ctx.pm.components("trainer").get(str(get_key(recipe, "trainer.type")))
    service = get_key(recipe, "service.train_service.backend") or \
        (getattr(trainer.cls, "TRAIN_SERVICE_DEFAULT", None) if trainer is not None else None)
    if model and service and get_key(recipe, "service.train_service.model_path") is None \
            and ctx.declares("train_service", str(service), "model_path"):
        _put(recipe, "service.train_service.model_path", model)
        out.changes.append(Change("set", "service.train_service.model_path", str(model),
                                  "service.inference_service.model_path"))
    single_turn_math = get_key(original, "rollout_worker.type") == "single_turn_math"
    if single_turn_math and get_key(recipe, "rollout_worker.evaluator") is None:
        name = "math_rule" if "math_rule" in ctx.pm.components("evaluator") else "numeric_answer"
        _put(recipe, "rollout_worker.evaluator", {"type": name})
        out.changes.append(Change("set", "rollout_worker.evaluator.type", name, "rollout_worker.type single_turn_math"))


def _follow_references(recipe: dict[str, Any], moved: dict[str, str], dropped: dict[str, Any]) -> None:
    """In place: ``${old.key}`` -> ``${new.key}``; a value that is only a reference to a dropped
    key becomes that key's value. ``${oc.env:...}`` and other resolvers are left alone."""

    def target(key: str) -> str | None:
        for seed, nexrl in sorted(moved.items(), key=lambda kv: -len(kv[0])):
            if key == seed or key.startswith(seed + "."):
                return nexrl + key[len(seed):]
        return None

    def rewrite(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: rewrite(v) for k, v in value.items()}
        if isinstance(value, list):
            return [rewrite(v) for v in value]
        for _ in range(5):  # a dropped value may itself be a reference
            if not isinstance(value, str) or "${" not in value:
                return value
            whole = _REFERENCE.fullmatch(value)
            if whole and target(whole.group(1)) is None and whole.group(1) in dropped:
                value = dropped[whole.group(1)]
                continue
            return _REFERENCE.sub(lambda m: "${" + (target(m.group(1)) or m.group(1)) + "}", value)
        return value

    recipe.update(rewrite(recipe))


def _drop_rejected(recipe: dict[str, Any], out: Migration, pm: Any, moved: Mapping[str, str]) -> dict[str, Any]:
    """Take out every key ``nexrl validate`` rejects as unknown (or no longer read), each listed
    with the table's reason, else the check's words (a key moved here is listed under its seed
    name, and no longer as carried over). Returns the keys taken out and their values."""
    from ..launch.recipe import check_config

    taken: dict[str, Any] = {}
    for _ in range(8):  # a key taken out can change what its section's component accepts
        rejected = [(m["key"], m["why"]) for p in check_config(recipe, pm) if (m := _REJECTED.match(p))]
        rejected = [(k, w) for k, w in rejected if _has(recipe, k)]
        if not rejected:
            break
        for key, check_why in rejected:
            taken[key] = _pop(recipe, key)
            origin = next((seed for seed, nexrl in moved.items() if nexrl == key), None)
            if origin is not None:
                out.changes = [c for c in out.changes if not (c.kind == "moved" and c.seed == origin)]
            for leaf, why in _reasons(key, taken[key], check_why):
                out.changes.append(Change("dropped", f"{origin} (as {leaf})" if origin else leaf, why=why))
    return taken


def _reasons(key: str, value: Any, check_why: str) -> list[tuple[str, str]]:
    """One line per rejected key: the table's reason for it, else per inner key the table knows,
    else the check's words."""
    rule = rule_for(key)
    if rule is not None and rule.nexrl is None:
        inner = [leaf[len(key) + 1:] for leaf in _leaves(value, key) if leaf != key]
        return [(f"{key} ({', '.join(inner[:6])}{', ...' if len(inner) > 6 else ''})" if inner else key, rule.why)]
    if isinstance(value, dict) and any(r.seed.startswith(key + ".") for r in KEY_RULES):
        return [pair for k, v in value.items() for pair in _reasons(f"{key}.{k}", v, "unknown key")]
    why = check_why.split(" (nexrl migrate")[0]
    if why.startswith("expected a mapping, got null"):
        return [(key, "null: nexrl's defaults apply")]
    if why.startswith("unknown key"):
        why = "unknown key in nexrl" + why[len("unknown key"):].split("; a NexRL")[0].split("; a ROLL")[0]
    return [(key, why)]


def _order(recipe: dict[str, Any]) -> None:
    """Top-level keys in the order of nexrl's reference (docs/recipe.md)."""
    from ..config.schema import CORE_OPTIONS

    rank = {key: i for i, key in enumerate(CORE_OPTIONS)}
    items = sorted(recipe.items(), key=lambda kv: rank.get(str(kv[0]), len(rank)))
    recipe.clear()
    recipe.update(items)


# -- files -------------------------------------------------------------------------------------------

def compose_file(path: str) -> dict[str, Any]:
    """The recipe file with its defaults list merged in (as ``nexrl run`` composes it)."""
    from ..errors import ConfigError
    from ..launch.compose import Composer, deep_merge, read_yaml_file

    if not os.path.isfile(path):
        raise ConfigError(f"{path}: recipe file not found")
    raw = read_yaml_file(path)
    if not isinstance(raw, dict) or not raw:
        raise ConfigError(f"{path}: a recipe must be a mapping of keys")
    recipe: Any = {}
    for layer in Composer(path, []).layers(raw):
        recipe = deep_merge(recipe, layer)
    return recipe


def migrate_file(path: str, out_path: str, pm: Any) -> Migration:
    """:func:`migrate_recipe` of the file, with relative paths that name files next to it (or under
    ``$NEXRL_PATH``, where NexRL looked) rewritten for ``out_path``'s folder, and its Python files'
    imports of NexRL listed."""
    migration = migrate_recipe(compose_file(path), pm)
    seed_dir = os.path.dirname(os.path.abspath(path))
    out_dir = os.path.dirname(os.path.abspath(out_path))
    found = _place_paths(migration.recipe, [seed_dir, os.environ.get("NEXRL_PATH") or ""], out_dir, pm)
    migration.imports = [line for file in _python_files(found) for line in import_lines(file, out_dir)]
    return migration


def _place_paths(recipe: dict[str, Any], roots: list[str], out_dir: str, pm: Any) -> list[str]:
    """In place: each relative path found under one of ``roots`` becomes relative to ``out_dir``.
    Returns the Python files the recipe names and the NexAU workspace folder (absolute)."""
    from ..launch.recipe import resolve_recipe_paths

    resolved = copy.deepcopy(recipe)
    for root in roots:
        if root:
            resolve_recipe_paths(resolved, root, pm=pm)
    _nexau_paths(resolved, roots)
    found: list[str] = []

    def walk(node: Any, done: Any) -> Any:
        if isinstance(node, dict):
            return {k: walk(v, done.get(k) if isinstance(done, dict) else None) for k, v in node.items()}
        if isinstance(node, list):
            items = done if isinstance(done, list) and len(done) == len(node) else [None] * len(node)
            return [walk(v, d) for v, d in zip(node, items)]
        if isinstance(node, str) and isinstance(done, str) and done != node and os.path.isabs(done):
            found.append(done)
            return os.path.relpath(done, out_dir)
        if isinstance(node, str) and node.endswith(".py") and os.path.isfile(node):
            found.append(os.path.abspath(node))
        return node

    recipe.update(walk(recipe, resolved))
    workspace = get_key(resolved, "rollout_worker.nexau_agent_workspace")
    return [p for p in found if p.endswith(".py")] + ([workspace] if isinstance(workspace, str) else [])


def _nexau_paths(resolved: dict[str, Any], roots: list[str]) -> None:
    """The NexAU worker's files (its agent YAML, its workspace), as NexRL resolved them."""
    worker = resolved.get("rollout_worker")
    if not isinstance(worker, dict):
        return
    for key in ("nexau_agent_config_path", "nexau_agent_workspace"):
        value = worker.get(key)
        if isinstance(value, str) and value and not os.path.isabs(value) and "${" not in value:
            for root in roots:
                if root and os.path.exists(os.path.join(root, value)):
                    worker[key] = os.path.normpath(os.path.join(root, value))
                    break


def _python_files(paths: list[str], limit: int = 500) -> list[str]:
    """The Python files among ``paths`` and in the folders among them (the NexAU workspace)."""
    files: list[str] = []
    for path in dict.fromkeys(paths):
        if os.path.isfile(path) and path.endswith(".py"):
            files.append(path)
        elif os.path.isdir(path):
            for folder, _, names in os.walk(path):
                files += [os.path.join(folder, n) for n in sorted(names) if n.endswith(".py")]
                if len(files) >= limit:
                    break
    return list(dict.fromkeys(files))[:limit]


_IMPORTS = {rule.seed.rsplit(".", 1)[1]: rule for rule in IMPORT_RULES}


def import_lines(path: str, relative_to: str = "") -> list[str]:
    """``file:line: from nexrl.x import Name -> from nexrl_core import Name`` for each import of
    NexRL's package in a Python file (migration_table.IMPORT_RULES)."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=path)
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as exc:
        return [f"{path}: not read ({type(exc).__name__}: {exc})"]
    shown = os.path.relpath(path, relative_to) if relative_to else path
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and \
                (node.module == "nexrl" or node.module.startswith("nexrl.")):
            for alias in node.names:
                lines.append(f"{shown}:{node.lineno}: from {node.module} import {alias.name} -> "
                             f"{_replacement(alias.name)}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "nexrl" or alias.name.startswith("nexrl."):
                    lines.append(f"{shown}:{node.lineno}: import {alias.name} -> the names it uses, from "
                                 f"nexrl_core (docs/migrating.md#imports-and-classes)")
    return sorted(lines, key=lambda line: int(line.split(":")[1]))


def _replacement(name: str) -> str:
    rule = _IMPORTS.get(name)
    if rule is None:
        return "no counterpart known (docs/migrating.md#imports-and-classes)"
    if rule.nexrl is None:
        return f"none: {rule.why}"
    module, new = rule.nexrl.rsplit(".", 1)
    text = f"from {module} import {new}" if new == name else f"from {module} import {new} as {name}"
    return f"{text} ({rule.why})" if rule.why else text


# -- output ----------------------------------------------------------------------------------------

def to_yaml(recipe: Mapping[str, Any], source: str) -> str:
    import yaml

    head = f"# migrated from {source} by nexrl migrate (docs/migrating.md)\n"
    return head + yaml.safe_dump(dict(recipe), sort_keys=False, allow_unicode=True, width=100)


def report(migration: Migration) -> list[str]:
    """The report's lines: what moved, what was set, what was dropped and why, imports to change."""
    lines: list[str] = []
    sections = (("carried over", ("moved", "value")), ("set from the rest of the recipe", ("set",)),
                ("not carried over", ("dropped",)))
    for title, kinds in sections:
        changes = migration.of_kind(*kinds)
        if changes:
            lines.append(f"{title}:")
            lines += [f"  {c.text()}" for c in changes]
    if migration.imports:
        lines.append("imports of NexRL to change in the files the recipe names:")
        lines += [f"  {line}" for line in migration.imports]
    return lines
