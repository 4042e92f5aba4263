"""A default is written once, where the option is declared: no module of nexrl_core or of a
plugin reads a declared key as ``x.get("key", <literal>)``, which would re-default it (and could
disagree with the declaration), nor as ``x.get("key") or L`` / ``x["key"] or L`` where ``L`` is a
declared default of that key (the section a component reads already holds it). Components read their
typed settings (``Settings.own``: every declared key, defaults filled) or their section (``cfg["key"]``).

Static (no plugin imported, no torch): the declared keys are those written ``"key": Option(...)``
or ``key: T = setting(...)`` anywhere in the scanned sources. A ``.get`` on a mapping that is not a recipe section (a checkpoint's
state, a wire message, a data row) may carry a literal: such reads are listed below with why."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def sources() -> list[Path]:
    roots = [REPO / "nexrl_core", *sorted(p for p in (REPO / "plugins").glob("*/nexrl_*") if p.is_dir())]
    return [p for root in roots for p in sorted(root.rglob("*.py")) if "build" not in p.relative_to(REPO).parts]


# (file, key): why the literal is not a re-default of a recipe option.
NOT_RECIPE = {
    ("nexrl_core/builtins/openai_client.py", "function"): "a tool call of an OpenAI answer (the wire format)",
    ("nexrl_core/tool_calls.py", "name"): "a tool call's function (the wire format)",
    ("nexrl_core/types.py", "batch_size"): "a Batch's metadata, not trajectory_pool.batch_size",
    ("plugins/nexrl_torch/nexrl_torch/train/service.py", "world_size"): "a checkpoint's saved world size",
    ("plugins/nexrl_grpo/nexrl_grpo/trainers.py", "algorithm"): "a checkpoint's saved algorithm state",
    ("plugins/nexrl_tinker/nexrl_tinker/trainers.py", "algorithm"): "a checkpoint's saved algorithm state",
    ("plugins/nexrl_nexau/nexrl_nexau/agent_config.py", "type"): "NexAU's own agent YAML format (and a tool's "
                                                                 "JSON schema)",
    ("plugins/nexrl_nexau/nexrl_nexau/xml_calls.py", "type"): "a tool's JSON schema",
    ("nexrl_core/cli/show.py", "rollout_correction"): "a finished run's config.yaml (an older run's may lack the "
                                                      "section); show/report are in flight in another lane (#31)",
}


# (file, key): why ``x.get(key) or L`` / ``x[key] or L`` (L a declared default of key) stays.
OR_KEPT = {
    ("nexrl_core/cli/show.py", "algorithm"): "a finished run's config.yaml (an older run's may lack the section); "
                                             "show/report are in flight in another lane (#31)",
}


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def declarations(path: Path):
    """``(key, Option or setting call)`` of each declaration in ``path``: ``"key": Option(...)`` (dict
    literals and ``OPTIONS = {...}`` alike) and ``key: T = setting(...)`` (a typed settings class)."""
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Dict):
            for k, v in zip(node.keys, node.values):
                if isinstance(k, ast.Constant) and isinstance(k.value, str) and _called(v) == "Option":
                    yield k.value, v
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and _called(node.value) == "setting":
            yield node.target.id, node.value


def _called(node: ast.expr | None) -> str | None:
    return getattr(node.func, "id", getattr(node.func, "attr", None)) if isinstance(node, ast.Call) else None


def declared_keys(files: list[Path]) -> set[str]:
    """Every key declared in ``files``."""
    return {key for path in files for key, _ in declarations(path)}


_NO_VALUE = object()


def _value(node: ast.expr | None) -> object:
    """The value a literal node writes; _NO_VALUE for anything else."""
    try:
        return ast.literal_eval(node) if node is not None else _NO_VALUE
    except (ValueError, TypeError, SyntaxError):
        return _NO_VALUE


def declared_defaults(files: list[Path]) -> dict[str, list[object]]:
    """key -> the literal defaults of its declarations in ``files`` (``Option(default, ...)``, ``setting(default, ...)``)."""
    out: dict[str, list[object]] = {}
    for path in files:
        for key, call in declarations(path):
            default = call.args[0] if call.args else next((kw.value for kw in call.keywords
                                                           if kw.arg == "default"), None)
            value = _value(default)
            if value is not _NO_VALUE:
                out.setdefault(key, []).append(value)
    return out


def _read_key(node: ast.expr) -> str | None:
    """``k`` of ``x.get("k")`` or ``x["k"]``; None for any other expression."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], ast.Constant) \
            and isinstance(node.args[0].value, str):
        return node.args[0].value
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value
    return None


def or_redefaults(path: Path, defaults: dict[str, list[object]]) -> list[tuple[int, str]]:
    """``(line, key)`` of each ``x.get("key") or L`` / ``x["key"] or L`` in ``path`` whose ``L`` equals
    (same type, same value) a declared default of ``key``."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.BoolOp) and isinstance(node.op, ast.Or) and len(node.values) == 2:
            key, fallback = _read_key(node.values[0]), _value(node.values[1])
            if key in defaults and fallback is not _NO_VALUE and \
                    any(fallback == d and type(fallback) is type(d) for d in defaults[key]):
                found.append((node.lineno, key))
    return found


def _literal(node: ast.expr) -> bool:
    """A value written in the source (not None: ``.get(key, None)`` re-defaults nothing)."""
    if isinstance(node, ast.Constant):
        return node.value is not None
    if isinstance(node, ast.UnaryOp) and isinstance(node.operand, ast.Constant):
        return True
    if isinstance(node, (ast.List, ast.Tuple, ast.Set)):
        return all(_literal(e) or (isinstance(e, ast.Constant)) for e in node.elts)
    if isinstance(node, ast.Dict):
        return all(k is not None and _literal(k) and (_literal(v) or isinstance(v, ast.Constant))
                   for k, v in zip(node.keys, node.values))
    return False


def redefaults(path: Path, declared: set[str]) -> list[tuple[int, str]]:
    """``(line, key)`` of each ``x.get("key", <literal>)`` in ``path`` whose key is declared."""
    found = []
    for node in ast.walk(_parse(path)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                and len(node.args) == 2 and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str) and node.args[0].value in declared and _literal(node.args[1]):
            found.append((node.lineno, node.args[0].value))
    return found


def test_no_module_redefaults_a_declared_key():
    files = sources()
    declared = declared_keys(files)
    assert {"launch_mode", "backend", "num_actors", "pause_mode", "seed"} <= declared  # the scan sees declarations
    bad = [f"{path.relative_to(REPO)}:{line}: .get({key!r}, <literal>) re-defaults a declared key; read the "
           f"section (cfg[{key!r}]) or its typed settings"
           for path in files for line, key in redefaults(path, declared)
           if (str(path.relative_to(REPO)), key) not in NOT_RECIPE]
    assert not bad, "\n".join(bad)


def test_every_exemption_is_still_needed():
    """An exemption whose read is gone goes too (the list stays the set of reasons that apply)."""
    files = sources()
    declared = declared_keys(files)
    hits = {(str(path.relative_to(REPO)), key) for path in files for _, key in redefaults(path, declared)}
    assert sorted(set(NOT_RECIPE) - hits) == []


def test_the_scan_finds_a_redefault(tmp_path):
    """The scan is not vacuous: the reads this issue removed are caught."""
    sample = tmp_path / "launcher.py"
    sample.write_text('def mode(config):\n    return config.get("launch_mode", "local")\n'
                      'def ok(config):\n    return config.get("launch_mode") or config["launch_mode"]\n'
                      'def level(cfg):\n    return cfg.get("level", "INFO"), cfg.get("betas", [0.9, 0.999])\n')
    assert redefaults(sample, {"launch_mode", "level", "betas"}) == [(2, "launch_mode"), (6, "level"), (6, "betas")]


def test_no_module_or_defaults_a_declared_key():
    files = sources()
    defaults = declared_defaults(files)
    assert defaults["seed"] and defaults["save_freq"] == [0]  # the scan sees declared defaults
    bad = [f"{path.relative_to(REPO)}:{line}: ({key!r} read) or <its declared default> repeats the declaration; "
           f"read the section (cfg[{key!r}]) or its typed settings"
           for path in files for line, key in or_redefaults(path, defaults)
           if (str(path.relative_to(REPO)), key) not in OR_KEPT]
    assert not bad, "\n".join(bad)


def test_every_or_exemption_is_still_needed():
    files = sources()
    defaults = declared_defaults(files)
    hits = {(str(path.relative_to(REPO)), key) for path in files for _, key in or_redefaults(path, defaults)}
    assert sorted(set(OR_KEPT) - hits) == []


def test_the_scan_finds_an_or_default(tmp_path):
    """``or`` with the declared default is caught (also inside a call); another fallback, a non-literal
    one and an undeclared key are not."""
    sample = tmp_path / "loader.py"
    sample.write_text('def seed(config):\n    return int(config["seed"] or 0)\n'
                      'def tags(own):\n    return own.get("tags") or [], own.get("tags") or ["x"]\n'
                      'def other(cfg, fallback):\n    return cfg["seed"] or fallback, cfg["rows"] or 0, cfg["seed"] or 0.0\n')
    assert or_redefaults(sample, {"seed": [0, "${seed}"], "tags": [[]]}) == [(2, "seed"), (4, "tags")]
