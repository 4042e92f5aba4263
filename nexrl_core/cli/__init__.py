"""The ``nexrl`` command line and what a run leaves on disk.

- :mod:`.commands`: the parser and every subcommand (``main`` is the ``nexrl`` console script)
- :mod:`.run`: ``nexrl run``; :mod:`.progress` its live display; :mod:`.plot` ``metrics.png``
- :mod:`.run_log`: the run directory's metrics, samples, errors and log file; :mod:`.run_info`:
  its ``config.yaml`` and ``run.json``
- :mod:`.show`, :mod:`.report`, :mod:`.export`, :mod:`.scaffold`: ``nexrl show``, ``nexrl report``,
  ``nexrl export``, ``nexrl new``
- :mod:`.docgen`: the generated reference pages (docs/recipe.md, docs/hooks.md, docs/migrating.md)
"""

__all__ = ["main"]


def __getattr__(name: str) -> object:
    # Imported on first use, so the run-directory modules load without the argument parser.
    if name == "main":  # the `nexrl` console script (pyproject.toml): nexrl_core.cli:main
        from .commands import main

        return main
    # Any other name of the module this package replaced (now cli.commands): a DeprecationWarning.
    from .._moved import forward

    return forward(__name__, name)
