"""What plugins mark their hook functions with, and name a class they register without importing it."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from typing import Any

import pluggy

hookimpl = pluggy.HookimplMarker("nexrl")


@dataclass(frozen=True)
class Lazy:
    """A registered class or function named by its ``"module:attribute"`` path, as a hook's value
    (``{"my_trainer": Lazy("my_package.trainer:MyTrainer")}``): the plugin manager imports it when
    a recipe selects it or something reads its declarations, so loading the plugin does not import
    what the class needs (torch, an SDK) for recipes that use other components."""

    path: str

    def well_formed(self) -> bool:
        module, _, attribute = self.path.partition(":") if isinstance(self.path, str) else ("", "", "")
        return bool(module) and bool(attribute)

    def load(self) -> Any:
        module, _, attribute = self.path.partition(":")
        return functools.reduce(getattr, attribute.split("."), importlib.import_module(module))
