"""The core's own components, loaded as default plugins.

Each module below is registered through the same plugin manager, hooks and isolation as a
third-party plugin: one that fails to import is reported and the others still load.
"""

from __future__ import annotations

from ..plugins import DEFAULT_PLUGINS

__all__ = ["DEFAULT_PLUGINS"]
