"""Testing kit for plugin authors (``from nexrl_core.testing import ...``).

- :func:`plugin_manager` / :func:`use_plugins`: register a plugin module in-process, next to the
  core's built-ins (and, if asked, the installed plugins: an editable install of the package
  under test is registered once, not twice).
- :func:`run_recipe`: train a small recipe on the core's mock components with that plugin.
- :func:`build_module`: one module built as a run builds it, with its parts (a rollout worker's
  evaluator, a trainer's train service) from the plugin manager.
- :func:`check_evaluator`: does an evaluator return valid results on sample data (its
  ``EXAMPLES``) and on odd replies? ``nexrl plugins check NAME`` runs the same check.

With nexrl-core installed, pytest provides the fixtures ``nexrl_plugins`` (a factory that installs
:func:`plugin_manager` as the process's plugin manager for the test) and ``nexrl_run``
(:func:`run_recipe` into the test's temporary folder).
"""

from ..launch.parts import build_module
from .conformance import ConformanceReport, check_evaluator, check_plugin, result_problems
from .kit import MOCK_RECIPE, RunResult, plugin_manager, run_recipe, use_plugins

__all__ = ["MOCK_RECIPE", "ConformanceReport", "RunResult", "build_module", "check_evaluator", "check_plugin", "plugin_manager",
           "result_problems", "run_recipe", "use_plugins"]
