"""Fixtures: tiny models built offline (tests/support/torch_fixtures.py)."""

from tests.support.torch_fixtures import *  # noqa: F401,F403
