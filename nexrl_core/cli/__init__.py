"""The ``nexrl`` command line.

- :mod:`.commands`: the parser and every subcommand (``main`` is the ``nexrl`` console script)
- :mod:`.run`: ``nexrl run``; :mod:`.progress` its live display; :mod:`.plot` ``metrics.png``
- :mod:`.show`, :mod:`.report`, :mod:`.export`, :mod:`.scaffold`: ``nexrl show``, ``nexrl report``,
  ``nexrl export``, ``nexrl new``
- :mod:`.migrate`: ``nexrl migrate`` (NexRL/ROLL recipes rewritten as nexrl recipes)
- :mod:`.docgen`: the generated reference pages (docs/recipe.md, docs/hooks.md, docs/migrating.md)
"""

__all__ = ["main"]


def __getattr__(name: str) -> object:
    # Imported on first use, so `import nexrl_core.cli.show` does not load the argument parser.
    if name == "main":  # the `nexrl` console script (pyproject.toml): nexrl_core.cli:main
        from .commands import main

        return main
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
