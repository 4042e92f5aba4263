"""Imports inside nexrl_core point down the layers of docs/architecture.md, and no two modules
import each other (directly or round a circle), counting imports inside functions and under
``if TYPE_CHECKING:``: a function-level import is still a dependency, only a later one."""

from __future__ import annotations

import ast
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CORE = REPO / "nexrl_core"

# Bottom to top. A folder is one layer, named by its prefix; a module at the top of nexrl_core/ is
# named alone. A module belongs to the layer of its longest matching prefix; it may import its own
# layer and those below. Keep in step with the table in docs/architecture.md.
LAYERS: list[tuple[str, tuple[str, ...]]] = [
    ("base", ("nexrl_core.errors", "nexrl_core.markers", "nexrl_core.types", "nexrl_core.redaction",
              "nexrl_core.tool_calls", "nexrl_core.evaluation", "nexrl_core.protocols",
              "nexrl_core.trajectory_keys")),
    # what a recipe may hold: imports nothing above it (no component, no plugin manager)
    ("config", ("nexrl_core.config",)),
    ("algorithms", ("nexrl_core.algorithms",)),
    # what the data path runs on, and the run directory's records
    ("runtime", ("nexrl_core.runtime", "nexrl_core.checkpoint")),
    # the seed's modules: receive their parts, never look up the plugin manager
    ("components", ("nexrl_core.dataloader", "nexrl_core.rollout_worker", "nexrl_core.trajectory_pool",
                    "nexrl_core.trainer", "nexrl_core.weight_sync", "nexrl_core.validator")),
    ("plugins", ("nexrl_core.hookspecs", "nexrl_core.plugins")),
    ("builtins", ("nexrl_core.builtins",)),
    # resolve names through the plugin manager: compose and check a recipe, build the modules and their parts
    ("launch", ("nexrl_core.launch",)),
    ("controller", ("nexrl_core.controller",)),
    ("surface", ("nexrl_core", "nexrl_core.api", "nexrl_core.cli", "nexrl_core.testing")),
]
TOP_MODULES_AT_MOST = 20


def module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer_of(module: str) -> int:
    best, found = -1, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, found = len(prefix), i
    assert found >= 0, f"{module} is in no layer: add it to LAYERS"
    return found


def core_imports(source: str, module: str, is_package: bool, known: set[str]) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a nexrl_core module in ``source``, at any depth."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            # `from . import x` / `from .pkg import mod`: the module x when there is one
            names = [f"{target}.{a.name}" if f"{target}.{a.name}" in known else target for a in node.names]
        else:
            continue
        for name in names:
            if name.split(".")[0] != "nexrl_core":
                continue
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name != module:
                out.append((node.lineno, name))
    return out


def import_graph() -> dict[str, list[tuple[int, str]]]:
    files = {module_name(p): p for p in CORE.rglob("*.py") if "__pycache__" not in p.parts}
    known = set(files)
    return {m: core_imports(p.read_text(encoding="utf-8"), m, p.name == "__init__.py", known)
            for m, p in sorted(files.items())}


def upward_imports(graph: dict[str, list[tuple[int, str]]]) -> list[str]:
    problems = []
    for module, imports in graph.items():
        mine = layer_of(module)
        for line, target in imports:
            theirs = layer_of(target)
            if theirs > mine:
                path = module.replace(".", "/") + ("/__init__.py" if (REPO / module.replace(".", "/")).is_dir()
                                                   else ".py")
                problems.append(f"{path}:{line}: {module} ({LAYERS[mine][0]}) imports {target} "
                                f"({LAYERS[theirs][0]}), a layer above it")
    return problems


def import_circles(graph: dict[str, list[tuple[int, str]]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for _, w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                circles.append(sorted(group))

    for v in graph:
        if v not in index:
            visit(v)
    return sorted(circles)


def test_the_checkers_see_function_level_imports_and_circles():
    known = {"nexrl_core", "nexrl_core.config", "nexrl_core.config.schema", "nexrl_core.trainer",
             "nexrl_core.plugins", "nexrl_core.types"}
    source = ("from ..types import Trajectory\n"
              "def f():\n    from ..trainer import BaseTrainer\n"
              "if True:\n    import nexrl_core.plugins\n")
    found = core_imports(source, "nexrl_core.config.schema", False, known)
    assert sorted(found) == [(1, "nexrl_core.types"), (3, "nexrl_core.trainer"), (5, "nexrl_core.plugins")]
    graph = {"nexrl_core.config.schema": found, "nexrl_core.trainer": [(1, "nexrl_core.config.schema")]}
    assert upward_imports(graph) == [
        "nexrl_core/config/schema.py:3: nexrl_core.config.schema (config) imports nexrl_core.trainer "
        "(components), a layer above it",
        "nexrl_core/config/schema.py:5: nexrl_core.config.schema (config) imports nexrl_core.plugins "
        "(plugins), a layer above it"]
    assert import_circles(graph) == [["nexrl_core.config.schema", "nexrl_core.trainer"]]


def test_every_core_module_has_a_layer():
    for module in import_graph():
        layer_of(module)


def test_folders_are_layers():
    """A prefix is a folder or a module at the top: no folder is split between layers."""
    folders = {p.name for p in CORE.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
    for name, prefixes in LAYERS:
        for prefix in prefixes:
            parts = prefix.split(".")
            assert len(parts) <= 2, f"{prefix} ({name}) names a module inside a folder: a folder is one layer"
            if len(parts) == 2:
                assert parts[1] in folders or (CORE / f"{parts[1]}.py").exists(), prefix
    tops = sorted(p.name for p in CORE.glob("*.py"))
    assert len(tops) <= TOP_MODULES_AT_MOST, f"{len(tops)} modules at the top of nexrl_core/: {tops}"


def test_no_alias_modules():
    """A module whose body only imports (re-exports another under an old path) is gone: nothing has
    been released, so nothing needs one. Packages' ``__init__`` files may gather names."""
    def only_imports(path: Path) -> bool:
        body = ast.parse(path.read_text(encoding="utf-8")).body
        if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
            body = body[1:]  # the docstring
        return all(isinstance(node, (ast.Import, ast.ImportFrom, ast.Expr)) for node in body)

    aliases = [str(p.relative_to(REPO)) for p in CORE.rglob("*.py")
               if p.name not in {"__init__.py", "__main__.py"} and "__pycache__" not in p.parts and only_imports(p)]
    assert aliases == []


def test_imports_point_down_the_layers():
    problems = upward_imports(import_graph())
    assert problems == [], "upward imports (docs/architecture.md, the layers):\n" + "\n".join(problems)


def test_no_import_circle():
    circles = import_circles(import_graph())
    assert circles == [], "modules that import each other, counting imports inside functions:\n" + \
        "\n".join(" <-> ".join(c) for c in circles)


def test_components_never_look_up_the_plugin_manager():
    """Evaluators, backends, train services and sinks are handed in by the launcher (launch/parts.py)."""
    graph = import_graph()
    components = [m for m in graph if LAYERS[layer_of(m)][0] in {"base", "config", "algorithms", "runtime",
                                                                    "components"}]
    lookups = [f"{m} imports {t}" for m in components for _, t in graph[m] if t == "nexrl_core.plugins"]
    assert lookups == []
