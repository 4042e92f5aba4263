"""Testing kit for plugin authors (``from nexrl_core.testing import ...``).

- :func:`plugin_manager` / :func:`use_plugins`: register a plugin module in-process, next to the
  core's built-ins (and, if asked, the installed plugins: an editable install of the package
  under test is registered once, not twice).
- :func:`run_recipe`: train a small recipe on the core's mock components with that plugin.
- :func:`make_recipe` / :func:`write_recipe`: a test's recipe as :data:`MOCK_RECIPE` (or another
  base) with keyword sections merged in, and written as YAML for ``load_recipe`` / ``nexrl run``;
  :data:`QUICK_MONITOR`: the ``runtime_monitor`` settings of a quick small run.
- :class:`MockInferenceClient`: the mock model of :data:`MOCK_RECIPE` (``mode: sum`` answers
  "A + B" right from a weight version on), to extend for a backend a test needs.
- :func:`build_module`: one module built as a run builds it, with its parts (a rollout worker's
  evaluator, a trainer's train service) from the plugin manager.
- :func:`trajectory_problem`: what a trajectory lacks for a trainer's contract (docs/extending.md).
- :func:`check_evaluator`: does an evaluator return valid results on sample data (its
  ``EXAMPLES``) and on odd replies? ``nexrl plugins check NAME`` runs the same check.

With nexrl-core installed, pytest provides the fixtures ``nexrl_plugins`` (a factory that installs
:func:`plugin_manager` as the process's plugin manager for the test) and ``nexrl_run``
(:func:`run_recipe` into the test's temporary folder).
"""

from ..builtins.mock import MockInferenceClient
from ..launch.parts import build_module
from ..trajectory_keys import trajectory_problem
from .conformance import ConformanceReport, check_evaluator, check_plugin, result_problems
from .kit import (
    MOCK_RECIPE,
    QUICK_MONITOR,
    RunResult,
    make_recipe,
    plugin_manager,
    run_recipe,
    use_plugins,
    write_recipe,
)

__all__ = ["MOCK_RECIPE", "QUICK_MONITOR", "ConformanceReport", "MockInferenceClient", "RunResult", "build_module",
           "check_evaluator", "check_plugin", "make_recipe", "plugin_manager", "trajectory_problem",
           "result_problems", "run_recipe", "use_plugins", "write_recipe"]
