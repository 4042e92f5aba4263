#!/usr/bin/env python
"""Write the generated reference pages: docs/hooks.md (from nexrl_core/hookspecs.py),
docs/recipe.md (every recipe key: nexrl_core/config/schema.py and the options of the components of
nexrl-core and of every plugin distribution under plugins/) and docs/migrating.md (the NexRL ->
nexrl table of nexrl_core/cli/migration_table.py, which `nexrl migrate` follows).

    python scripts/gen_docs.py          # rewrite the pages
    python scripts/gen_docs.py --check  # exit 1 when a page is out of date (what the test checks)
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path

import tomllib

ROOT = Path(__file__).resolve().parents[1]


def repo_plugins() -> list[tuple[str, str, str]]:
    """(entry-point name, module, distribution) of every plugin distribution in plugins/."""
    out = []
    for pyproject in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        project = tomllib.loads(pyproject.read_text(encoding="utf-8"))["project"]
        for name, module in project.get("entry-points", {}).get("nexrl", {}).items():
            out.append((name, module, project["name"]))
    return out


def pages() -> dict[Path, str]:
    """What each generated page must hold."""
    from nexrl_core.cli.docgen import hook_reference, migration_reference, recipe_reference
    from nexrl_core.plugins import CORE_DISTRIBUTION, PluginManager

    pm = PluginManager(load_entrypoints=False)  # the repository's plugins, not whatever is installed
    for name, module, dist in repo_plugins():
        pm.register(importlib.import_module(module), name=name, distribution=dist)
    dists = [CORE_DISTRIBUTION] + [dist for _, _, dist in repo_plugins()]
    return {ROOT / "docs" / "hooks.md": hook_reference(), ROOT / "docs" / "recipe.md": recipe_reference(pm, dists),
            ROOT / "docs" / "migrating.md": migration_reference()}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--check", action="store_true", help="only report pages that are out of date")
    args = parser.parse_args()
    stale = []
    for path, text in pages().items():
        current = path.read_text(encoding="utf-8") if path.exists() else None
        if current == text:
            continue
        stale.append(path.relative_to(ROOT))
        if not args.check:
            path.write_text(text, encoding="utf-8")
    for path in stale:
        print(f"{path}: {'out of date' if args.check else 'written'}")
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
