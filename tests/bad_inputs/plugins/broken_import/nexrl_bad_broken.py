"""A plugin whose import fails: it needs a package that is not installed."""

import nexrl_bad_missing_dependency  # noqa: F401  (does not exist)
