"""Deprecated import paths of modules that moved into ``nexrl_core/config/`` and ``nexrl_core/cli/``.

Each old path is another name of the moved module (the same object, so an attribute set through
either reaches both) and warns once, when first imported. docs/changelog.md lists them.
"""

from __future__ import annotations

import importlib
import sys
import warnings
from types import ModuleType

# old dotted path -> new dotted path
MOVED = {
    "nexrl_core.options": "nexrl_core.config.options",
    "nexrl_core.schema": "nexrl_core.config.schema",
    "nexrl_core.compose": "nexrl_core.config.compose",
    "nexrl_core.preflight": "nexrl_core.config.preflight",
    "nexrl_core.migration_table": "nexrl_core.config.migration_table",
    "nexrl_core.migrate": "nexrl_core.config.migrate",
    "nexrl_core.cli_run": "nexrl_core.cli.run",
    "nexrl_core.run_log": "nexrl_core.cli.run_log",
    "nexrl_core.run_info": "nexrl_core.cli.run_info",
    "nexrl_core.progress": "nexrl_core.cli.progress",
    "nexrl_core.plot": "nexrl_core.cli.plot",
    "nexrl_core.scaffold": "nexrl_core.cli.scaffold",
    "nexrl_core.docgen": "nexrl_core.cli.docgen",
    "nexrl_core.show": "nexrl_core.cli.show",
    "nexrl_core.export": "nexrl_core.cli.export",
}
# The two modules that became packages: their names, read from the package, forward here.
MOVED_NAMES = {"nexrl_core.config": "nexrl_core.config.recipe", "nexrl_core.cli": "nexrl_core.cli.commands"}


def _warn(old: str, new: str, stacklevel: int) -> None:
    warnings.warn(f"{old} moved to {new}; import it from there ({old} is a deprecated alias)",
                  DeprecationWarning, stacklevel=stacklevel)


def alias(old: str) -> None:
    """Called by the old module itself: make ``old`` name the moved module, with one warning."""
    new = MOVED[old]
    module = importlib.import_module(new)
    _warn(old, new, stacklevel=4)  # the frame that imported ``old`` (import machinery frames are skipped)
    sys.modules[old] = module  # the import system hands out what sys.modules holds after the body ran


def forward(package: str, name: str) -> object:
    """A package's ``__getattr__``: an old module's name read from the package that replaced it."""
    new = MOVED_NAMES[package]
    module: ModuleType = importlib.import_module(new)
    if name.startswith("__") or not hasattr(module, name):
        raise AttributeError(f"module {package!r} has no attribute {name!r}")
    warned = _warned.setdefault(package, False)
    if not warned:
        _warned[package] = True
        _warn(f"{package}.{name}", f"{new}.{name}", stacklevel=4)
    return getattr(module, name)


_warned: dict[str, bool] = {}
