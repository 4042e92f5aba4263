"""A default is written once, where the option is declared: no module of nexrl_core or of a
plugin reads a declared key as ``x.get("key", <literal>)``, which would re-default it (and could
disagree with the declaration). Components read their bound section (``cfg["key"]``), the launcher
:func:`nexrl_core.config.bound.declared_value`.

Static (no plugin imported, no torch): the declared keys are those written ``"key": Option(...)``
anywhere in the scanned sources. A ``.get`` on a mapping that is not a recipe section (a checkpoint's
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
    ("plugins/nexrl_grpo/nexrl_grpo/train_service.py", "world_size"): "a checkpoint's saved world size",
    ("plugins/nexrl_grpo/nexrl_grpo/trainers.py", "algorithm"): "a checkpoint's saved algorithm state",
    ("plugins/nexrl_tinker/nexrl_tinker/trainers.py", "algorithm"): "a checkpoint's saved algorithm state",
    ("plugins/nexrl_nexau/nexrl_nexau/agent_config.py", "type"): "NexAU's own agent YAML format (and a tool's "
                                                                 "JSON schema)",
    ("plugins/nexrl_nexau/nexrl_nexau/xml_calls.py", "type"): "a tool's JSON schema",
}


@functools.lru_cache(maxsize=None)
def _parse(path: Path) -> ast.AST:
    return ast.parse(path.read_text(), str(path))


def declared_keys(files: list[Path]) -> set[str]:
    """Every ``"key": Option(...)`` in ``files`` (dict literals and ``OPTIONS = {...}`` alike)."""
    keys: set[str] = set()
    for path in files:
        for node in ast.walk(_parse(path)):
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values):
                    if isinstance(k, ast.Constant) and isinstance(k.value, str) and isinstance(v, ast.Call) \
                            and getattr(v.func, "id", getattr(v.func, "attr", None)) == "Option":
                        keys.add(k.value)
    return keys


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
    bad = [f"{path.relative_to(REPO)}:{line}: .get({key!r}, <literal>) re-defaults a declared key; read the bound "
           f"section (cfg[{key!r}]) or nexrl_core.config.bound.declared_value"
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
