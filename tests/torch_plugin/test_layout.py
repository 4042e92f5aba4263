"""nexrl-torch's shape: ``train/`` and ``rollout/`` stand side by side on ``models`` and ``logprobs``,
neither imports the other, no module of the backend imports the GRPO algorithm, and no two modules
import each other (imports inside functions counted)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.core.test_layers import import_circles

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"nexrl_torch": REPO / "plugins" / "nexrl_torch", "nexrl_grpo": REPO / "plugins" / "nexrl_grpo",
            "nexrl_torch_kernels": REPO / "plugins" / "nexrl_torch_kernels"}


def module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def graph(prefixes: tuple[str, ...]) -> dict[str, list[tuple[int, str]]]:
    files = {module_name(root, p): p for root in PACKAGES.values() for p in root.rglob("*.py")
             if "__pycache__" not in p.parts and ".egg-info" not in str(p)}
    known = set(files)
    out = {}
    for module, path in files.items():
        names = []
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = package[: len(package) - node.level + 1]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                names += [(node.lineno, f"{target}.{a.name}" if f"{target}.{a.name}" in known else target)
                          for a in node.names]
            elif isinstance(node, ast.Import):
                names += [(node.lineno, a.name) for a in node.names]
        resolved = []
        for line, name in names:
            while name not in known and "." in name:
                name = name.rsplit(".", 1)[0]
            if name in known and name != module and name.startswith(prefixes):
                resolved.append((line, name))
        out[module] = resolved
    return out


def test_train_and_rollout_do_not_import_each_other():
    imports = graph(("nexrl_torch", "nexrl_grpo", "nexrl_torch_kernels"))
    crossings = [f"{m} imports {t} (line {line})" for m, targets in imports.items() for line, t in targets
                 if (m.startswith("nexrl_torch.train") and t.startswith("nexrl_torch.rollout"))
                 or (m.startswith("nexrl_torch.rollout") and t.startswith("nexrl_torch.train"))
                 or (m.startswith("nexrl_torch.") and t.startswith("nexrl_grpo"))
                 or (m.startswith("nexrl_torch_kernels") and t.startswith(("nexrl_torch.", "nexrl_grpo")))]
    assert crossings == []


def test_no_import_circle_in_the_backend_or_the_algorithm():
    assert import_circles(graph(("nexrl_torch", "nexrl_grpo", "nexrl_torch_kernels"))) == []
