"""Deprecated alias of :mod:`nexrl_core.config.preflight` (moved there; see docs/changelog.md)."""

from ._moved import alias

alias(__name__)
