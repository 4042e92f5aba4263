"""The core's own components, loaded as default plugins.

Each module below is registered through the same plugin manager, hooks and isolation as a
third-party plugin: one that fails to import is reported and the others still load.
"""

from __future__ import annotations

# (plugin name, module): the order is the registration order.
DEFAULT_PLUGINS: tuple[tuple[str, str], ...] = (
    ("core.dataloaders", "nexrl_core.builtins.dataloaders"),
    ("core.workers", "nexrl_core.builtins.workers"),
    ("core.evaluators", "nexrl_core.builtins.evaluators"),
    ("core.openai", "nexrl_core.builtins.openai_client"),
    ("core.mock", "nexrl_core.builtins.mock"),
    ("core.weight_sync", "nexrl_core.builtins.weight_sync"),
    ("core.sinks", "nexrl_core.builtins.sinks"),
    ("core.algorithms", "nexrl_core.builtins.algorithms"),
)
