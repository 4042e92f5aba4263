"""Fixtures: tiny models built offline (tests/support/torch_fixtures.py)."""

from tests.support.torch_fixtures import *  # noqa: F401,F403

# `import *` skips underscored names: the autouse one-thread fixture must be named to apply here.
from tests.support.torch_fixtures import _one_torch_thread  # noqa: F401
